"""The config schema of ``backends.<name>``: the local engine (``local``), an OpenAI-compatible upstream
(``openai``) and Anthropic's Messages API (``anthropic``), a union discriminated by ``type``; read by
``schema.GatewayConfig``."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from engine.arg_values import parse_size
from gateway.config.strict import StrictModel


class Prices(StrictModel):
    input: float = Field(0.0, ge=0)        # USD per million prompt tokens
    output: float = Field(0.0, ge=0)       # USD per million completion tokens
    # USD per million prompt tokens served from the upstream's prompt cache (None: input)
    cached_input: float | None = Field(None, ge=0)


class Timeouts(StrictModel):
    connect_s: float = Field(5.0, gt=0)
    read_s: float = Field(120.0, gt=0)     # between bytes of a response
    first_token_s: float = Field(30.0, gt=0)  # until the first streamed chunk
    inter_chunk_s: float | None = Field(None, gt=0)  # between streamed chunks (None: read_s)


class EngineConfig(StrictModel):
    """``engine.config.EngineArgs`` fields (vLLM names); unset = its default."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    swap_space: float | None = None
    scheduling_policy: str | None = None
    num_scheduler_steps: int | None = None
    num_threads: int | None = None
    tensor_parallel_size: int | None = None
    seed: int | None = None
    attention_backend: str | None = None
    batch_invariant: bool | None = None
    quantization: str | None = None
    speculative_config: dict | None = None
    load_format: str | None = None
    engine_core_process: bool | None = None
    structured_outputs_workers: int | None = None
    structured_outputs_compile_timeout_s: float | None = None
    structured_outputs_max_bytes: int | str | None = None
    structured_outputs_cache_memory: int | str | None = None
    structured_outputs_cache_entries: int | None = None
    generation_config: str | None = None
    override_generation_config: dict | None = None
    chat_template: str | None = None

    @field_validator("kv_cache_memory", "structured_outputs_max_bytes", "structured_outputs_cache_memory",
                     mode="before")
    @classmethod
    def _size(cls, v):
        """A size in bytes or with a unit (``2GiB``), checked here so that a bad one names its own key (a CLI
        trial's ``kv_cache_memory: 1TB`` was refused as ``backends.local.engine``)."""
        return None if v is None else parse_size(v)

    def engine_kwargs(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class LocalCostConfig(StrictModel):
    """The local engine's price from its machine's (``gateway/billing/local_cost.py``)."""

    usd_per_hour: float = Field(gt=0)            # what the machine costs, USD per hour
    interval_s: float = Field(60.0, gt=0)        # spread over the tokens served in each interval of this many seconds


class LocalBackendConfig(StrictModel):
    """The in-process engine."""

    type: Literal["local"]                 # the engine in this process
    engine: EngineConfig = EngineConfig()
    # Structured features the engine serves (grammar-constrained decoding); a request using another is not local.
    structured_outputs: list[Literal["response_format", "tools"]] = ["response_format", "tools"]
    prices: Prices = Prices()
    cost: LocalCostConfig | None = None    # prices from usd_per_hour and the tokens served (ranking by cost)
    rpm: int | None = Field(None, ge=1)    # requests the engine takes per limits.window_s (null = no limit)
    tpm: int | None = Field(None, ge=1)    # tokens the engine takes per limits.window_s (null = no limit)


class OpenAIBackendConfig(StrictModel):
    """Any OpenAI-compatible upstream."""

    type: Literal["openai"]                # any OpenAI-compatible upstream
    base_url: str                          # POST base_url/chat/completions (and /completions, /embeddings, ...)
    api_key_env: str | None = None         # None = no Authorization header upstream
    models: dict[str, str] = {}            # public model name -> upstream model name
    max_model_len: int | None = Field(None, ge=1)
    prices: Prices = Prices()
    timeouts: Timeouts = Timeouts()
    headers: dict[str, str] = {}
    max_connections: int = Field(256, ge=1)
    rpm: int | None = Field(None, ge=1)    # the upstream's request quota per limits.window_s (null = none)
    tpm: int | None = Field(None, ge=1)    # the upstream's token quota per limits.window_s (null = none)
    stream_usage: bool = True              # ask streams for usage (stream_options.include_usage); false: estimated
    # APIs this upstream speaks natively besides chat/completions and completions: a whole (non-streamed)
    # request on one is passed through as it is; otherwise (and streamed) it is translated onto chat
    apis: list[Literal["responses"]] = []
    # A ``tandem engine serve`` replica: slo routes ask its POST /v1/ttft for each request's predicted TTFT
    # (gateway/backends/latency.py) instead of ranking it by its measured TTFT alone
    predicts_ttft: bool = False

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class AnthropicBackendConfig(OpenAIBackendConfig):
    """An upstream speaking Anthropic's Messages API (``POST base_url/messages``, key in ``x-api-key``): Messages
    requests are passed through natively; chat and completions requests are not sent to it."""

    type: Literal["anthropic"]             # Anthropic's Messages API
    base_url: str = "https://api.anthropic.com/v1"   # POST base_url/messages
    anthropic_version: str = "2023-06-01"  # the anthropic-version header sent


Backend = Annotated[Union[LocalBackendConfig, OpenAIBackendConfig, AnthropicBackendConfig],
                    Field(discriminator="type")]
