"""A character-level byte-BPE stand-in for the engine's tokenizer, and a random
walk through a grammar: structured-output tests that need xgrammar but no model."""

from __future__ import annotations

import os
import random
import threading
from types import SimpleNamespace

from engine.sampling_params import SamplingParams
from engine.worker.structured_outputs import StructuredOutputManager

_CLOSERS = set('"}],')


class CharTokenizer:
    """One token per printable ASCII character (GPT-2 byte-level spelling: ' ' is 'Ġ'), then EOS."""

    def __init__(self) -> None:
        self.vocab = [chr(c) for c in range(33, 127)] + ["Ġ", "</s>"]
        self.vocab_size = len(self.vocab)
        self.eos_token_id = self.vocab_size - 1

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[i] for i in ids]

    def text(self, ids: list[int]) -> str:
        return "".join(" " if self.vocab[i] == "Ġ" else self.vocab[i] for i in ids if i != self.eos_token_id)


def manager(**limits) -> tuple[StructuredOutputManager, CharTokenizer]:
    from engine.worker.grammar_compiler import GrammarLimits

    tok = CharTokenizer()
    return StructuredOutputManager(tok, tok.vocab_size, GrammarLimits(**limits)), tok


def allowed(mask_row, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(mask_row[t // 32]) >> (t % 32)) & 1]


def walk(so: StructuredOutputManager, tok: CharTokenizer, spec, rng: random.Random, *, limit: int = 400,
         rid: str = "walk", **params) -> tuple[list[int], bool]:
    """Sample a sequence the way the engine does (mask, pick an allowed token, accept) with random picks;
    (token ids, ended) where ended means the grammar or a stop token ended it within ``limit`` tokens."""
    sp = SamplingParams(structured_outputs=spec, **params)
    req = SimpleNamespace(request_id=rid, num_output_tokens=0, sampling_params=sp)
    so.add(rid, spec, sp.stop_token_ids)
    out: list[int] = []
    try:
        for _ in range(limit):
            mask = so.grammar_bitmask([req])
            choices = allowed(mask.bitmask[0], tok.vocab_size)
            assert choices, f"every token masked after {tok.text(out)!r}"
            ends = [t for t in choices if t == tok.eos_token_id or t in sp.stop_token_ids]
            closers = [t for t in choices if tok.vocab[t] in _CLOSERS]
            if ends and (len(ends) == len(choices) or rng.random() < 0.5):
                t = rng.choice(ends)
            elif closers and rng.random() < 0.3:
                t = rng.choice(closers)
            else:
                t = rng.choice([c for c in choices if c not in ends])
            out.append(t)
            req.num_output_tokens += 1
            stop = t in sp.stop_token_ids and not so.is_content(rid, t)
            if so.accept(rid, t) or stop or t == tok.eos_token_id:
                return out, True
        return out, False
    finally:
        so.free(rid)


def probe_check(params) -> None:
    """A spec check for the compile-pool tests (run in a check worker process): regex "pid" is refused
    naming the process that checked it, "spin" computes forever, "sleep" never answers and uses no CPU,
    anything else passes."""
    if params.regex == "pid":
        raise ValueError(f"checked in process {os.getpid()}")
    if params.regex == "spin":
        while True:
            pass
    if params.regex == "sleep":
        threading.Event().wait()
