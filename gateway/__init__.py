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
  proxy      the attempt loop (ordered fallback); swapped by the resilience layer
  upstream   OpenAI-compatible upstreams over httpx + aiohttp transport
  local      the in-process engine backend
  errors     OpenAI error bodies, BackendError
  server     uvicorn (uvloop, httptools), SIGHUP reload, SIGTERM drain
  commands   `tandem serve`, `tandem route explain`, `tandem ctl ...`
Routing decisions themselves live in ``policies/`` (pure, no I/O).
"""
