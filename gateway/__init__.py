"""Tandem's gateway: one OpenAI-compatible base_url in front of the local
engine and OpenAI-compatible upstreams. ARCHITECTURE.md walks one request
through the packages below; routing decisions live in ``policies/`` (pure).

  http/           Litestar app, handlers, error table, streaming, uvicorn server
  request/        auth, validation (the one request value), the request pipeline
  backends/       the local engine and OpenAI-compatible upstreams, dispatch
  resilience/     attempt loop, breakers, rate limits, health
  observability/  metrics, traces, request log (they observe, never decide)
  billing/        prices, usage ledger, budgets, `tandem usage` / `tandem cost`
  config/         YAML schema, compilation, versions
  state           Redis (or in-process) shared state with outage fallback
  runtime         the running gateway: config generations, backends, reload, drain
  tasks           ending background loops (one cancel_task, which a dropped cancel does not stop)
  errors          OpenAI error JSON, ClientError, BackendError
  cli, commands   `tandem ...` dispatch; `tandem serve`, `route explain`, `ctl`
"""
