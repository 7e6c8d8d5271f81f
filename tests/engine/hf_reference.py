"""HF transformers' greedy references for SmolLM2 (float32), computed once and kept in tests/data/
(or, for full logits too large for the repository, in a cache directory).

transformers' float32 generation of 8 prompts x 64 tokens is the most expensive part of
``test_engine_parity.py`` on a CPU, and its result is a pure function of the model file, the prompt
ids, the token count and the transformers/torch versions. ``reference`` reads it from
``tests/data/smollm2_hf_greedy.json`` when the file's key (a SHA-256 over all of those) matches, and
recomputes it with the live model otherwise (nothing is ever skipped). A parity check needs, per step,
only the reference token, that token's log-probability and the top-2 logit gap, which is what is stored.

Refresh the file after a change to any input (the test then uses the live model until this is run):

    python -m tests.engine.hf_reference

``logits_reference`` does the same for ``test_model_smollm2.py``'s full-logit check (20 steps x 49152
float32 logits, 3.9 MB: too large for tests/data): it keeps its result under ``$TANDEM_TEST_CACHE``
(default ``~/.cache/tandem/test-references``), one file per key, written on the first run that computes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from loadtests.workloads import MT_BENCH_PATH

DATA = Path(__file__).resolve().parents[1] / "data"
CACHE = DATA / "smollm2_hf_greedy.json"
MT_BENCH = MT_BENCH_PATH


@dataclass
class Reference:
    """One prompt's greedy continuation by transformers: per generated step ``i``, ``token_ids[i]``,
    its log-probability ``logprobs[i]`` (float32 log-softmax, in nats) and ``top2_gaps[i]``, the
    difference of the two largest float32 logits."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top2_gaps: list[float]


def conversations(num_prompts: int) -> list[list[dict]]:
    """The first ``num_prompts`` MT-Bench turn-1 questions as one-message chats."""
    lines = MT_BENCH.read_text().splitlines()[:num_prompts]
    return [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines]


def prompt_ids(tok, num_prompts: int) -> list[list[int]]:
    """The chat-templated prompts as token ids by ``tok`` (the engine's tokenizer, as ``LLM.chat`` makes them)."""
    return [tok.apply_chat_template(conv, add_generation_prompt=True)
            for conv in conversations(num_prompts)]


def cache_key(model_path: str, prompts: list[list[int]], new_tokens: int) -> str:
    """SHA-256 (hex) of everything the reference depends on: the model file's bytes, the prompt ids,
    the number of new tokens and the transformers and torch versions."""
    return _key(model_path, {"prompts": prompts, "new_tokens": new_tokens, "dtype": "float32", "greedy": True})


def _key(model_path: str, inputs: dict) -> str:
    """SHA-256 (hex) of the model file's bytes, then ``inputs`` with the transformers and torch versions as JSON."""
    import torch
    import transformers

    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    h.update(json.dumps({**inputs, "transformers": transformers.__version__, "torch": torch.__version__}).encode())
    return h.hexdigest()


def compute(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int) -> list[Reference]:
    """Greedy generation by the transformers ``model``, each prompt alone (no padding)."""
    import torch

    refs = []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=pad_token_id,
            )
        gen = out.sequences[0, len(ids):].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float()      # [steps, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(gen)), torch.tensor(gen)]
        top2 = torch.topk(logits, 2, dim=-1).values
        refs.append(Reference(ids, gen, [float(x) for x in logprobs], [float(x) for x in top2[:, 0] - top2[:, 1]]))
    return refs


def load(key: str) -> list[Reference] | None:
    """The stored references when ``tests/data``'s file was made for ``key``, else None."""
    if not CACHE.exists():
        return None
    data = json.loads(CACHE.read_text())
    if data.get("key") != key:
        return None
    return [Reference(**r) for r in data["references"]]


def reference(tok, model_path: str, num_prompts: int, new_tokens: int, load_model) -> list[Reference]:
    """The references for the first ``num_prompts`` prompts (``tok``: the engine's tokenizer of the GGUF at
    ``model_path``): stored ones when their key matches, else computed with ``load_model()`` (a
    transformers model, only called then)."""
    prompts = prompt_ids(tok, num_prompts)
    stored = load(cache_key(model_path, prompts, new_tokens))
    if stored is not None:
        return stored
    return compute(load_model(), prompts, new_tokens, tok.eos_token_id)


def cache_dir() -> Path:
    """Where references too large for tests/data are kept: ``$TANDEM_TEST_CACHE``, default
    ``~/.cache/tandem/test-references`` (as the kernels' ``$TANDEM_KERNEL_CACHE``)."""
    return Path(os.environ.get("TANDEM_TEST_CACHE", Path.home() / ".cache" / "tandem" / "test-references"))


def greedy_logits(model, prompt: list[int], steps: int, pad_token_id: int):
    """transformers' greedy continuation of ``prompt`` by ``model``, ``steps`` tokens with no stop token:
    the generated ids and the float32 logits of each step, ``[steps, vocab]``."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: a prompt may hold the pad token (<|im_end|> in SmolLM2)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=pad_token_id)
    return ref.sequences[0, len(prompt):].tolist(), torch.stack([step[0].float() for step in ref.logits])


def logits_reference(model_path: str, prompt: list[int], steps: int, pad_token_id: int, load_model):
    """``greedy_logits`` of the transformers model of the GGUF at ``model_path``: read from ``cache_dir()``
    when a file was made for exactly this model file, prompt, step count, pad id and transformers/torch
    versions, else computed with ``load_model()`` (only called then) and stored there."""
    import torch

    key = _key(model_path, {"prompt": prompt, "steps": steps, "pad_token_id": pad_token_id, "dtype": "float32",
                            "greedy": True, "eos_token_id": None, "output": "logits"})
    path = cache_dir() / f"smollm2_hf_logits_{key}.pt"
    if path.exists():
        stored = torch.load(path, weights_only=True)
        return stored["token_ids"], stored["logits"]
    token_ids, logits = greedy_logits(load_model(), prompt, steps, pad_token_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # another worker may write the same file: replace atomically
    torch.save({"token_ids": token_ids, "logits": logits}, tmp)
    os.replace(tmp, path)
    return token_ids, logits


def load_hf_smollm2():
    """transformers' Llama reading the embedded SmolLM2 GGUF (dequantized, float32, eval mode)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def main() -> None:
    """Recompute the references of ``test_engine_parity.py`` and write them to tests/data/."""
    from engine.config import default_model_path
    from engine.tokenizer import Tokenizer
    from tests.engine.test_engine_parity import NEW_TOKENS, NUM_PROMPTS

    path = default_model_path()
    tok = Tokenizer.from_gguf(path)
    prompts = prompt_ids(tok, NUM_PROMPTS)
    refs = compute(load_hf_smollm2(), prompts, NEW_TOKENS, tok.eos_token_id)
    CACHE.write_text(json.dumps({"key": cache_key(path, prompts, NEW_TOKENS),
                                 "references": [asdict(r) for r in refs]}) + "\n")
    print(f"wrote {CACHE}")


if __name__ == "__main__":
    main()
