"""What a chunk of a prompt costs a step, in token-equivalents, and the share of a step that pooling requests'
chunks may take when the step also serves generation (issue 49: an 8,000-token embedding held a running stream
168x its p99 gap).

A chunk of ``tokens`` query rows after ``context`` computed tokens runs every linear layer once per row, and
attention over ``attention_pairs(tokens, context)`` (query, key) pairs: row j attends to ``context + j + 1`` keys
(causal). One token-equivalent is one row's linear layers (its multiply-adds: the layers' weights); one pair costs
``2 * num_heads * head_dim`` multiply-adds a layer (scores, then the weighted values), each ``ATTENTION_COST_RATIO``
times a linear layer's, so ``pairs_per_token`` pairs cost a token-equivalent (SmolLM2-135M on CPU: 614). A row at
8,000 tokens of context costs 14 token-equivalents: under a fixed token budget a long input's late chunks cost
several times its first ones. Sliding-window layers are counted as full ones (an overestimate: the safer side).

``PoolingBudget`` is what the scheduler sizes a pooling request's chunk by. While generation work is queued or
running (a decode row, a prompt being prefilled or waiting) a step's pooling chunks together cost at most
``step_cost`` token-equivalents, so the step stays within about twice a plain decode step (``POOLING_STEP_COST``).
With no generation work they cost at most ``alone_cost``, what a chunk of the engine's token budget costs at the
start of a prompt, so a request arriving meanwhile waits at most such a step (a 512-token chunk 7,500 tokens into an
input costs ~10x a fresh one). The step's first pooling chunk gets one token whatever it costs, so every input
progresses. Chunk boundaries change no bit of an embedding (the kernels are chunk- and batch-invariant,
``engine/pooling.py``).

Past ~4,300 tokens of an input (SmolLM2 on CPU) one token through every layer costs more than ``step_cost``: its
attention over the computed tokens in 30 layers was 2-30x a decode step (issue 49). Such a chunk is carried through
part of the layers per step (``StepAllowance.split``): the most tokens of which one layer fits the allowance, run
through as many layers as fit, their hidden state kept by the model runner between steps and their keys and values
written layer by layer; their tokens count as computed after the last layer. The arithmetic of each layer is the
same, so the vector keeps its bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.model_config import ModelConfig

# What an attention multiply-add costs in linear-layer multiply-adds, by device. On this CPU (AVX512-BF16, one
# thread, SmolLM2-135M bf16, min of 7 steps each, a decode row beside) a prompt token's linear layers took ~1.0 ms and
# an attention pair ~1.6 us at 2,048 tokens of context: 4.9x its multiply-adds' share (the attention kernel adds
# float32 values row by row; the linear layers run VDPBF16PS panels); at 7,680 tokens ~2.5-3 us (the context no
# longer in cache), where chunks beside a decode row are one token anyway. CUDA: not measured (1: multiply-adds).
ATTENTION_COST_RATIO = {"cpu": 5.0, "cuda": 1.0}
# Token-equivalents pooling chunks may add to a step that serves generation, by device: about the cost of the decode
# step itself, so the step takes at most ~2x. On this CPU (AVX512-BF16, one thread, SmolLM2-135M bf16, min of 7) a
# decode step took 11.8 ms and a prompt token ~1 ms beside it: a decode step is ~12 token-equivalents (its weights
# are read for one row); 8 leaves room for the noise of a shared host. On CUDA a decode step is memory-bound for
# hundreds of rows (not measured here).
POOLING_STEP_COST = {"cpu": 8.0, "cuda": 256.0}


def pairs_per_token(cfg: ModelConfig, cost_ratio: float) -> float:
    """Attention (query, key) pairs that cost as much as one token's linear layers (q, k, v, o and the gated MLP)
    for ``cfg``'s shapes, an attention multiply-add costing ``cost_ratio`` linear ones (``ATTENTION_COST_RATIO``)."""
    h, d = cfg.hidden_size, cfg.head_dim
    weights = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * cfg.intermediate_size
    return weights / (2 * cfg.num_attention_heads * d * cost_ratio)


def attention_pairs(tokens: int, context: int) -> int:
    """(query, key) pairs a causal chunk of ``tokens`` rows after ``context`` computed tokens attends over."""
    return tokens * context + tokens * (tokens + 1) // 2


@dataclass(frozen=True)
class PoolingBudget:
    """How pooling chunks are sized beside generation work.

    Attributes:
        pairs_per_token: attention pairs per token-equivalent (``pairs_per_token``).
        step_cost: token-equivalents a step's pooling chunks may cost together while generation work is
            queued or running (``POOLING_STEP_COST``).
        alone_cost: the same with no generation work (a ``max_num_batched_tokens`` chunk's cost at the start of a
            prompt; inf: no limit but the token budget).
        num_layers: the model's decoder layers, over which a chunk may be split across steps (0: never split,
            e.g. over several tensor-parallel ranks, which receive a step's inputs only).
    """

    pairs_per_token: float
    step_cost: float
    alone_cost: float = math.inf
    num_layers: int = 0

    def __post_init__(self) -> None:
        if not (self.pairs_per_token > 0 and self.step_cost > 0 and self.alone_cost > 0):
            raise ValueError(f"pairs_per_token, step_cost and alone_cost must be > 0, got {self.pairs_per_token}, "
                             f"{self.step_cost}, {self.alone_cost}")

    def chunk_cost(self, tokens: int, context: int) -> float:
        """Token-equivalents of a chunk of ``tokens`` rows after ``context`` computed tokens."""
        return tokens + attention_pairs(tokens, context) / self.pairs_per_token

    def max_tokens(self, context: int, cost: float) -> int:
        """The most rows a chunk after ``context`` computed tokens may have within ``cost`` token-equivalents (0
        when not one): the root of ``chunk_cost(q) = q^2 / 2P + q (1 + (context + 1/2) / P) = cost``, floored and
        checked against ``chunk_cost`` (float rounding)."""
        if cost <= 0:
            return 0
        p = self.pairs_per_token
        b = 1.0 + (context + 0.5) / p
        q = int(2.0 * cost / (b + math.sqrt(b * b + 2.0 * cost / p)))
        while q > 0 and self.chunk_cost(q, context) > cost:
            q -= 1
        while self.chunk_cost(q + 1, context) <= cost:
            q += 1
        return q

    def layer_cost(self, tokens: int, context: int) -> float:
        """Token-equivalents of one layer of a chunk (``chunk_cost`` over ``num_layers``: the layers have one
        shape)."""
        return self.chunk_cost(tokens, context) / self.num_layers

    def layers_within(self, tokens: int, context: int, cost: float, layers: int) -> int:
        """The most of ``layers`` layers a chunk of ``tokens`` rows after ``context`` computed tokens may run
        through within ``cost`` token-equivalents (0 when not one)."""
        per = self.layer_cost(tokens, context)
        n = min(layers, int(cost / per)) if cost > 0 else 0
        while n > 0 and n * per > cost:
            n -= 1
        return n


def device_pairs_per_token(cfg: ModelConfig, device_type: str) -> float:
    """``pairs_per_token`` of ``cfg`` on a ``device_type`` ("cpu", "cuda") device (``ATTENTION_COST_RATIO``)."""
    return pairs_per_token(cfg, ATTENTION_COST_RATIO.get(device_type, 1.0))


def pooling_budget(cfg: ModelConfig, device_type: str, max_num_batched_tokens: int,
                   split_layers: bool = True) -> PoolingBudget:
    """The engine's ``PoolingBudget`` for ``cfg`` on a ``device_type`` ("cpu", "cuda") device with a step budget
    of ``max_num_batched_tokens`` tokens; ``split_layers``: whether a chunk may run through part of the layers
    per step."""
    ppt = device_pairs_per_token(cfg, device_type)
    step_cost = POOLING_STEP_COST.get(device_type, POOLING_STEP_COST["cuda"])
    return PoolingBudget(ppt, step_cost, PoolingBudget(ppt, step_cost).chunk_cost(max_num_batched_tokens, 0),
                         cfg.num_hidden_layers if split_layers else 0)


class StepAllowance:
    """One step's allowance for pooling chunks: ``budget.step_cost`` token-equivalents while ``generation`` (work
    that samples is queued or running), else ``budget.alone_cost`` (no budget: no limit but the step's tokens). The
    step's first pooling chunk gets a token (or, split, a layer) whatever it costs."""

    def __init__(self, budget: PoolingBudget | None, generation: bool) -> None:
        self.budget = budget
        self.left = math.inf if budget is None else budget.step_cost if generation else budget.alone_cost
        self.first = True

    def limit(self, pooling: bool, computed: int, tokens: int) -> int:
        """The tokens a request (a ``pooling`` one or not) may compute this step after ``computed``, out of
        ``tokens`` the step's budget leaves."""
        if self.budget is None or not pooling or self.left == math.inf:
            return tokens
        return min(tokens, max(self.budget.max_tokens(computed, self.left), int(self.first)))

    def split(self, pooling: bool, computed: int, tokens: int, layers_done: int = 0,
              chunk_tokens: int = 0) -> tuple[int, tuple[int, int] | None] | None:
        """A pooling chunk carried through part of the layers this step: (its tokens, (first layer, end layer)),
        (0, None) when it waits this step, or None when the step's chunk runs through every layer (``limit``
        sizes it). ``tokens``: the most the step's budget and the request leave.

        A chunk in flight (``layers_done`` > 0 layers run, ``chunk_tokens`` tokens) goes on through as many of
        its remaining layers as the allowance holds. A new chunk is split when one token through every layer
        costs more than the allowance: the most tokens of which one layer fits, through as many layers as fit
        (more tokens through fewer layers: a layer's weights and a context's keys are read once for all rows).
        """
        b = self.budget
        if b is None or not pooling or b.num_layers < 2:
            return None
        if layers_done:
            remaining = b.num_layers - layers_done
            if chunk_tokens > tokens:
                return 0, None
            n = remaining if self.left == math.inf else b.layers_within(chunk_tokens, computed, self.left, remaining)
            n = max(n, int(self.first))
            return (chunk_tokens, (layers_done, layers_done + n)) if n else (0, None)
        if self.left == math.inf or b.max_tokens(computed, self.left) > 0 or tokens <= 0:
            return None
        q = max(min(tokens, b.max_tokens(computed, self.left * b.num_layers)), int(self.first))
        n = max(b.layers_within(q, computed, self.left, b.num_layers), int(self.first)) if q else 0
        return (q, (0, n)) if n else (0, None)

    def spend(self, pooling: bool, computed: int, tokens: int, layers: tuple[int, int] | None = None) -> None:
        """Charge a chunk of ``tokens`` after ``computed`` that the step scheduled (of a ``pooling`` request or not)
        through ``layers`` (first, end; None: every layer)."""
        if self.budget is not None and pooling:
            if layers is None:
                self.left -= self.budget.chunk_cost(tokens, computed)
            else:
                self.left -= (layers[1] - layers[0]) * self.budget.layer_cost(tokens, computed)
            self.first = False
