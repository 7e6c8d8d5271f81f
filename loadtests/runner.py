"""The load generator: open loop (Poisson arrivals) or closed loop (fixed concurrency).

Open loop sends request i at the i-th arrival of a Poisson process of rate
``rate`` requests/s (exponential gaps, as vLLM's ``benchmark_serving.py``),
whatever the server's latency; closed loop keeps ``concurrency`` requests in
flight, each worker sending its next request when the previous one returns.
Both stop issuing at ``num_requests`` or ``duration`` seconds, whichever comes
first, and then wait for the requests in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

from loadtests.client import RequestResult, endpoint_url, make_session, send
from loadtests.workloads import RequestSpec


@dataclass
class LoadConfig:
    """One load run.

    Attributes:
        base_url: the server, e.g. ``http://127.0.0.1:8000/v1``.
        model: the ``model`` field sent.
        endpoint: "chat" or "completions".
        stream: streamed responses (TTFT and ITL are measured only then).
        concurrency: closed loop: requests in flight; open loop: connection
            pool size and the cap on requests in flight.
        rate: open loop when set: Poisson arrival rate, requests/s.
        num_requests: stop issuing after this many (None: no count bound).
        duration: stop issuing after this many seconds (None: no time bound).
        timeout: per-request limit, seconds.
        headers: extra HTTP headers (e.g. ``Authorization``).
        user_prefix: when set, each request carries ``user = f"{prefix}{i}"``
            (distinct users, e.g. so that canary hashing spreads them).
        keep_text: keep each response's text in its result.
        seed: seeds the Poisson arrivals.
        progress: show a rich progress bar.
        label: a name for reports.
    """

    base_url: str
    model: str
    endpoint: str = "chat"
    stream: bool = False
    concurrency: int = 1
    rate: float | None = None
    num_requests: int | None = None
    duration: float | None = None
    timeout: float = 600.0
    headers: dict = field(default_factory=dict)
    user_prefix: str | None = None
    keep_text: bool = False
    seed: int = 0
    progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give num_requests or duration (or both)")


@dataclass
class RunResult:
    """A finished run: its config, every request's result (completion order),
    and the perf_counter times it started and ended (seconds)."""

    config: LoadConfig
    results: list[RequestResult]
    t_start: float
    t_end: float


class _Progress:
    """A rich progress bar, or nothing."""

    def __init__(self, enabled: bool, total: int | None, label: str):
        self.bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), transient=False,
                            refresh_per_second=4)
        self.task = self.bar.add_task(label or "load", total=total, stats="")
        self.t0 = time.perf_counter()
        self.errors = 0
        self.done = 0
        self.bar.start()

    def advance(self, res: RequestResult) -> None:
        if self.bar is None:
            return
        self.done += 1
        self.errors += not res.ok
        rps = self.done / max(1e-9, time.perf_counter() - self.t0)
        self.bar.update(self.task, advance=1, stats=f"{rps:,.0f} req/s  errors {self.errors}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _body(cfg: LoadConfig, spec: RequestSpec, i: int) -> dict:
    body = spec.body(cfg.endpoint, cfg.model, cfg.stream)
    if cfg.user_prefix is not None:
        body["user"] = f"{cfg.user_prefix}{i}"
    return body


async def run_load(cfg: LoadConfig, workload: list[RequestSpec]) -> RunResult:
    """Run ``cfg`` over ``workload`` (cycled) and return every result.

    Raises:
        ValueError: empty workload.
    """
    if not workload:
        raise ValueError("empty workload")
    url = endpoint_url(cfg.base_url, cfg.endpoint)
    results: list[RequestResult] = []
    progress = _Progress(cfg.progress, cfg.num_requests, cfg.label)
    t_start = time.perf_counter()
    deadline = t_start + cfg.duration if cfg.duration is not None else float("inf")
    limit = cfg.num_requests if cfg.num_requests is not None else float("inf")
    try:
        async with make_session(cfg.concurrency, cfg.timeout, cfg.headers) as session:
            async def one(i: int) -> None:
                spec = workload[i % len(workload)]
                res = await send(session, url, _body(cfg, spec, i), keep_text=cfg.keep_text, index=i)
                results.append(res)
                progress.advance(res)

            if cfg.rate is None:
                counter = itertools.count()

                async def worker() -> None:
                    while True:
                        i = next(counter)
                        if i >= limit or time.perf_counter() >= deadline:
                            return
                        await one(i)

                await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
            else:
                rng = random.Random(cfg.seed)
                sem = asyncio.Semaphore(cfg.concurrency)
                tasks = []
                t_next = t_start

                async def gated(i: int) -> None:
                    async with sem:
                        await one(i)

                i = 0
                while i < limit:
                    t_next += rng.expovariate(cfg.rate)
                    if t_next >= deadline:
                        break
                    delay = t_next - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.ensure_future(gated(i)))
                    i += 1
                await asyncio.gather(*tasks)
    finally:
        progress.close()
    return RunResult(cfg, results, t_start, time.perf_counter())


def run_load_sync(cfg: LoadConfig, workload: list[RequestSpec]) -> RunResult:
    """:func:`run_load` in a fresh event loop (uvloop when installed)."""
    return run_async(run_load(cfg, workload))


def run_async(coro):
    """Run a coroutine to completion on uvloop if available, else asyncio."""
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
