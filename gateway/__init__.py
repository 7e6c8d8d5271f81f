"""Tandem's gateway: one OpenAI-compatible base_url in front of the local
engine and OpenAI-compatible upstreams.

Modules (one job each):
  config     YAML schema (pydantic), validation naming key paths, compilation
  versions   config versions / rollback, shared through Redis
  runtime    the running gateway: config generations, backends, reload, drain
  app        Litestar HTTP glue (OpenAI endpoints, health, admin API)
  pipeline   the request path: auth -> check -> decide -> forward
  validate   request body checks (400 naming the parameter)
  auth       virtual keys -> tenants, admin token
  proxy      one request's upstream attempts, through the resilience layer
  resilience glue: limits, breakers, health and retries built from the config
  state      Redis (or in-process) shared state with outage fallback
  ratelimit  RPM/TPM sliding-window limits (one Lua script)
  breaker    circuit breakers per backend/model
  health     passive and active health
  retry      the tenacity retry/fallback loop, streaming-aware
  metrics    Prometheus metrics (tandem_*; vllm:* from a co-located engine)
  telemetry  OpenTelemetry GenAI spans and per-request observability
  logging_json  one structured JSON log line per request, secrets redacted
  usage      cost accounting, per-tenant budgets, `tandem usage` / `tandem cost`
  upstream   OpenAI-compatible upstreams over httpx + aiohttp transport
  local      the in-process engine backend
  errors     OpenAI error bodies, BackendError
  server     uvicorn (uvloop, httptools), SIGHUP reload, SIGTERM drain
  commands   `tandem serve`, `tandem route explain`, `tandem ctl ...`
  dashboards/  Grafana dashboard and Prometheus alert rules
Routing decisions themselves live in ``policies/`` (pure, no I/O).
"""
