"""The gateway's YAML config: schema (pydantic), validation with errors that
name the key path, and compilation into what the hot path uses (a
``policies.Policy``, an alias table, hashed virtual keys).

``load_config_text(text)`` -> ``Compiled``; any problem raises
``ConfigError`` whose message lists ``key.path: problem`` lines.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import parse_size
from policies import Condition, Match, Policy, Route, Rule, Target, check_field, with_weights
from policies.rules import OPERATORS

log = logging.getLogger("tandem.gateway.config")


class ConfigError(ValueError):
    """An invalid config. ``errors`` holds (key path, problem) pairs; the
    message has one ``path: problem`` line per error."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("invalid config:\n" + "\n".join(f"  {p or '(root)'}: {m}" for p, m in errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Strict):
    """Listening address and request limits."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    insecure: bool = False                 # allow a non-loopback bind with no virtual keys
    max_body_size: int = 4 * 2**20         # bytes ("4MiB" accepted)
    drain_timeout_s: float = Field(30.0, gt=0)
    log_level: str = "info"

    @field_validator("max_body_size", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)


class AdminConfig(_Strict):
    """The admin API's bearer token comes from this environment variable;
    unset = the admin API answers 401 to everyone."""

    token_env: str = "TANDEM_ADMIN_TOKEN"


class ReloadConfig(_Strict):
    watch: bool = True                     # poll the file's mtime and reload on change
    poll_interval_s: float = Field(1.0, gt=0)
    keep_versions: int = Field(10, ge=2)   # versions kept for rollback


class StateConfig(_Strict):
    redis_url: str | None = None           # shared state for several replicas; None = in-process
    key_prefix: str = "tandem"
    sync_interval_s: float = Field(1.0, gt=0)   # how often a replica polls the config version
    socket_timeout_s: float = Field(0.5, gt=0)
    fail_closed_limits: bool = False       # Redis down: reject rate-limited requests instead of local limits


class RetrySettings(_Strict):
    """``gateway.retry.RetryPolicy`` (seconds); unset = its defaults."""

    max_attempts: int | None = Field(None, ge=1)
    deadline_s: float | None = Field(None, gt=0)
    backoff_initial_s: float | None = Field(None, ge=0)
    backoff_max_s: float | None = Field(None, ge=0)
    jitter_s: float | None = Field(None, ge=0)
    max_retry_after_s: float | None = Field(None, ge=0)
    first_token_timeout_s: float | None = Field(None, gt=0)
    inter_chunk_timeout_s: float | None = Field(None, gt=0)


class BreakerSettings(_Strict):
    """``gateway.breaker.BreakerConfig`` (seconds); unset = its defaults."""

    failure_rate: float | None = Field(None, gt=0, le=1)
    min_requests: int | None = Field(None, ge=1)
    consecutive_failures: int | None = Field(None, ge=1)
    window_s: float | None = Field(None, gt=0)
    buckets: int | None = Field(None, ge=1)
    open_s: float | None = Field(None, gt=0)
    rate_limit_cooldown_s: float | None = Field(None, gt=0)
    max_cooldown_s: float | None = Field(None, gt=0)
    half_open_probes: int | None = Field(None, ge=1)
    success_to_close: int | None = Field(None, ge=1)
    probe_timeout_s: float | None = Field(None, gt=0)
    cache_s: float | None = Field(None, ge=0)


class HealthSettings(_Strict):
    """``gateway.health.HealthConfig`` (seconds); unset = its defaults."""

    interval_s: float | None = Field(None, ge=0)
    timeout_s: float | None = Field(None, gt=0)
    min_requests: int | None = Field(None, ge=1)
    max_error_rate: float | None = Field(None, gt=0, le=1)


class ResilienceConfig(_Strict):
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    health: HealthSettings = HealthSettings()


class TenantLimit(_Strict):
    rpm: int | None = Field(None, ge=1)    # requests per window
    tpm: int | None = Field(None, ge=1)    # tokens per window


class LimitsConfig(_Strict):
    window_s: float = Field(60.0, gt=0)
    default_completion_tokens: int = Field(512, ge=1)   # reserved when a request sets no max_tokens
    tenants: dict[str, TenantLimit] = {}


class VirtualKey(_Strict):
    """One client key: its sha256 (hex) or the env var holding it."""

    tenant: str
    sha256: str | None = None
    env: str | None = None
    rpm: int | None = Field(None, ge=1)    # this key's limits (per limits.window_s)
    tpm: int | None = Field(None, ge=1)

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


class AuthConfig(_Strict):
    keys: list[VirtualKey] = []


class ModelConfig(_Strict):
    """A public model name clients may ask for, and its aliases."""

    name: str
    aliases: list[str] = []


class Prices(_Strict):
    input: float = Field(0.0, ge=0)        # USD per million prompt tokens
    output: float = Field(0.0, ge=0)       # USD per million completion tokens
    cached_input: float | None = Field(None, ge=0)


class Timeouts(_Strict):
    connect_s: float = Field(5.0, gt=0)
    read_s: float = Field(120.0, gt=0)     # between bytes of a response
    first_token_s: float = Field(30.0, gt=0)  # until the first streamed chunk
    inter_chunk_s: float | None = Field(None, gt=0)  # between streamed chunks (None: read_s)


class EngineConfig(_Strict):
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
    num_threads: int | None = None
    seed: int | None = None
    attention_backend: str | None = None
    quantization: str | None = None
    load_format: str | None = None

    def engine_kwargs(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class LocalBackend(_Strict):
    """The in-process engine."""

    type: Literal["local"]
    engine: EngineConfig = EngineConfig()
    prices: Prices = Prices()
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)


class OpenAIBackend(_Strict):
    """Any OpenAI-compatible upstream."""

    type: Literal["openai"]
    base_url: str
    api_key_env: str | None = None         # None = no Authorization header upstream
    models: dict[str, str] = {}            # public model name -> upstream model name
    max_model_len: int | None = Field(None, ge=1)
    prices: Prices = Prices()
    timeouts: Timeouts = Timeouts()
    headers: dict[str, str] = {}
    max_connections: int = Field(256, ge=1)
    rpm: int | None = Field(None, ge=1)    # the upstream's quota (per limits.window_s)
    tpm: int | None = Field(None, ge=1)

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


Backend = Annotated[Union[LocalBackend, OpenAIBackend], Field(discriminator="type")]


class TargetConfig(_Strict):
    backend: str
    model: str = ""                        # upstream model; "" = the backend's mapping
    weight: float = Field(100.0, ge=0)
    id: str = ""                           # default: backend (or backend/model)


class RouteConfig(_Strict):
    targets: list[TargetConfig] = Field(min_length=1)
    fallbacks: list[TargetConfig] = []
    select: Literal["weighted", "cheapest"] = "weighted"


class RuleConfig(_Strict):
    name: str
    match: dict[str, Any] = {}
    route: str


class PolicyConfig(_Strict):
    canary_key: str = "user"               # user | header:<name> | request_id
    default_route: str
    rules: list[RuleConfig] = []


class TracingConfig(_Strict):
    """OpenTelemetry traces and GenAI metrics (``gateway/telemetry.py``); fixed until restart."""

    exporter: Literal["none", "console", "otlp"] = "none"
    endpoint: str | None = None            # OTLP/HTTP collector, e.g. http://127.0.0.1:4318
    service_name: str = "tandem-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)


class LogsConfig(_Strict):
    requests: bool = True                  # one JSON line per request (logger tandem.requests)
    destination: str = "stderr"            # stderr | stdout | a file path
    include_prompts: bool = False          # add prompts and completions to the line


class ObservabilityConfig(_Strict):
    tracing: TracingConfig = TracingConfig()
    logs: LogsConfig = LogsConfig()


class TenantBudget(_Strict):
    usd: float = Field(ge=0)               # USD per period
    period: Literal["day", "month"] = "month"   # UTC calendar day / month


class BudgetsConfig(_Strict):
    reservation_ttl_s: float = Field(600.0, gt=0)   # an unsettled reservation lapses after this long
    tenants: dict[str, TenantBudget] = {}


class GatewayConfig(_Strict):
    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    reload: ReloadConfig = ReloadConfig()
    state: StateConfig = StateConfig()
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    budgets: BudgetsConfig = BudgetsConfig()
    models: list[ModelConfig] = Field(min_length=1)
    backends: dict[str, Backend] = Field(min_length=1)
    routes: dict[str, RouteConfig] = Field(min_length=1)
    policy: PolicyConfig


@dataclass
class Compiled:
    """A validated config ready for the hot path.

    Attributes:
        config: the pydantic tree.
        policy: the compiled policy (weights overrides applied).
        model_names: public name or alias -> canonical public name.
        key_hashes: sha256 hex of a virtual key -> tenant.
        warnings: non-fatal problems (unset key env vars, ...).
        text: the YAML source; overrides: route -> {target id: weight}.
    """

    config: GatewayConfig
    policy: Policy
    model_names: dict[str, str]
    key_hashes: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    text: str = ""
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def public_models(self) -> list[str]:
        return [m.name for m in self.config.models]


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("local", "openai") and out.startswith("backends."):
            continue  # pydantic's discriminator tag, not a key
        else:
            out += ("." if out else "") + str(part)
    return out


def _parse_match(raw: Any, path: str, errors: list[tuple[str, str]]) -> Match:
    if not isinstance(raw, dict):
        errors.append((path, f"must be a mapping of field: value or field: {{op: value}}, got {raw!r}"))
        return Match()
    conds: list[Condition] = []
    groups: list[tuple[Match, ...]] = []
    for key, spec in raw.items():
        kpath = f"{path}.{key}"
        if key == "any":
            if not isinstance(spec, list) or not spec:
                errors.append((kpath, "must be a non-empty list of matches"))
                continue
            groups.append(tuple(_parse_match(m, f"{kpath}[{i}]", errors) for i, m in enumerate(spec)))
            continue
        try:
            check_field(str(key))
        except ValueError as e:
            errors.append((kpath, str(e)))
            continue
        ops = spec if isinstance(spec, dict) else {"in" if isinstance(spec, list) else "eq": spec}
        for op, value in ops.items():
            try:
                conds.append(Condition(str(key), str(op), value))
            except ValueError as e:
                explicit = isinstance(spec, dict) and op in OPERATORS
                errors.append((f"{kpath}.{op}" if explicit else kpath, str(e)))
    return Match(tuple(conds), tuple(groups))


def _target(t: TargetConfig, cfg: GatewayConfig, path: str, errors: list[tuple[str, str]]) -> Target | None:
    backend = cfg.backends.get(t.backend)
    if backend is None:
        errors.append((f"{path}.backend", f"unknown backend {t.backend!r}; defined: {', '.join(cfg.backends)}"))
        return None
    return Target(t.backend, t.model, t.weight, backend.prices.input, backend.prices.output, t.id)


def _check_engine(name: str, engine: EngineConfig, errors: list[tuple[str, str]], warnings: list[str]) -> None:
    """Validate the local engine's settings with ``EngineArgs``' own checks
    (cheap: nothing is loaded). A missing model file is a warning (the
    backend will be unavailable), a bad value an error."""
    from engine.config import EngineArgs

    try:
        EngineArgs(**engine.engine_kwargs())
    except FileNotFoundError as e:
        warnings.append(f"backends.{name}.engine.model: {e}")
    except ValueError as e:
        field_name = str(e).split(" ", 1)[0]
        path = f"backends.{name}.engine" + (f".{field_name}" if field_name in EngineConfig.model_fields else "")
        errors.append((path, str(e)))


def compile_config(cfg: GatewayConfig, overrides: dict[str, dict[str, float]] | None = None,
                   environ: dict[str, str] | None = None) -> Compiled:
    """Cross-check references and build the hot-path structures.

    Raises:
        ConfigError: unknown backends/routes/fields, duplicate model names,
            several local backends, bad overrides.
    """
    env = os.environ if environ is None else environ
    errors: list[tuple[str, str]] = []
    warnings: list[str] = []
    names: dict[str, str] = {}
    for i, m in enumerate(cfg.models):
        for n in [m.name, *m.aliases]:
            if n in names:
                errors.append((f"models[{i}]", f"name or alias {n!r} is used twice"))
            names[n] = m.name
    locals_ = [n for n, b in cfg.backends.items() if b.type == "local"]
    if len(locals_) > 1:
        errors.append(("backends", f"at most one local backend, got {', '.join(locals_)}"))
    for name in locals_:
        _check_engine(name, cfg.backends[name].engine, errors, warnings)
    routes: dict[str, Route] = {}
    for rname, r in cfg.routes.items():
        targets = [_target(t, cfg, f"routes.{rname}.targets[{i}]", errors) for i, t in enumerate(r.targets)]
        fallbacks = [_target(t, cfg, f"routes.{rname}.fallbacks[{i}]", errors) for i, t in enumerate(r.fallbacks)]
        if None in targets or None in fallbacks:
            continue
        try:
            routes[rname] = Route(rname, tuple(targets), tuple(fallbacks), r.select)
        except ValueError as e:
            errors.append((f"routes.{rname}", str(e)))
    for rname, weights in (overrides or {}).items():
        if rname not in routes:
            errors.append((f"overrides.{rname}", f"unknown route {rname!r}"))
            continue
        try:
            routes[rname] = with_weights(routes[rname], weights)
        except ValueError as e:
            errors.append((f"overrides.{rname}", str(e)))
    rules = []
    for i, r in enumerate(cfg.policy.rules):
        path = f"policy.rules[{i}]"
        if r.route not in cfg.routes:
            errors.append((f"{path}.route", f"unknown route {r.route!r}; defined: {', '.join(cfg.routes)}"))
        m = _parse_match(r.match, f"{path}.match", errors)
        for c in m.all:
            if c.field == "model" and c.op in ("eq", "ne", "in", "not_in"):
                for v in (c.value if isinstance(c.value, tuple) else (c.value,)):
                    if v not in names:
                        errors.append((f"{path}.match.model", f"unknown model {v!r}; defined: {', '.join(names)}"))
        rules.append(Rule(r.name, r.route, m))
    if cfg.policy.default_route not in cfg.routes:
        errors.append(("policy.default_route", f"unknown route {cfg.policy.default_route!r}"))
    key = cfg.policy.canary_key
    if not (key in ("user", "request_id") or (key.startswith("header:") and len(key) > 7)):
        errors.append(("policy.canary_key", f"must be user, request_id or header:<name>, got {key!r}"))
    hashes: dict[str, str] = {}
    for i, k in enumerate(cfg.auth.keys):
        if k.sha256:
            hashes[k.sha256] = k.tenant
        elif env.get(k.env or ""):
            hashes[hashlib.sha256(env[k.env].encode()).hexdigest()] = k.tenant
        else:
            warnings.append(f"auth.keys[{i}]: environment variable {k.env} is unset; "
                            f"key of tenant {k.tenant!r} disabled")
    if errors:
        raise ConfigError(errors)
    policy = Policy(tuple(rules), routes, cfg.policy.default_route, cfg.policy.canary_key)
    return Compiled(cfg, policy, names, hashes, warnings, overrides=dict(overrides or {}))


def load_config_text(text: str, overrides: dict[str, dict[str, float]] | None = None,
                     environ: dict[str, str] | None = None) -> Compiled:
    """Parse, validate and compile a YAML config.

    Raises:
        ConfigError: YAML syntax error, schema error, or broken reference,
            each naming the key path.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([("", f"not valid YAML: {e}")]) from None
    if not isinstance(raw, dict):
        raise ConfigError([("", "the config must be a YAML mapping")])
    try:
        cfg = GatewayConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([(_loc(err["loc"]), err["msg"]) for err in e.errors()]) from None
    compiled = compile_config(cfg, overrides, environ)
    compiled.text = text
    return compiled


def load_config_file(path: str, overrides: dict[str, dict[str, float]] | None = None) -> Compiled:
    """``load_config_text`` of a file. Raises ConfigError (also for I/O errors)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError([("", f"cannot read {path}: {e.strerror}")]) from None
    return load_config_text(text, overrides)


def load_config_or_report(path: str, prefix: str = "") -> Compiled | None:
    """``load_config_file`` for the CLI: on ConfigError prints ``{prefix}{path}: {error}`` to stderr and returns None."""
    try:
        return load_config_file(path)
    except ConfigError as e:
        print(f"{prefix}{path}: {e}", file=sys.stderr)
        return None
