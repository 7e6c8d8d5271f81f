"""Pieces shared by the scenarios: starting the upstream, the gateway and the
engine server; one measured run; gateway config files; ratio tables."""

from __future__ import annotations

import secrets
from pathlib import Path

import yaml

from loadtests.procs import Server, free_port, tandem_cmd, upstream_cmd
from loadtests.runner import LoadConfig, RunResult, run_load_sync
from loadtests.stats import summarize
from loadtests.workloads import LengthDist, RequestSpec, synthetic

UPSTREAM_KEY_ENV = "LOADTESTS_UPSTREAM_KEY"
ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"


def small_workload(num_prompts: int = 64, input_words: int = 32, max_tokens: int = 16) -> list[RequestSpec]:
    """Short synthetic prompts for the gateway scenarios (the upstream ignores them)."""
    return synthetic(num_prompts, LengthDist("fixed", input_words), LengthDist("fixed", max_tokens))


def logs_dir(out: str | Path) -> Path:
    """Where a run keeps its servers' logs and the configs it wrote: ``<out>/logs``, beside its report (kept
    for a look after the run; the next run into ``out`` overwrites them)."""
    path = Path(out) / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_upstream(name: str, log_dir: Path, *extra: str, port: int | None = None, cpus: str | None = None) -> Server:
    """A :mod:`loadtests.upstream` process, ready (on ``cpus``: ``Server``'s)."""
    port = port or free_port()
    srv = Server(upstream_cmd(port, name, *extra), f"http://127.0.0.1:{port}/health",
                 f"http://127.0.0.1:{port}", log_dir=log_dir, name=f"upstream-{name}", cpus=cpus)
    return srv.wait_ready(30)


def upstream_backend(port: int, model: str) -> dict:
    """An ``openai`` backend entry for a local upstream on ``port``."""
    return {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": UPSTREAM_KEY_ENV,
            "models": {model: model}, "max_model_len": 100000, "prices": {"input": 0.0, "output": 0.0},
            "timeouts": {"connect_s": 2, "read_s": 60, "first_token_s": 30}, "max_connections": 256}


def gateway_config(path: Path, backends: dict, routes: dict, default_route: str, model: str = "bench",
                   port: int = 8000) -> Path:
    """Write a gateway config with one public model, the given backends and routes,
    no rules (everything takes ``default_route``), no keys, admin token from
    ``$TANDEM_ADMIN_TOKEN``, no file watching."""
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "admin": {"token_env": ADMIN_TOKEN_ENV},
        "reload": {"watch": False},
        "models": [{"name": model}],
        "backends": backends,
        "routes": routes,
        "policy": {"canary_key": "user", "default_route": default_route, "rules": []},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_gateway(config: Path, log_dir: Path, port: int | None = None, admin_token: str | None = None,
                  timeout: float = 60.0, cpus: str | None = None) -> tuple[Server, str]:
    """``tandem serve --config config --port P``, ready at ``/health/ready`` (on ``cpus``: ``Server``'s).

    Returns:
        (server, admin token).
    """
    port = port or free_port()
    token = admin_token or secrets.token_hex(16)
    env = {UPSTREAM_KEY_ENV: "loadtests-dummy-key", ADMIN_TOKEN_ENV: token}
    srv = Server(tandem_cmd("serve", "--config", str(config), "--port", str(port)),
                 f"http://127.0.0.1:{port}/health/ready", f"http://127.0.0.1:{port}", env=env,
                 log_dir=log_dir, name="gateway", cpus=cpus)
    return srv.wait_ready(timeout), token


def spawn_engine_server(log_dir: Path, engine_args: list[str], name: str = "engine",
                        port: int | None = None) -> Server:
    """``tandem engine serve --port P --uvicorn-log-level warning <engine_args>``, started, not yet ready
    (call ``wait_ready``: several servers then load their models at once)."""
    port = port or free_port()
    return Server(tandem_cmd("engine", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--uvicorn-log-level", "warning", *engine_args),
                  f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=log_dir, name=name)


def start_engine_server(log_dir: Path, engine_args: list[str], name: str = "engine", port: int | None = None,
                        timeout: float = 300.0) -> Server:
    """:func:`spawn_engine_server`, ready at ``/health``."""
    return spawn_engine_server(log_dir, engine_args, name, port).wait_ready(timeout)


def measure(label: str, base_url: str, model: str, workload: list[RequestSpec], *, stream: bool,
            concurrency: int, num_requests: int | None = None, duration: float | None = None,
            endpoint: str = "chat", progress: bool = True, warmup: int = 0, **kw) -> RunResult:
    """One closed-loop run (after ``warmup`` unmeasured requests)."""
    if warmup:
        run_load_sync(LoadConfig(base_url, model, endpoint, stream, min(concurrency, 8), num_requests=warmup,
                                 progress=False, label="warmup"), workload)
    cfg = LoadConfig(base_url, model, endpoint, stream, concurrency, num_requests=num_requests, duration=duration,
                     progress=progress, label=label, **kw)
    return run_load_sync(cfg, workload)


def summary(run: RunResult) -> dict:
    """:func:`loadtests.stats.summarize` of a run."""
    return summarize(run.results, run.t_start, run.t_end)


def pct(p: dict | None, key: str) -> float | None:
    """A percentile of a :func:`percentiles` dict, or None."""
    return None if not p else p[key]


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
