"""An ``EngineCore``'s start-up: load the model (this rank's part over several ranks), size the KV pool and the
context limit (``max_model_len``, tokens) from what it holds, pick the step's token budget
(``max_num_batched_tokens``), and build the runner, scheduler, sampler, speculative decoder and the core's
bookkeeping; then log the ready line. ``start_core`` sets these as the core's attributes: it is
``EngineCore.__init__``, kept apart so ``engine_core.py`` holds the step and what it serves.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

from engine.config import EngineArgs, served_model_names
from engine.worker.device import configure_core_threads, omp_places, omp_wait_policy, resolve_device, resolve_dtype
from engine.executor.multiproc_executor import rank_threads, start_driver
from engine.worker.malloc_tuning import malloc_tuning
from engine.fingerprint import numerics_of, system_fingerprint
from engine.distributed.shard_plan import plan_shard
from engine.model_loader import import_loader_modules, load_model, read_model_config
from engine.worker.model_runner import ModelRunner, resident_bytes
from engine.core.embed_calls import EmbedCalls
from engine.core.request import Request
from engine.worker.sampler import Sampler
from engine.core.scheduler import Scheduler
from engine.core.step_cost import device_pairs_per_token, pooling_budget
from engine.core.step_work import IterationTokens
from engine.worker.structured_outputs import StructuredOutputManager
from engine.core import ttft_log
from engine.core.ttft_calibration import TTFTCalibration
from engine.kv_events import KVEventsConfig, ZmqEventPublisher
from engine.spec_decode.config import SpeculativeConfig, unused_keys
from engine.spec_decode.draft_model import DraftModelProposer, load_draft_model
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.proposing import SpecDecoder

logger = logging.getLogger("tandem.engine")

# Token budget of one step with chunked prefill, by device. vLLM's online default (2048) on CUDA. On CPU a
# 2048-token step of SmolLM2 takes ~1 s on 2 cores and holds every running stream and every prompt queued behind
# it: at 512, MT-Bench at 32 streams (tandem loadtest run, 96 requests, 128 tokens) had TTFT p50 0.29-0.32x
# that of 2048 (428-454 vs 1347-1564 ms) at the same output tok/s (1.02-1.08x), offline 64 x (100, 128) tok/s
# 0.98-1.14x and a 2000-token prompt's prefill 0.98-1.00x the time (interleaved runs, 2-core box).
_DEFAULT_CHUNKED_BUDGET = {"cpu": 512, "cuda": 2048}


def _resolve_max_model_len(requested: int | None, model_max: int, kv_capacity: int) -> int:
    """The context limit, tokens: the model's, capped by what the KV pool holds.

    Raises:
        ValueError: an explicit ``max_model_len`` larger than the model's or
            than the KV pool (vLLM refuses to start in the same case).
    """
    if requested is None:
        if kv_capacity < model_max:
            logger.warning("max_model_len capped from %d to %d tokens: the KV pool holds no more "
                           "(raise kv_cache_memory / gpu_memory_utilization for longer contexts)",
                           model_max, kv_capacity)
        return min(model_max, kv_capacity)
    if requested > model_max:
        raise ValueError(f"max_model_len {requested} exceeds the model's context of {model_max} tokens")
    if requested > kv_capacity:
        raise ValueError(
            f"max_model_len {requested} needs more KV cache than the pool holds ({kv_capacity} tokens): "
            "raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA), or lower max_model_len")
    return requested



def start_core(core, args: EngineArgs) -> None:
    """Build ``core`` (an ``EngineCore``; its ``__init__``): the device and dtype, the other tensor-parallel ranks
    (started here, killed again if loading fails), the core's threads on CPU, then ``load_core``.

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded.
        MemoryError: the KV pool does not fit (the message says which setting to lower).
    """
    core.args = args
    core.device = resolve_device(args.device)
    core.dtype = resolve_dtype(args.dtype)
    core.executor, tp = None, None
    if args.tensor_parallel_size > 1:
        # a split the model cannot take (more ranks than attention heads) is refused once, before any rank starts
        # (a trial: each rank loaded, then failed with its own error line)
        plan_shard(read_model_config(args.model), 0, args.tensor_parallel_size)
        core.executor, tp = start_driver(args, core.device)
        core.device = tp.device
    if args.device != "cuda":
        configure_core_threads(args.num_threads or rank_threads(args))
    try:
        load_core(core, args, tp)
    except BaseException:
        if core.executor is not None:
            core.executor.kill()
            tp.close()
        raise


def _step_budget(args: EngineArgs, device_type: str, max_model_len: int) -> int:
    """Tokens one step may compute (``max_num_batched_tokens``): the setting, else with chunked prefill the
    device's default (never below ``max_num_seqs``: a step holds one decode token of every running sequence),
    else room for a whole prompt of ``max_model_len``. A setting below ``max_num_seqs`` is logged (it caps how
    many sequences run at once). Raises ValueError for a setting below ``max_model_len``
    with chunked prefill off (a prompt it could not hold would be refused, though ``max_model_len`` says it fits)."""
    if args.max_num_batched_tokens is not None:
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_model_len:   # vLLM refuses it too
            raise ValueError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) is smaller than max_model_len "
                             f"({max_model_len}) with chunked prefill off: every longer prompt would be refused; "
                             "raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill")
        if args.max_num_batched_tokens < args.max_num_seqs:   # vLLM refuses it; here it caps the decode batch
            logger.warning("max_num_batched_tokens (%d) is below max_num_seqs (%d): a step holds one token of each "
                           "sequence it runs, so at most %d sequences run at once; raise max_num_batched_tokens or "
                           "lower max_num_seqs to match", args.max_num_batched_tokens, args.max_num_seqs,
                           args.max_num_batched_tokens)
        return args.max_num_batched_tokens
    if args.enable_chunked_prefill:
        return max(_DEFAULT_CHUNKED_BUDGET.get(device_type, 2048), args.max_num_seqs)
    return max(max_model_len, 2048)


def _speculation(args: EngineArgs, core):
    """(the ``SpeculativeConfig``, its draft model): (None, None) without speculation; vLLM's keys that change
    nothing here said once."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    for note in unused_keys(args.speculative_config):
        logger.info(note)
    draft = (load_draft_model(args, spec, core.tokenizer, core.model_config)
             if spec is not None and spec.method == "draft_model" else None)
    return spec, draft


def load_core(core, args: EngineArgs, tp) -> None:
    """Load the model (this rank's part over several ranks), size the KV pool, build the runner, scheduler,
    sampler and bookkeeping as attributes of ``core``: the rest of ``start_core``."""
    import_loader_modules()
    gc.collect()   # what an engine dropped before this one left (unfrozen when it went), before loading beside it
    rss = resident_bytes()
    model, core.tokenizer, core.model_config = load_model(args, tp)
    if tp is not None:
        tp.check_loaded(None)   # a rank that could not load its part: its reason, not a broken collective's
    core.served_model_name = served_model_names(args.served_model_name, args.model)[0]
    if defaults := args.sampling_defaults:
        logger.warning("sampling defaults from the model's generation config: %s: they fill what a request leaves "
                       "unset, and max_new_tokens caps max_tokens (--generation-config vllm: none)", defaults)
    core.system_fingerprint = system_fingerprint(args.model, numerics_of(args, core.device, core.dtype))
    spec, draft = _speculation(args, core)
    num_blocks, num_cpu_blocks = ModelRunner.determine_num_blocks(
        args, core.model_config, core.device, core.dtype, model.shard.num_kv_heads,
        extra_block_bytes=0 if draft is None else ModelRunner.block_bytes(args, draft.config, core.dtype))
    if tp is not None:  # every rank's pool has as many blocks: the fewest any rank has room for
        num_blocks, num_cpu_blocks = tp.min_int(num_blocks), tp.min_int(num_cpu_blocks)
    core.max_model_len = _resolve_max_model_len(
        args.max_model_len, core.model_config.max_position_embeddings, (num_blocks - 1) * args.block_size)
    core.model_runner = ModelRunner(args, model, core.model_config, core.device, core.dtype,
                                    num_blocks, num_cpu_blocks, tp=tp)
    # per rank: the loader's weight bytes, the KV pool, resident growth while loading (docs/engine/tensor-parallel.md)
    core.rank_memory = tp.gather_object(core.model_runner.memory_report(rss)) if tp is not None else \
        [core.model_runner.memory_report(rss)]
    if tp is not None:
        logger.info("tensor parallelism: per rank %s", ", ".join(
            f"rank {m['rank']}: weights {m['weight_bytes'] / 2**20:.0f} MiB (resident "
            f"{m['rss_weights_bytes'] / 2**20:.0f} MiB), KV pool {m['kv_bytes'] / 2**20:.0f} MiB"
            for m in core.rank_memory))
    core.max_num_batched_tokens = budget = _step_budget(args, core.device.type, core.max_model_len)
    core.scheduler = Scheduler(
        block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=core.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy, num_cpu_blocks=num_cpu_blocks,
        pooling_budget=pooling_budget(core.model_config, core.device.type, budget, split_layers=tp is None),
    )
    core.sampler = Sampler(core.model_config.vocab_size, core.device, seed=args.seed)
    core.spec_decoder = None
    if spec is not None:
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if draft is None else \
            DraftModelProposer(ModelRunner(draft.args, draft.model, draft.config, core.device, core.dtype,
                                           num_blocks), core.scheduler.kv_cache_manager, draft.max_len)
        core.spec_decoder = SpecDecoder(spec, core.max_model_len, proposer)
    core._structured_outputs: StructuredOutputManager | None = None  # built on first use, or by the core process once ready
    core._structured_outputs_lock = threading.Lock()
    core.num_blocks = num_blocks
    core._seqs: dict[str, Request] = {}  # sequence id -> its request
    core._groups: dict[str, list[Request]] = {}  # client request id -> its sequences
    core._prompt_logprobs: dict[str, list] = {}  # client request id -> prompt logprobs not yet sent
    core.embed_calls = EmbedCalls()                 # add_embed calls: pooling requests, kept rows, vectors
    core._prompt_tokens_total = 0
    core._generation_tokens_total = 0
    core.iteration_tokens = IterationTokens()  # each step's tokens, vLLM's vllm:iteration_tokens_total
    # step costs for TTFT predictions (engine/core/ttft.py), attention priced in token-equivalents as the
    # scheduler prices pooling chunks
    core.ttft_calibration = TTFTCalibration(
        pairs_per_token=device_pairs_per_token(core.model_config, core.device.type))
    core._requests_added = 0                     # add_request/add_embed calls, accepted or refused (engine/core/ttft.py)
    core._last_step: tuple | None = None   # (start, prefill tokens, decode rows, quad_of its rows, chunks)
    core._ttft_log = ttft_log.from_env()   # the steps timed, for replays ($TANDEM_TTFT_LOG_DIR; None: off)
    core.scheduler.kv_cache_manager.block_pool.kv_events = []
    kv_events = KVEventsConfig.parse(args.kv_events_config)   # vLLM's KV events for routers (engine/kv_events.py)
    core.kv_event_publisher = ZmqEventPublisher(kv_events) if kv_events is not None else None
    if core.kv_event_publisher is not None:
        core.scheduler.kv_cache_manager.block_pool.kv_cache_events = []
    _freeze_start_up_heap(core)
    # the most decode steps one scheduler call runs (engine/core/multi_step.py), only where the runner has the
    # one-call greedy path (fixed once the runner's kernels are chosen); with speculation, in the calls where no
    # sequence got a proposal (multi_step.lookahead_steps)
    core.max_scheduler_steps = args.num_scheduler_steps if core.model_runner.can_decode_greedy else 1
    log_ready(core, num_blocks, budget, spec)


def _freeze_start_up_heap(core) -> None:
    """Collect, then freeze the objects built so far (the model, the tokenizer, torch's modules), which live as long
    as the engine: the cyclic GC then never walks them during serving (4 % of a single stream's time in a profile;
    vLLM freezes its start-up heap too). Frozen objects in reference cycles (the model's layers: their bound
    kernels) are never collected, though: each engine built and dropped in one process (an offline LLM made twice,
    a core restarted in a thread, the test suite's engines) kept its weights and KV pool, ~470 MB for SmolLM2 in
    bfloat16 with a 192 MiB pool (the suite's two workers reached 13.5 and 6 GB resident). So once ``core`` is
    gone the heap goes back to the collector: the next full collection frees what it left (``load_core`` collects
    first; whatever still serves is frozen again by the next freeze)."""
    gc.collect()
    gc.freeze()
    weakref.finalize(core, gc.unfreeze).atexit = False


def log_ready(core, num_blocks: int, budget: int, spec) -> None:
    """The start-up line operators read (and tests check): what was loaded and how it will run
    (``num_scheduler_steps``: ``core.max_scheduler_steps``, 1 where this model cannot run several)."""
    logger.info(
        "engine ready: model=%s device=%s dtype=%s blocks=%d block_size=%d max_model_len=%d "
        "max_num_batched_tokens=%d num_scheduler_steps=%d tensor_parallel_size=%d speculative=%s omp_wait=%s "
        "omp_places=%s malloc=%s",
        core.served_model_name, core.device, core.dtype, num_blocks, core.args.block_size, core.max_model_len,
        budget, core.max_scheduler_steps, core.args.tensor_parallel_size,
        "off" if spec is None else f"{spec.method} k={spec.num_speculative_tokens}",
        omp_wait_policy(), omp_places(), malloc_tuning(),
    )
