"""Model runner: turns a SchedulerOutput into one forward pass over the paged KV cache.

It owns the KV pool (vLLM's layout: per layer key and value caches
[num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
that pads block tables) and the CPU swap pool, builds the flat batch (input
ids, positions, slot mapping, block tables, query start locations, sequence
lengths) for a mixed batch of prefill chunks and decodes, and returns logits
only for the rows that need them. Past tokens are never recomputed: each
request feeds only ``all_token_ids[num_computed_tokens : +num_new_tokens]``.
A pooling chunk scheduled through part of the layers (``ScheduledRequest.layers``)
runs after the step's batch, in a pass of its own over its layers, its hidden
state kept here from one step to the next.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineArgs
from engine.model_config import ModelConfig
from engine.models.c_stack import decode_weight_bytes
from engine.model_loader import release_freed_memory
from engine.pooling import rows_needed
from engine.models.llama import AttentionMetadata
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.distributed.parallel_state import RankFailure
from engine.worker.cpu_threads import follow_load
from engine.worker.step_inputs import STEP, StepInputs

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Logits of one step.

    Attributes:
        logits: [num_sample_rows, vocab_size] float32, one row per scheduled
            entry with ``sample=True``, in batch order (the logits of its last
            computed position).
        sample_indices: for each logits row, the index into ``out.scheduled``.
        prompt_logits: request_id -> [num_new_tokens, vocab_size] float32
            logits of every position of this step's chunk (row j predicts the
            token at position num_computed_tokens + j + 1), only for requests
            whose ``sampling_params.prompt_logprobs`` is not None and whose
            chunk starts inside the prompt.
        pooled_hidden: request_id -> (first position, [rows, hidden_size] final hidden states) of the rows of
            this step's chunk that a pooling request's pooling reads (``engine/pooling.py``'s ``rows_needed``).
        spec_logits: request_id -> [len(spec_token_ids), vocab_size] float32
            logits at the positions before the last one of an entry with
            proposals (row j: the prediction after its known tokens and the
            first j proposals; ``logits`` holds the one after all of them).
        step_tokens: for a step of several decode steps (``SchedulerOutput.num_steps``), per entry (in
            ``sample_indices``' order) the token each step chose; ``logits`` is then empty.
    """

    logits: torch.Tensor
    sample_indices: list[int] = field(default_factory=list)
    prompt_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    pooled_hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    spec_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    step_tokens: list[list[int]] = field(default_factory=list)


def _column(pairs: np.ndarray, i: int) -> torch.Tensor:
    """Column ``i`` of [n, 2] int64 block pairs as a tensor."""
    return torch.from_numpy(np.ascontiguousarray(pairs[:, i]))


def resident_bytes() -> int:
    """This process's resident set size now, bytes (Linux ``VmRSS``; 0 where unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _available_host_memory() -> int:
    """Bytes of host memory available now (Linux ``MemAvailable``, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Runs the model for one scheduler step.

    Over several tensor-parallel ranks (``tp``) every rank has one: the
    driver's turns the scheduler's decisions into the step's inputs and
    broadcasts them (``execute_model``), each rank runs them on its part of
    the model and of the KV cache (``run``), and the driver gets the logits.

    Args:
        args: EngineArgs (block_size, max_model_len are read; load_model
            applies num_threads).
        model: a ``LlamaForCausalLM`` on ``device`` in ``dtype`` (this rank's part of it).
        model_config: the model's shape.
        device, dtype: where the KV pool lives, and its dtype (the model's).
        num_blocks: device KV blocks including the null block 0.
        num_cpu_blocks: CPU swap blocks (0 = no swapping).
        tp: the ``TensorParallelGroup`` with several ranks, else None.

    Attributes:
        kv_caches: per layer (key_cache, value_cache) views of one pool tensor
            [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
            (this rank's KV heads).
    """

    def __init__(self, args, model, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, num_cpu_blocks: int = 0, tp=None) -> None:
        self.model = model
        self.tp = tp
        self.config = model_config
        model.prepack_weights()  # bf16 on CPU: the C kernel's panels (dense copies freed) or oneDNN's blocked weights
        release_freed_memory()
        model.set_batch_invariant(getattr(args, "batch_invariant", True))
        # on CPU without a fixed num_threads, each step's threads follow the machine's load (cpu_threads.py)
        self.cpu_threads = follow_load(torch.device(device).type, getattr(args, "num_threads", None))
        max_len = getattr(args, "max_model_len", None)
        if max_len and (model.rope_cos is None or model.rope_cos.shape[0] < max_len):
            model.build_rope_cache(max(max_len, model_config.max_position_embeddings))
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = args.block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        c = model_config
        shape = (c.num_hidden_layers, 2, num_blocks, self.block_size, model.shard.num_kv_heads, c.head_dim)
        # An explicit write commits every page of the pool now (RSS does not
        # grow later as blocks are first used; blocks past a sequence read as 0).
        self.kv_pool = torch.empty(shape, dtype=dtype, device=self.device)
        self.kv_pool.zero_()
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(c.num_hidden_layers)]
        self.cpu_pool = None
        if num_cpu_blocks > 0:
            cpu_shape = shape[:2] + (num_cpu_blocks,) + shape[3:]
            self.cpu_pool = torch.zeros(cpu_shape, dtype=dtype, device="cpu",
                                        pin_memory=self.device.type == "cuda")
        # request id -> [tokens, hidden_size] residual stream of its pooling chunk between two steps' layers
        self.layer_hidden: dict[str, torch.Tensor] = {}
        self._weight_read: int | None = None   # decode_read_bytes' weights
        self._kv_token_bytes = self.kv_pool[:, :, 0, 0].numel() * self.kv_pool.element_size()  # all layers' K and V

    # --------------------------------------------------------------- memory
    def memory_report(self, rss_before_load: int) -> dict:
        """This rank's memory: ``weight_bytes`` (the loader's count, ``LlamaForCausalLM.weight_bytes``),
        ``kv_bytes`` (the device KV pool), ``rss_weights_bytes`` (resident growth since ``rss_before_load``,
        measured before the model was loaded, less the KV pool when on CPU) and ``rank``."""
        kv = self.kv_pool.numel() * self.kv_pool.element_size()
        grown = resident_bytes() - rss_before_load - (kv if self.device.type == "cpu" else 0)
        return {"rank": self.tp.rank if self.tp is not None else 0, "weight_bytes": self.model.weight_bytes(),
                "kv_bytes": kv, "rss_weights_bytes": grown}

    @staticmethod
    def block_bytes(args, model_config: ModelConfig, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        """Bytes of one KV block across all layers (keys and values) of ``num_kv_heads`` heads (None: all)."""
        c = model_config
        elem = torch.tensor([], dtype=dtype).element_size()
        heads = c.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return 2 * c.num_hidden_layers * args.block_size * heads * c.head_dim * elem

    @staticmethod
    def determine_num_blocks(args, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                             num_kv_heads: int | None = None, extra_block_bytes: int = 0) -> tuple[int, int]:
        """Size the KV pools of a rank holding ``num_kv_heads`` KV heads (None: all): (device blocks incl.
        the null block, CPU swap blocks). The memory settings are per rank.

        A block's bytes are the model's plus ``extra_block_bytes`` (a draft model's KV, kept under the same
        block ids: ``engine/spec_decode/draft_model.py``).

        Device: ``num_gpu_blocks_override`` if set; on CPU ``kv_cache_memory``
        bytes; on CUDA ``gpu_memory_utilization`` x total memory minus what is
        already used (the weights). CPU swap: ``swap_space`` GiB. Logs the
        number of blocks and the maximum concurrency at ``max_model_len``.

        Raises:
            MemoryError: the pool (or the swap space) does not fit; the message
                gives the bytes asked, the bytes free and the setting to lower.
            ValueError: fewer than 2 blocks (the null block plus one).
        """
        device = torch.device(device)
        per_block = ModelRunner.block_bytes(args, model_config, dtype, num_kv_heads) + extra_block_bytes
        gib = 2**30
        if args.num_gpu_blocks_override is not None:
            num_blocks = int(args.num_gpu_blocks_override)
            asked = num_blocks * per_block
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_host_memory()
            if asked > free:
                raise MemoryError(f"num_gpu_blocks_override={num_blocks} needs {asked / gib:.2f} GiB of KV cache "
                                  f"but only {free / gib:.2f} GiB is free on {device}; lower num_gpu_blocks_override")
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * args.gpu_memory_utilization) - (total - free)
            num_blocks = max(budget, 0) // per_block
            if num_blocks < 2:
                raise MemoryError(
                    f"no room for the KV cache on {device}: gpu_memory_utilization={args.gpu_memory_utilization} "
                    f"allows {total * args.gpu_memory_utilization / gib:.2f} GiB, {(total - free) / gib:.2f} GiB is "
                    f"already used (weights), {free / gib:.2f} GiB free; raise gpu_memory_utilization or use a "
                    "smaller model/dtype")
        else:
            if args.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:   # a vLLM line's: said, not dropped
                logger.warning("gpu_memory_utilization=%s changes nothing on CPU: the KV cache is kv_cache_memory "
                               "(--kv-cache-memory, %.2f GiB)", args.gpu_memory_utilization,
                               args.kv_cache_memory / gib)   # a warning: seen where a script configured no logging
            asked = int(args.kv_cache_memory)
            free = _available_host_memory()
            if asked > free:
                raise MemoryError(f"kv_cache_memory asks for {asked / gib:.2f} GiB but only {free / gib:.2f} GiB of "
                                  "host memory is available; lower kv_cache_memory")
            num_blocks = asked // per_block
        if num_blocks < 2:
            raise ValueError(f"the KV cache holds {num_blocks} block(s) of {per_block} bytes; at least 2 are needed "
                             "(the null block plus one): raise kv_cache_memory")
        num_cpu_blocks = 0
        if args.swap_space > 0:
            asked = int(args.swap_space * gib)
            free = _available_host_memory() - (num_blocks * per_block if device.type == "cpu" else 0)
            if asked > free:
                raise MemoryError(f"swap_space={args.swap_space} GiB does not fit: {free / gib:.2f} GiB of host "
                                  "memory is available after the KV cache; lower swap_space")
            num_cpu_blocks = asked // per_block
        max_len = args.max_model_len or model_config.max_position_embeddings
        tokens = (num_blocks - 1) * args.block_size
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB; %d tokens, one block held back as the null block) "
                    "on %s, %d CPU swap blocks; "
                    "maximum concurrency at max_model_len=%d: %.2fx", num_blocks, args.block_size,
                    num_blocks * per_block / gib, tokens, device, num_cpu_blocks, max_len, tokens / max_len)
        return num_blocks, num_cpu_blocks

    # ---------------------------------------------------------------- blocks
    def _apply_block_ops(self, inputs: StepInputs) -> None:
        """swap out (device -> CPU), swap in (CPU -> device), then copy-on-write."""
        if len(inputs.swap_out):
            if self.cpu_pool is None:
                raise RuntimeError("blocks_to_swap_out given but the runner has no CPU swap pool (swap_space=0)")
            src, dst = _column(inputs.swap_out, 0).to(self.device), _column(inputs.swap_out, 1)
            self.cpu_pool[:, :, dst] = self.kv_pool[:, :, src].to("cpu")
        if len(inputs.swap_in):
            if self.cpu_pool is None:
                raise RuntimeError("blocks_to_swap_in given but the runner has no CPU swap pool (swap_space=0)")
            src, dst = _column(inputs.swap_in, 0), _column(inputs.swap_in, 1).to(self.device)
            self.kv_pool[:, :, dst] = self.cpu_pool[:, :, src].to(self.device)
        self._copy_blocks(inputs.copy)

    def _copy_blocks(self, pairs: np.ndarray) -> None:
        """Copy-on-write: each (src, dst) device block pair of [n, 2] int64 ``pairs``, every layer's keys and values."""
        if len(pairs):
            src, dst = (_column(pairs, i).to(self.device) for i in (0, 1))
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]

    # ----------------------------------------------------------------- batch
    def prepare_inputs(self, out: SchedulerOutput) -> tuple[StepInputs, list[int], list[int]]:
        """The step's inputs (block operations, flat batch, the rows whose logits are wanted: each sampled
        entry's last row, then the prompt-logprob rows, then the proposals' rows), the query start of each
        scheduled entry and its end, the entries in ``out.scheduled``'s order.

        Raises:
            ValueError: a scheduled entry asks for tokens the request does not
                have, or its block table is too short.
        """
        bs = self.block_size
        scheduled = out.scheduled
        pairs = [np.array(ops, dtype=np.int64).reshape(-1, 2)
                 for ops in (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)]
        if not scheduled:
            empty = np.zeros(0, dtype=np.int64)
            return StepInputs(*pairs, empty, empty, empty, np.zeros(1, dtype=np.int64), empty,
                              np.zeros((0, 0), dtype=np.int64), empty), [], []
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
        seq_lens = starts + q_lens
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        ids: list[int] = []
        for s in scheduled:
            tokens = s.request.all_token_ids
            nc = s.num_computed_tokens
            spec = s.spec_token_ids
            chunk = tokens[nc:nc + s.num_new_tokens - len(spec)] + spec if spec else tokens[nc:nc + s.num_new_tokens]
            if len(chunk) != s.num_new_tokens:
                raise ValueError(f"request {s.request.request_id}: {s.num_new_tokens} new tokens scheduled from "
                                 f"{nc} but it has only {len(tokens)} tokens")
            ids.extend(chunk)
        max_blocks = max(len(s.block_ids) for s in scheduled)
        table = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        for i, s in enumerate(scheduled):
            table[i, :len(s.block_ids)] = s.block_ids
            if len(s.block_ids) * bs < seq_lens[i]:
                raise ValueError(f"request {s.request.request_id}: block table of {len(s.block_ids)} blocks is "
                                 f"too short for {seq_lens[i]} tokens")
        seq_idx = np.repeat(np.arange(len(scheduled)), q_lens)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        slots = table[seq_idx, positions // bs] * bs + positions % bs
        bounds = qsl.tolist()
        rows = self._logits_rows(out, bounds[:-1], bounds[1:])
        inputs = StepInputs(*pairs, np.array(ids, dtype=np.int64), positions, slots, qsl, seq_lens, table,
                            np.array(rows, dtype=np.int64))
        return inputs, bounds[:-1], bounds[1:]

    @staticmethod
    def _logits_rows(out: SchedulerOutput, entry_start: list[int], entry_end: list[int]) -> list[int]:
        """Rows of the step's hidden states whose logits are computed (see ``prepare_inputs``)."""
        rows = [entry_end[i] - 1 for i, s in enumerate(out.scheduled) if s.sample]
        for i, s in enumerate(out.scheduled):
            r = s.request
            if r.sampling_params.prompt_logprobs is not None and s.num_computed_tokens < r.num_prompt_tokens:
                rows.extend(range(entry_start[i], entry_end[i]))
        for i, s in enumerate(out.scheduled):
            if s.sample and s.spec_token_ids:
                rows.extend(range(entry_end[i] - 1 - len(s.spec_token_ids), entry_end[i] - 1))
        return rows

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Apply the step's block operations, run the forward pass over this
        rank's part of the model and KV cache, compute the logits of
        ``inputs.logits_rows``: (hidden states [num_tokens, hidden_size],
        logits [rows, vocab_size] float32 on the driver, None on the other
        ranks); (None, None) for a step with no tokens."""
        self._apply_block_ops(inputs)
        if not inputs.num_tokens:
            return None, None
        hidden = self._forward(inputs)
        rows = inputs.logits_rows
        if not len(rows):
            return hidden, hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if len(rows) == hidden.shape[0] and bool((rows == np.arange(len(rows))).all()):
            selected = hidden
        else:
            selected = hidden[torch.from_numpy(rows).to(hidden.device)]
        return hidden, self.model.compute_logits(selected)

    def _forward(self, inputs: StepInputs, layers: tuple[int, int] | None = None,
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The model over ``inputs``' flat batch (through ``layers`` from ``hidden``: ``LlamaForCausalLM.forward``)."""
        dev = self.device
        if self.cpu_threads is not None:
            self.cpu_threads.apply()
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(inputs.query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(inputs.seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(inputs.block_tables.astype(np.int32)).to(dev),
        )
        return self.model(torch.from_numpy(inputs.input_ids).to(dev), torch.from_numpy(inputs.positions).to(dev),
                          md, self.kv_caches, layers, hidden)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's block operations, run the forward pass, return logits (the driver's call: over
        several ranks it first sends them the step's inputs); then the pooling chunks scheduled through part of
        the layers, each in a pass of its own (``_run_layer_chunk``).

        Raises:
            ValueError: a scheduled entry asks for tokens the request does not
                have, or its block table is too short.
        """
        for rid in out.finished_req_ids:
            self.layer_hidden.pop(rid, None)
        if out.num_steps > 1:
            return self._decode_steps(out)
        split = [s for s in out.scheduled if s.layers is not None]
        if not split:
            return self._execute_batch(out)
        if self.tp is not None:
            raise ValueError("a chunk through part of the layers over several tensor-parallel ranks")
        kept = [i for i, s in enumerate(out.scheduled) if s.layers is None]
        result = self._execute_batch(SchedulerOutput(
            [out.scheduled[i] for i in kept], out.num_batched_tokens, out.blocks_to_copy, out.blocks_to_swap_out,
            out.blocks_to_swap_in))
        result.sample_indices = [kept[i] for i in result.sample_indices]
        for s in split:
            result.pooled_hidden.update(self._run_layer_chunk(s))
        return result

    @property
    def can_decode_greedy(self) -> bool:
        """Whether a step of several greedy decode steps (``SchedulerOutput.num_steps``) runs here: one rank
        on the model's C path (``LlamaForCausalLM.decode_greedy``)."""
        return self.tp is None and self.device.type == "cpu" and self.model.can_decode_greedy(self.kv_caches)

    def decode_read_bytes(self, context_tokens: int) -> int:
        """Bytes a decode step on the C path reads: the weights a one-row step reads
        (``c_stack.decode_weight_bytes``, counted once) and the keys and values of ``context_tokens`` tokens."""
        if self._weight_read is None:
            self._weight_read = decode_weight_bytes(self.model, self.kv_caches) or 0
        return self._weight_read + context_tokens * self._kv_token_bytes

    def _decode_steps(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """``execute_model`` for a batch of decodes that runs ``out.num_steps`` greedy steps in one call (each
        entry's next input is its last token, at position ``num_computed_tokens``)."""
        scheduled = out.scheduled
        self._copy_blocks(np.array(out.blocks_to_copy, dtype=np.int64).reshape(-1, 2))
        table = np.zeros((len(scheduled), max(len(s.block_ids) for s in scheduled)), dtype=np.int32)
        for i, s in enumerate(scheduled):
            table[i, :len(s.block_ids)] = s.block_ids
        if self.cpu_threads is not None:
            self.cpu_threads.apply()
        tokens = self.model.decode_greedy(
            torch.tensor([s.request.all_token_ids[s.num_computed_tokens] for s in scheduled], dtype=torch.int64),
            torch.tensor([s.num_computed_tokens for s in scheduled], dtype=torch.int64), torch.from_numpy(table),
            self.kv_caches, out.num_steps)
        if tokens is None:
            raise RuntimeError("a step of several decode steps on a model that cannot run them")
        return ModelRunnerOutput(logits=torch.empty(0, self.config.vocab_size),
                                 sample_indices=list(range(len(scheduled))), step_tokens=tokens.t().tolist())

    def _run_layer_chunk(self, s: ScheduledRequest) -> dict[str, tuple[int, torch.Tensor]]:
        """Run pooling chunk ``s`` through its ``layers`` (from its tokens' embeddings at layer 0, else from the
        hidden state kept at its previous step); keep its hidden state when layers remain, else return the rows
        its pooling reads (``_pooled_hidden``)."""
        first, end = s.layers
        rid = s.request.request_id
        hidden = self.layer_hidden.pop(rid) if first else None
        inputs, entry_start, _ = self.prepare_inputs(SchedulerOutput([s], s.num_new_tokens))
        out = self._forward(inputs, (first, end), hidden)
        if end < self.config.num_hidden_layers:
            self.layer_hidden[rid] = out
            return {}
        return self._pooled_hidden(SchedulerOutput([s]), out, entry_start)

    def _execute_batch(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """``execute_model`` for a step whose entries all run through every layer."""
        inputs, entry_start, entry_end = self.prepare_inputs(out)
        if self.tp is None:
            hidden, logits = self.run(inputs)
        else:
            if self.tp.interrupted:
                raise RankFailure("an earlier tensor-parallel step was interrupted (KeyboardInterrupt): the ranks "
                                  "stopped inside it; start a new engine")
            try:
                self.tp.broadcast_ints(STEP, *inputs.to_wire())
                hidden, logits = self.run(inputs)
            except Exception as exc:
                raise RankFailure(f"tensor-parallel step failed: {type(exc).__name__}: {exc}") from exc
            except BaseException:     # Ctrl-C mid-step: the other ranks wait in its collectives from now on
                self.tp.interrupted = True
                raise
        if hidden is None:
            return ModelRunnerOutput(logits=torch.empty(0, self.config.vocab_size, dtype=torch.float32,
                                                        device=self.device))
        sample_indices = [i for i, s in enumerate(out.scheduled) if s.sample]
        n = len(sample_indices)
        prompt_logits, spec_logits, at = {}, {}, n
        for i, s in enumerate(out.scheduled):
            r = s.request
            if r.sampling_params.prompt_logprobs is not None and s.num_computed_tokens < r.num_prompt_tokens:
                prompt_logits[r.request_id] = logits[at:at + entry_end[i] - entry_start[i]]
                at += entry_end[i] - entry_start[i]
        for i in sample_indices:
            k = len(out.scheduled[i].spec_token_ids)
            if k:
                spec_logits[out.scheduled[i].request.request_id] = logits[at:at + k]
                at += k
        return ModelRunnerOutput(logits=logits[:n], sample_indices=sample_indices, prompt_logits=prompt_logits,
                                 pooled_hidden=self._pooled_hidden(out, hidden, entry_start), spec_logits=spec_logits)

    @staticmethod
    def _pooled_hidden(out: SchedulerOutput, hidden: torch.Tensor,
                       entry_start: list[int]) -> dict[str, tuple[int, torch.Tensor]]:
        """The rows of this step's pooling chunks that their pooling reads (copies: ``hidden`` is the step's)."""
        pooled = {}
        for i, s in enumerate(out.scheduled):
            params = s.request.pooling_params
            if params is None:
                continue
            start = s.num_computed_tokens
            lo, hi = rows_needed(params, start, start + s.num_new_tokens, s.request.num_prompt_tokens)
            if hi > lo:
                row = entry_start[i] + lo - start
                pooled[s.request.request_id] = (lo, hidden[row:row + hi - lo].clone())
        return pooled
