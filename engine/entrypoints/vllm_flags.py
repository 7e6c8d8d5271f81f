"""``vllm serve``'s flags that ``tandem engine serve`` has no setting for: each is taken, so that a vLLM command
line starts, and either changes nothing here (said once at start, with why) or is refused at start in one line
saying why (exit 2), never silently dropped. A trial's copied command lines had stopped at "unrecognized
arguments" for two dozen of them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


# In a flag's accepted values: the served model's path (``--tokenizer`` naming the model's own tokenizer)
MODEL = "<the model>"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: its spellings; whether it takes a value; the values that change nothing here (None: any;
    for a flag without a value, None: given, it changes nothing; empty: given, it is refused; ``MODEL``: the
    model's path); why."""

    names: tuple[str, ...]
    takes_value: bool
    accepted: frozenset[str] | None
    why: str

    @property
    def kwarg(self) -> str:
        """Its name as vLLM's ``LLM(...)`` keyword argument (``--enforce-eager``: ``enforce_eager``)."""
        return self.kwargs[0]

    @property
    def kwargs(self) -> tuple[str, ...]:
        """Every long spelling as vLLM's keyword argument (``--revision``, ``--code-revision``,
        ``--tokenizer-revision``: ``revision``, ``code_revision``, ``tokenizer_revision``)."""
        return tuple(n.lstrip("-").replace("-", "_") for n in self.names if n.startswith("--"))

    @property
    def dest(self) -> str:
        return "vllm_" + self.kwarg


def _ok(*values: str) -> frozenset[str]:
    return frozenset(values)


VLLM_FLAGS = (
    VllmFlag(("--trust-remote-code",), False, None,
             "this engine runs no model code of a checkpoint and downloads nothing"),
    VllmFlag(("--enforce-eager",), False, None, "no CUDA graph is captured: every step runs eagerly"),
    VllmFlag(("--disable-log-stats",), False, None, "no periodic stats lines are logged (see /metrics)"),
    VllmFlag(("--enable-prompt-tokens-details",), False, None, "usage.prompt_tokens_details is always sent"),
    VllmFlag(("--enable-auto-tool-choice",), False, None,
             "tool_choice auto is always served: calls are constrained to the engine's own call format"),
    VllmFlag(("--exclude-tools-when-tool-choice-none",), False, _ok(),
             "a template that knows tools gets them under tool_choice none too (vLLM's default); a template that "
             "does not gets the generic tool prompt only when calls are asked for"),
    VllmFlag(("--tool-call-parser",), True, None,
             "calls are parsed from the engine's own constrained call format, whatever the model"),
    VllmFlag(("--enable-request-id-headers",), False, None, "x-request-id is always answered"),
    VllmFlag(("--disable-frontend-multiprocessing",), False, None,
             "the HTTP server and the engine core are apart already (--no-engine-core-process joins them)"),
    VllmFlag(("--disable-fastapi-docs",), False, None, "there are no /docs pages (the app's schema is at /schema)"),
    VllmFlag(("--revision", "--code-revision", "--tokenizer-revision"), True, None,
             "the model is a local path: nothing is downloaded"),
    VllmFlag(("--download-dir",), True, None, "the model is a local path: nothing is downloaded"),
    VllmFlag(("--kv-cache-dtype",), True, _ok("auto"), "the KV cache is kept in the model's dtype"),
    VllmFlag(("--prefix-caching-hash-algo",), True, _ok("sha256"),
             "a block's hash is this engine's sha256 chain (engine/core/kv_cache_manager.py), which its KV events "
             "carry; vLLM's other algorithms (sha256_cbor, xxhash: for an indexer that hashes tokens itself, as "
             "llm-d's precise prefix cache does) are not made here"),
    VllmFlag(("--tokenizer-mode",), True, _ok("auto", "hf"), "the model's tokenizer.json (or GGUF vocabulary) is used"),
    VllmFlag(("--pipeline-parallel-size", "-pp"), True, _ok("1"), "the model is split by tensor parallelism only"),
    VllmFlag(("--data-parallel-size", "-dp"), True, _ok("1"),
             "one engine per process: run several and route between them with the gateway"),
    VllmFlag(("--response-role",), True, _ok("assistant"), "answers are the assistant's"),
    VllmFlag(("--chat-template-content-format",), True, _ok("auto", "string"),
             "message content reaches the template as a string (text parts joined)"),
    VllmFlag(("--tokenizer",), True, _ok(MODEL), "the tokenizer is the model's own (its directory or GGUF file)"),
    VllmFlag(("--reasoning-parser",), True, _ok(),
             "reasoning is not split out of the content (it would stay in content, not reasoning_content)"),
    VllmFlag(("--trust-request-chat-template",), False, _ok(),
             "a request's chat_template is refused (--chat-template sets the server's)"),
    VllmFlag(("--root-path",), True, _ok(), "the server is served at /; put a proxy (or the gateway) in front"),
    VllmFlag(("--allowed-origins", "--allowed-methods", "--allowed-headers"), True, _ok(),
             "the engine server sends no CORS headers: the gateway's server.cors does"),
    VllmFlag(("--hf-overrides",), True, _ok(), "the model's config.json is read as it is"),
    VllmFlag(("--compilation-config", "-O"), True, _ok(), "there is no compilation step to configure"),
    VllmFlag(("--config",), True, _ok(), "flags are taken on the command line only"),
    VllmFlag(("--disable-custom-all-reduce",), False, None,
             "tensor parallelism's all-reduce is torch.distributed's (gloo on CPU, NCCL on CUDA)"),
    VllmFlag(("--distributed-executor-backend",), True, _ok("mp"),
             "tensor-parallel ranks are processes of this machine (or of --nnodes machines), as vLLM's mp"),
    VllmFlag(("--max-seq-len-to-capture",), True, None, "no CUDA graph is captured: every step runs eagerly"),
    VllmFlag(("--preemption-mode",), True, _ok("recompute"),
             "a preempted request is recomputed, or swapped to CPU memory with --swap-space"),
    VllmFlag(("--async-scheduling",), False, None,
             "the engine core (its own process) runs apart from the front end's detokenizing and streaming"),
    VllmFlag(("--logprobs-mode",), True, _ok("raw_logprobs"),
             "logprobs are the model's raw log-softmax, before any sampling parameter"),
    VllmFlag(("--max-num-partial-prefills",), True, None,
             "prompts are chunked under --max-num-batched-tokens, with no separate count of partial prefills"),
    VllmFlag(("--task",), True, _ok("auto", "generate", "embed", "embedding"),
             "the engine serves both generation and embeddings (LLM.generate, LLM.chat and LLM.embed; chat, "
             "completions and embeddings); classify, score, reward and transcription need heads it lacks"),
    VllmFlag(("--runner",), True, _ok("auto", "generate", "pooling"),
             "the engine serves both generation and pooling (embeddings); a draft runner is speculative_config's"),
    VllmFlag(("--skip-tokenizer-init",), False, _ok(),
             "the model's tokenizer is always loaded: outputs are detokenized and stop strings need it"),
    VllmFlag(("--enable-lora",), False, _ok(), "LoRA adapters are not supported: the engine serves base weights"),
    # a CLI trial's copied command lines stopped at "unrecognized arguments" for these
    VllmFlag(("--guided-decoding-backend",), True, _ok("auto", "xgrammar"),
             "structured outputs are compiled by xgrammar (engine/worker/structured_outputs.py)"),
    VllmFlag(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"), True, _ok(),
             "the server speaks plain HTTP: end TLS at a proxy or ingress in front of it"),
    VllmFlag(("--enable-server-load-tracking",), False, _ok(),
             "there is no /load endpoint: /metrics' vllm:num_requests_running and vllm:num_requests_waiting give "
             "the load"),
)


def add_vllm_flags(group) -> None:
    """Add the ``VLLM_FLAGS`` to an ``argparse`` group (their help says what each does here)."""
    for f in VLLM_FLAGS:
        fate = "refused" if f.accepted == frozenset() else (
            "changes nothing" if f.accepted is None else f"only {', '.join(sorted(f.accepted))}, which changes nothing")
        kw = {"metavar": "VALUE"} if f.takes_value else {"action": "store_true"}
        group.add_argument(*f.names, dest=f.dest, default=None, help=f"vLLM's; {fate}: {f.why}", **kw)


def vllm_flag_notes(args: argparse.Namespace, model: str | None = None) -> list[str]:
    """One line for each ``VLLM_FLAGS`` flag ``args`` gave, saying that it changes nothing and why (``model``:
    the served model's path, the value ``MODEL`` stands for).

    Raises:
        ValueError: a flag (or value) this server refuses, naming it and why.
    """
    notes = []
    for f in VLLM_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None or value is False:
            continue
        shown = f.names[0] if value is True else f"{f.names[0]} {value}"
        accepted = f.accepted if f.accepted is None or MODEL not in f.accepted else f.accepted | {model}
        if accepted is not None and (value is True or value not in accepted):
            allowed = f" (taken: {', '.join(sorted(f.accepted))})" if f.accepted else ""
            raise ValueError(f"{shown}: not supported{allowed}: {f.why}")
        notes.append(f"{shown}: accepted for vLLM's command lines; changes nothing: {f.why}")
    return notes


# vLLM's environment variables this server reads, and what for; any other ``VLLM_*`` one set is said not to be read
# (a CLI trial's VLLM_CPU_KVCACHE_SPACE changed nothing without a word), with the flag to use where there is one.
VLLM_ENV_READ = {"VLLM_API_KEY": "--api-key", "VLLM_CPU_KVCACHE_SPACE": "--kv-cache-memory (GiB)"}
VLLM_ENV_FLAGS = {"VLLM_CPU_OMP_THREADS_BIND": "--num-threads", "VLLM_CPU_NUM_OF_RESERVED_CPU": "--num-threads",
                  "VLLM_HOST_IP": "--host", "VLLM_PORT": "--port", "VLLM_LOGGING_LEVEL": "--uvicorn-log-level",
                  "VLLM_ATTENTION_BACKEND": "--attention-backend", "VLLM_USE_V1": None}


def vllm_env_notes(environ) -> list[str]:
    """One line for each ``VLLM_*`` variable of ``environ`` this server does not read (``VLLM_ENV_READ``), with
    the flag that sets the same thing here where there is one."""
    notes = []
    for name in sorted(k for k in environ if k.startswith("VLLM_") and k not in VLLM_ENV_READ):
        flag = VLLM_ENV_FLAGS.get(name)
        notes.append(f"${name}: vLLM's; not read here" + (f" (its setting here: {flag})" if flag else ""))
    return notes


def kv_cache_from_vllm_env(kv_cache_memory: str, default: str, environ) -> tuple[str, str | None]:
    """(the KV-cache size to use, a note or None): vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE`` (GiB; 0: its default)
    when ``--kv-cache-memory`` was left at its ``default``, as vLLM-CPU reads it."""
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if kv_cache_memory != default or not space or space == "0":
        return kv_cache_memory, None
    return f"{space}GiB", f"$VLLM_CPU_KVCACHE_SPACE={space}: a KV cache of {space} GiB (--kv-cache-memory)"


def split_vllm_kwargs(kwargs: dict, model: str | None = None) -> tuple[dict, list[str]]:
    """vLLM's ``LLM(...)`` keyword arguments that are ``VLLM_FLAGS`` (``trust_remote_code=True``,
    ``enforce_eager=True``, ``tokenizer=...``) taken out of ``kwargs`` and read as the same flags on a command line
    are (``vllm_flag_notes``): (the other keyword arguments, the notes). A false or None value is not given.

    Raises:
        ValueError: one this engine refuses, naming it and why."""
    by_name = {kwarg: f for f in VLLM_FLAGS for kwarg in f.kwargs}
    given, rest = argparse.Namespace(), {}
    for key, value in kwargs.items():
        flag = by_name.get(key)
        if flag is None:
            rest[key] = value
        elif value is not None and value is not False:   # revision and its aliases: one flag, any of them
            setattr(given, flag.dest, str(value) if flag.takes_value else True)
    return rest, vllm_flag_notes(given, model)
