"""Draft-model proposals (vLLM's ``method: draft_model``): a smaller model of any registered architecture with
the target's tokenizer guesses each sequence's next k tokens greedily, one batched forward per depth.

Its keys and values live in the target's paged pool: every block id holds the target's KV in the target's pool
tensor and the draft's in a draft pool tensor of the draft's shape (``ModelRunner`` of the draft, indexed by the
same block tables), and the pool's size counts both (``ModelRunner.determine_num_blocks``' ``extra_block_bytes``).
A proposal first makes the sequence's block table long enough for the draft's own guesses (the verify step needs
those slots anyway). The draft's KV of a sequence stays valid for the tokens it computed that are still the
sequence's (accepted guesses included); a block table that changed otherwise than by growing (copy-on-write after
a fork, preemption, swap) makes the draft compute the whole sequence again.

Guesses are the draft's argmax, a point-mass draft distribution: the verification rule
(``rejection.py``) is the standard one for it, and the outputs are the target's alone, bit for bit.

A draft of a shorter context than the target's (its ``max_position_embeddings``) guesses only while its guesses
fit in it: a sequence past it gets no proposal (as vLLM caps the draft's ``max_model_len``), never a position
outside the draft's RoPE tables (a trial's 321-token prompt on a 128-position draft failed the whole step).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_NO_LOGPROBS = SamplingParams(max_tokens=1)   # what the draft runner reads of a sequence's sampling parameters


@dataclass
class DraftModel:
    """A loaded draft model.

    Attributes:
        model: the model (eval mode, the target's device and dtype).
        config: its ``ModelConfig``.
        args: the engine args it was loaded with (the target's, with ``model`` the draft's path).
        max_len: its context, tokens: its ``max_position_embeddings``, or the config's ``max_model_len`` below it.
    """

    model: torch.nn.Module
    config: object
    args: object
    max_len: int


def load_draft_model(args, spec, tokenizer, model_config) -> DraftModel:
    """Load the draft model of ``spec`` (``SpeculativeConfig``: its ``model`` path, its ``max_model_len``) with the
    target's engine args (device, dtype, threads).

    Raises:
        ValueError: its tokenizer or vocabulary differs from the target's (``tokenizer``, ``model_config``).
        FileNotFoundError: no such model.
    """
    from engine.model_loader import load_model

    path = spec.model
    draft_args = dataclasses.replace(args, model=path, speculative_config=None, quantization="none")
    model, draft_tokenizer, config = load_model(draft_args)
    if config.vocab_size != model_config.vocab_size or draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"speculative_config.model {path!r} has a vocabulary of {config.vocab_size} ids "
                         f"({draft_tokenizer.vocab_size} tokens), the target {model_config.vocab_size} "
                         f"({tokenizer.vocab_size}): a draft model needs the target's tokenizer")
    ids = list(range(tokenizer.vocab_size))
    if (draft_tokenizer.convert_ids_to_tokens(ids) != tokenizer.convert_ids_to_tokens(ids)
            or draft_tokenizer.eos_token_id != tokenizer.eos_token_id):
        raise ValueError(f"speculative_config.model {path!r} has another tokenizer than the target (other tokens "
                         "or EOS): a draft model needs the target's tokenizer")
    logger.info("draft model %s: %s, %d layers, hidden %d", path, config.name, config.num_hidden_layers,
                config.hidden_size)
    max_len = min(config.max_position_embeddings, spec.max_model_len or config.max_position_embeddings)
    limit = args.max_model_len or model_config.max_position_embeddings
    if max_len < limit:
        logger.warning("draft model %s has a context of %d tokens, the target up to %d: sequences past %d tokens "
                       "are not speculated", path, max_len, limit, max_len)
    return DraftModel(model=model, config=config, args=draft_args, max_len=max_len)


class _Extended:
    """A sequence as the draft's runner reads it: its tokens followed by the draft's guesses so far."""

    sampling_params = _NO_LOGPROBS
    pooling_params = None

    def __init__(self, request_id: str, all_token_ids: list[int], num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.all_token_ids = all_token_ids
        self.num_prompt_tokens = num_prompt_tokens


@dataclass
class _DraftState:
    """What the draft's KV holds for one sequence: the tokens at positions 0.. whose keys and values it wrote,
    in the blocks ``block_ids`` (the sequence's table when it wrote them)."""

    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy proposals of a draft model over the target's block tables.

    Args:
        runner: the draft's ``ModelRunner`` (its own pool tensor, the target's number of blocks).
        kv_cache_manager: the target's (block tables; the slots the guesses need).
        max_len: the draft's context in tokens (``DraftModel.max_len``): a sequence's tokens and guesses stay
            within it.
    """

    def __init__(self, runner, kv_cache_manager, max_len: int) -> None:
        self.runner = runner
        self.kv = kv_cache_manager
        self.max_len = max_len
        self._state: dict[str, _DraftState] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of sequences no longer running (their blocks may be gone)."""
        for rid in request_ids:
            self._state.pop(rid, None)

    def _valid(self, req: Request, block_ids: list[int]) -> int:
        """Tokens of ``req`` whose draft KV is in its blocks (0 when its table changed otherwise than growing)."""
        st = self._state.get(req.request_id)
        if st is None or block_ids[:len(st.block_ids)] != st.block_ids:
            return 0
        n, tokens = 0, req.all_token_ids
        for a, b in zip(st.tokens, tokens):
            if a != b:
                break
            n += 1
        return n

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Each request's ``k`` greedy guesses, fewer where the draft's context ends first (empty where its blocks
        cannot hold them, or the sequence fills the draft's context)."""
        drafts: list[list[int]] = [[] for _ in requests]
        live = []   # (index, request, k, draft computed tokens, block ids)
        for i, (req, k) in enumerate(zip(requests, ks)):
            k = min(k, self.max_len - req.num_tokens)   # the last guess's position is num_tokens + k - 2
            if k <= 0 or not self.kv.allocate_slots(req, k):
                continue
            block_ids = self.kv.get_block_ids(req.request_id)
            live.append((i, req, k, min(self._valid(req, block_ids), req.num_tokens - 1), block_ids))
        depth = 0
        while live:
            out = SchedulerOutput()
            for i, req, _, computed, block_ids in live:
                seq = _Extended(req.request_id, req.all_token_ids + drafts[i], req.num_prompt_tokens)
                start = computed if depth == 0 else req.num_tokens + depth - 1
                new = len(seq.all_token_ids) - start
                out.scheduled.append(ScheduledRequest(seq, start, new, block_ids, True))
                out.num_batched_tokens += new
            logits = self.runner.execute_model(out).logits
            for (i, *_), tok in zip(live, torch.argmax(logits, dim=-1).tolist()):
                drafts[i].append(tok)
            depth += 1
            live = [entry for entry in live if entry[2] > depth]
        for req, guess in zip(requests, drafts):
            if guess:
                self._state[req.request_id] = _DraftState(
                    tokens=req.all_token_ids + guess[:-1], block_ids=self.kv.get_block_ids(req.request_id))
        return drafts
