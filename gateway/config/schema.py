"""The gateway's YAML config schema (pydantic): every setting declared once, with its default and bounds, and
read at run time from these models. Compilation: ``gateway/config/compile.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.arg_values import parse_size
from gateway.config.backend_schema import Backend, Prices
from gateway.config.strict import StrictModel

class ConfigError(ValueError):
    """An invalid config. ``errors`` holds (key path, problem) pairs; the
    message names the file (``source``, when known) and has one ``path: problem`` line per error."""

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors, self.source = errors, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}invalid config:\n" + "\n".join(f"  {p or '(root)'}: {m}" for p, m in errors))


# Keys a running gateway reads once, at start (the listener, its door limits, the Redis connection, the tracer):
# a reload records a change of one and its log line says a restart applies it (``changes.describe_changes``); the
# reference page marks them (``reference.py``). Every other key takes effect on the reload.
READ_AT_START = ("server.host", "server.port", "server.max_header_bytes", "server.max_headers",
                 "server.header_timeout_s", "server.log_level", "server.cors", "state.redis_url", "state.redis",
                 "state.data_dir", "state.key_prefix", "state.socket_timeout_s", "state.max_connections",
                 "state.reconnect_min_s", "state.reconnect_max_s", "observability.tracing",
                 "observability.logs.requests", "observability.logs.destination", "budgets.reservation_ttl_s",
                 "budgets.record_ttl_s", "budgets.journal_path")


class CorsConfig(StrictModel):
    """Cross-origin requests from browsers (Litestar's ``CORSConfig``); preflights are answered with these
    ``Access-Control-Allow-*`` values."""

    allow_origins: list[str] = Field(min_length=1)     # e.g. ["https://app.example.com"]; "*" = any
    allow_methods: list[str] = ["GET", "POST", "OPTIONS"]   # methods a preflight allows
    # request headers a preflight allows
    allow_headers: list[str] = ["authorization", "content-type", "x-request-id", "x-priority"]
    # response headers a browser script may read
    expose_headers: list[str] = ["x-request-id", "x-tandem-route", "x-tandem-backend", "x-tandem-attempts",
                                 "retry-after"]
    allow_credentials: bool = False   # Access-Control-Allow-Credentials
    max_age: int = Field(600, ge=0)        # seconds a browser may cache a preflight answer


class ServerConfig(StrictModel):
    """Listening address and request limits."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    insecure: bool = False                 # allow a non-loopback bind with no virtual keys
    max_body_size: int = 4 * 2**20         # bytes ("4MiB" accepted); bounds a chained Responses conversation too
    body_timeout_s: float = Field(30.0, gt=0)        # a body not complete by then: 408
    max_header_bytes: int = 64 * 2**10               # request line + headers; more: 431
    max_headers: int = Field(100, ge=1)              # header fields; more: 431
    header_timeout_s: float = Field(10.0, gt=0)      # a head not complete by then: 408
    drain_timeout_s: float = Field(30.0, gt=0)
    log_level: str = "info"
    cors: CorsConfig | None = None         # off by default

    @field_validator("max_body_size", "max_header_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)


class AdminConfig(StrictModel):
    """The admin API's bearer token comes from this environment variable;
    unset = the admin API answers 401 to everyone."""

    token_env: str = "TANDEM_ADMIN_TOKEN"
    # GET /metrics carries every tenant's tokens and spend: with virtual keys configured it needs the admin
    # token unless this is true (a gateway whose port only Prometheus reaches)
    public_metrics: bool = False


class ReloadConfig(StrictModel):
    watch: bool = True                     # poll the file's mtime and reload on change
    poll_interval_s: float = Field(1.0, gt=0)
    keep_versions: int = Field(10, ge=2)   # versions kept for rollback


class StateSettings(StrictModel):
    redis_url: str | None = None           # shared state for several replicas; None = in-process
    # embedded: a private redis-server on this machine, started (or joined) by the gateway and persisted under
    # data_dir (gateway/embedded_redis.py)
    redis: Literal["embedded"] | None = None
    data_dir: str = ".tandem"              # the gateway's own files (the embedded redis's: <data_dir>/redis)
    key_prefix: str = "tandem"
    sync_interval_s: float = Field(1.0, gt=0)   # how often a replica polls the config version
    socket_timeout_s: float = Field(0.5, gt=0)   # the longest any one Redis call may take, connecting included
    fail_closed_limits: bool = False       # Redis down: reject rate-limited and budgeted requests (503)
    max_connections: int = Field(64, ge=1)
    reconnect_min_s: float = Field(0.25, gt=0)   # first wait between reconnect attempts after an outage
    reconnect_max_s: float = Field(5.0, gt=0)   # longest wait between reconnect attempts

    @model_validator(mode="after")
    def _one_redis(self) -> "StateSettings":
        if self.redis is not None and self.redis_url:
            raise ValueError("set redis_url or redis: embedded, not both")
        return self


class RetrySettings(StrictModel):
    """The attempt loop's limits (``gateway/resilience/attempts.py``), seconds. ``deadline_s`` bounds everything
    before the response is committed."""

    max_attempts: int = Field(4, ge=1)
    deadline_s: float = Field(60.0, gt=0)
    backoff_initial_s: float = Field(0.2, ge=0)
    backoff_max_s: float = Field(5.0, ge=0)   # longest backoff between rounds
    jitter_s: float = Field(0.2, ge=0)   # random wait added to each backoff, at most
    max_retry_after_s: float = Field(10.0, ge=0)
    first_token_timeout_s: float = Field(30.0, gt=0)
    inter_chunk_timeout_s: float = Field(60.0, gt=0)


class BreakerSettings(StrictModel):
    """Circuit-breaker thresholds (``gateway/resilience/breaker.py``), seconds."""

    failure_rate: float = Field(0.5, gt=0, le=1)
    min_requests: int = Field(10, ge=1)
    consecutive_failures: int = Field(5, ge=1)
    window_s: float = Field(30.0, gt=0)   # the failure rate's sliding window, seconds
    buckets: int = Field(10, ge=1)   # buckets of that window
    open_s: float = Field(30.0, gt=0)
    rate_limit_cooldown_s: float = Field(60.0, gt=0)
    max_cooldown_s: float = Field(3600.0, gt=0)   # longest cooldown an upstream's Retry-After may set
    half_open_probes: int = Field(1, ge=1)
    success_to_close: int = Field(1, ge=1)   # half-open successes that close the breaker
    probe_timeout_s: float = Field(30.0, gt=0)
    cache_s: float = Field(0.25, ge=0)   # a replica trusts an answer from Redis (closed or open) this long


class HealthSettings(StrictModel):
    """Health tracking (``gateway/resilience/health.py``): ``interval_s`` active probe period (0 disables
    probing), ``timeout_s`` one probe's limit; seconds."""

    interval_s: float = Field(10.0, ge=0)
    timeout_s: float = Field(5.0, gt=0)   # an active probe's timeout
    min_requests: int = Field(5, ge=1)   # outcomes needed before the error rate counts
    max_error_rate: float = Field(0.5, gt=0, le=1)   # at or above this error rate a backend is reported unhealthy


class ResilienceConfig(StrictModel):
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    health: HealthSettings = HealthSettings()


class TenantLimit(StrictModel):
    rpm: int | None = Field(None, ge=1)    # requests per window
    tpm: int | None = Field(None, ge=1)    # tokens per window
    # the most urgent priority its requests may ask for (lower = sooner; "high" = -1): one below it is raised to
    # it, for routing rules and the engine's queue alike (null: any, as vLLM takes any)
    min_priority: int | None = None


class LimitsConfig(StrictModel):
    window_s: float = Field(60.0, gt=0)
    default_completion_tokens: int = Field(512, ge=1)   # reserved when a request sets no max_tokens
    tenants: dict[str, TenantLimit] = {}


class VirtualKey(StrictModel):
    """One client key: its sha256 (hex) or the env var holding it."""

    tenant: str   # the tenant this key's requests are billed and limited as
    sha256: str | None = None   # sha256 hex of the key (printf %s "$KEY" | sha256sum)
    env: str | None = None   # or: the environment variable holding the key
    rpm: int | None = Field(None, ge=1)    # this key's limits (per limits.window_s)
    tpm: int | None = Field(None, ge=1)   # tokens per window

    @model_validator(mode="after")
    def _one(self) -> "VirtualKey":
        if (self.sha256 is None) == (self.env is None):
            raise ValueError("give exactly one of sha256 or env")
        if self.sha256 is not None:
            h = self.sha256.lower()
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError("sha256 must be 64 hex digits (sha256 of the key)")
            self.sha256 = h
        return self


class AuthConfig(StrictModel):
    # virtual API keys (Authorization: Bearer <key>) -> tenants; none: anonymous, loopback only
    keys: list[VirtualKey] = []


class ModelConfig(StrictModel):
    """A public model name clients may ask for, and its aliases."""

    name: str   # the public name clients put in `model`
    aliases: list[str] = []   # other names for it (reported as the public name)
    cache: CacheConfig | None = None       # this model's response cache on routes without their own
    # max_tokens of a chat request that sets none (nor max_completion_tokens), on routes without their own;
    # None: up to the context, as OpenAI
    default_max_tokens: int | None = Field(None, ge=1)


class TargetConfig(StrictModel):
    backend: str   # a backend's name
    model: str = ""                        # upstream model; "" = the backend's mapping
    # relative share (percent by convention); all targets of a route set it or none does
    weight: float = Field(100.0, ge=0)
    id: str = ""                           # default: backend (or backend/model)


class AffinityConfig(StrictModel):
    """``select: prefix_affinity`` settings (``policies/affinity.py``): the prefix hashed (text blocks), the load
    bound, and how often the replicas' ``/metrics`` are read (seconds)."""

    prefix_blocks: int = Field(8, ge=1)          # leading text blocks hashed, at most
    block_chars: int = Field(64, ge=1)           # characters per block (~16 tokens)
    load_factor: float = Field(1.25, ge=1)       # a replica takes a request while load + 1 <= c * mean load
    max_kv_usage: float = Field(0.95, gt=0, le=1)   # at or above this KV-cache usage a replica takes no new prefix
    metrics_interval_s: float = Field(0.5, gt=0)    # replicas' /metrics read this often


class CacheConfig(StrictModel):
    """A route's response cache (``gateway/cache/``). ``exact``: local-engine answers of greedy or seeded
    requests, keyed by the engine's ``system_fingerprint`` and the rendered prompt's token ids; ``best_effort``:
    any backend's answer, keyed by the body (labelled ``x-tandem-cache-mode: best_effort``)."""

    mode: Literal["off", "exact", "best_effort"] = "off"
    ttl_s: float = Field(3600.0, gt=0)
    max_entries: int | None = Field(10000, ge=1)
    max_bytes: int | None = Field(None, ge=1)
    assign_seed: bool = False              # choose a seed for an unseeded sampled request (x-tandem-seed)
    verify_fraction: float = Field(0.0, ge=0, le=1)   # hits recomputed in the background and compared
    prices: Prices = Prices()              # what the ledger charges for a hit (default: nothing)
    # who may hit an entry: the tenant that stored it (default), or every tenant of the route ("route": a hit then
    # tells a tenant that another sent the same request, by its header and its latency)
    scope: Literal["tenant", "route"] = "tenant"

    @field_validator("mode", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        """``mode: off`` as written: YAML 1.1 (PyYAML's) reads a bare ``off`` as false, which the documented
        value's user got refused with "Input should be 'off', ..." (a docs trial)."""
        return "off" if value is False else value


class SloConfig(StrictModel):
    """A TTFT objective (``policies/slo.py``): the cheapest target predicted to meet it, else the fastest."""

    ttft_ms: float = Field(gt=0)                 # time to first token, milliseconds
    tpot_ms: float | None = Field(None, gt=0)    # time per output token, milliseconds (None: no TPOT objective)


class ShadowConfig(StrictModel):
    """A route's shadow traffic (``gateway/rollouts/shadow.py``): a sample of its chat requests is sent in the
    background to ``target`` (a backend of the config) and, for the parity report, again to the target that served
    it, both asked for logprobs; the client's answer never waits for them. Billed to the ``shadow`` ledger line."""

    target: str                                  # a backend name
    model: str = ""                              # its upstream model; "" = the backend's mapping
    percent: float = Field(100.0, ge=0, le=100)  # share of the route's chat requests mirrored
    max_concurrency: int = Field(4, ge=1)        # shadow pairs in flight at most; more are dropped (and counted)
    top_logprobs: int = Field(5, ge=0, le=20)    # asked of both sides, for the KL of the statistical report


class RouteConfig(StrictModel):
    # weighted targets; a failed one fails over to the others of weight > 0
    targets: list[TargetConfig] = Field(min_length=1)
    fallbacks: list[TargetConfig] = []   # tried in order once the targets failed
    select: Literal["weighted", "cheapest", "prefix_affinity"] = "weighted"
    affinity: AffinityConfig = AffinityConfig()
    cache: CacheConfig = CacheConfig()
    # Streams that outlive their replica (gateway/resilience/resume.py): only for routes of Tandem engines
    resume: bool = False
    resume_attempts: int = Field(2, ge=0, le=10)
    slo: SloConfig | None = None                 # route by predicted TTFT and cost (replaces select's pick)
    sticky: Literal["", "prefix", "user"] = ""   # keep a conversation on one target (its prompt cache warm)
    shadow: ShadowConfig | None = None           # mirror a sample to a candidate backend (parity report)
    # parameters neither OpenAI's nor a vendor's: refuse (400 unknown_parameter) | pass (sent to the upstreams)
    extra_params: Literal["refuse", "pass"] = "refuse"
    default_max_tokens: int | None = Field(None, ge=1)   # max_tokens of a chat request that sets none
    release: bool = False   # a reload takes the route's split back from a rollout holding it (docs/operators/desired-state.md)


class RuleConfig(StrictModel):
    name: str   # the rule's name (x-tandem-rule)
    match: dict[str, Any] = {}   # fields and operators, ANDed (any: [...] ORs); {} matches every request
    route: str   # the route a matching request takes
    slo: SloConfig | None = None                 # this rule's SLO (a tenant's, a priority's): replaces the route's


class PolicyConfig(StrictModel):
    canary_key: str = "user"               # user | header:<name> | request_id
    default_route: str
    rules: list[RuleConfig] = []   # first match wins


class TracingConfig(StrictModel):
    """OpenTelemetry traces and GenAI metrics (``gateway/observability/telemetry.py``)."""

    exporter: Literal["none", "console", "otlp"] = "none"
    endpoint: str | None = None            # OTLP/HTTP collector, e.g. http://127.0.0.1:4318
    service_name: str = "tandem-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)


class LogsConfig(StrictModel):
    requests: bool = True                  # one JSON line per request (logger tandem.requests)
    destination: str = "stderr"            # stderr | stdout | a file path
    include_prompts: bool = False          # add prompts and completions to the line


class ObservabilityConfig(StrictModel):
    tracing: TracingConfig = TracingConfig()
    logs: LogsConfig = LogsConfig()        # the JSON request log


class TenantBudget(StrictModel):
    usd: float = Field(ge=0)               # USD per period
    period: Literal["day", "month"] = "month"   # UTC calendar day / month


class BudgetsConfig(StrictModel):
    reservation_ttl_s: float = Field(600.0, gt=0)   # an unsettled reservation lapses after this long
    record_ttl_s: float = Field(8 * 86400.0, gt=0)  # a request's usage record stays in Redis this long (dedupe)
    journal_path: str | None = None        # file keeping the settles of a Redis outage across a restart
    tenants: dict[str, TenantBudget] = {}


class GatesConfig(StrictModel):
    """A rollout's gates, judged on the pairs compared since its current step began (``gateway/rollouts/gates.py``);
    an unset gate is not checked."""

    parity_min: float | None = Field(None, ge=0, le=1)    # exact share (local pairs) or token agreement, at least
    error_rate_max: float | None = Field(None, ge=0, le=1)   # the candidate's error rate, at most
    ttft_p95_max_ms: float | None = Field(None, gt=0)     # the candidate's TTFT p95, milliseconds, at most
    # the candidate's median TTFT over the primary's, measured on the same pairs at the same time, at most (robust
    # to the machine's load, unlike an absolute limit, and to a few stalls, unlike a p95)
    ttft_p50_ratio_max: float | None = Field(None, gt=0)
    tpot_p50_max_ms: float | None = Field(None, gt=0)     # the candidate's TPOT p50, milliseconds, at most
    min_compared: int = Field(5, ge=1)                    # pairs needed at a step before the gates judge it


class RolloutConfig(StrictModel):
    """A progressive rollout (``gateway/rollouts/controller.py``): the candidate target's weight on ``route`` goes
    through ``steps`` (percent) while every gate holds for ``hold_s`` at a step; a failing gate rolls it back to
    the last good step."""

    route: str   # the route whose split the rollout steers
    candidate: str                               # a target id of the route
    baseline: str = ""                           # the target that gives up the weight; "" = the route's first other
    steps: list[float] = Field([5.0, 25.0, 100.0], min_length=1)
    hold_s: float = Field(300.0, gt=0, le=2_592_000)   # seconds every gate must hold at a step, at most 30 days
    gates: GatesConfig = GatesConfig()
    sample_percent: float = Field(100.0, ge=0, le=100)   # the route's chat requests mirrored to both sides
    max_concurrency: int = Field(4, ge=1)        # compared pairs in flight at most; more are dropped (and counted)
    top_logprobs: int = Field(5, ge=0, le=20)   # alternatives asked of both sides (the KL of a statistical report)
    check_interval_s: float = Field(1.0, gt=0, le=3600)   # how often the controller judges the gates

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in v) or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError("steps must be increasing percentages in (0, 100]")
        return v


class GatewayConfig(StrictModel):
    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    reload: ReloadConfig = ReloadConfig()   # the file watcher and the versions kept
    state: StateSettings = StateSettings()   # shared state: Redis (several replicas) or in process
    auth: AuthConfig = AuthConfig()   # virtual API keys
    limits: LimitsConfig = LimitsConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    observability: ObservabilityConfig = ObservabilityConfig()   # traces and request logs
    budgets: BudgetsConfig = BudgetsConfig()
    models: list[ModelConfig] = Field(min_length=1)   # the public models clients may ask for
    backends: dict[str, Backend] = Field(min_length=1)   # the local engine and upstreams, by name
    routes: dict[str, RouteConfig] = Field(min_length=1)   # weighted targets and fallbacks, by name
    policy: PolicyConfig   # which route a request takes
    rollouts: dict[str, RolloutConfig] = {}   # gated progressive rollouts started at load, by name
