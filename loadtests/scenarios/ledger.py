"""Scenario 8: the ledger under chaos (``tandem loadtest ledger``).

Two gateway replicas (in this process, under uvicorn) share one real Redis (a ``redis-server`` subprocess with
an fsync'd append-only file, so a kill -9 loses nothing it acknowledged) in front of the fast fake upstream
(``loadtests/upstream.py``, in this process too). Closed-loop traffic for ``--duration`` seconds mixes streamed
and whole answers, clients that leave a stream after its first chunk, and a backend that reports no usage;
two tenants: ``t1`` with a budget it never reaches, ``t2`` with one it exhausts. Meanwhile Redis is paused
(SIGSTOP, ``--pause`` s), slowed (stalls longer than the gateways' socket timeout, so scripts run after their
callers gave up), and killed and restarted. Then, once both replicas are back on Redis with empty journals,
it reads Redis and prints:

* served requests (a 200, counted by the clients by request id) against usage records, missing and extra;
  records flagged ``failed`` (accepted, no backend answered) only for requests the clients saw fail;
* the money: spend in the usage hashes and in the budgets against the sum of the records (nano-USD);
* records with estimated usage and with a disconnect;
* reservations left in Redis; ``t2``'s spend against its budget (overspend, and its bound: the requests in
  flight when it ran out, at most ``--concurrency`` estimates).

Exit status 1 when an invariant does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.embedded_redis import redis_server_binary
from loadtests.procs import free_port

TENANTS = {"t1": ("sk-ledger-t1-0123456789abcdef", 1000.0), "t2": ("sk-ledger-t2-0123456789abcdef", 0.0004)}
MAX_TOKENS = 16


def register(sub) -> None:
    p = sub.add_parser("ledger", help="scenario 8: the usage ledger under Redis pauses, stalls and restarts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--pause", type=float, default=3.0, help="seconds Redis is paused (SIGSTOP)")
    p.add_argument("--seed", type=int, default=0, help="traffic mix random seed")
    p.add_argument("--out", default="loadtest-results/ledger", help="output directory (results.json, summary.md)")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    out = asyncio.run(run_chaos(args.duration, args.concurrency, args.pause, args.seed))
    text = report(out)
    print(text)
    d = Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(out, indent=2, default=str))
    (d / "summary.md").write_text("# Ledger under chaos\n\n```\n" + text + "\n```\n")
    print(f"files: {d / 'results.json'}, {d / 'summary.md'}")
    return 0 if not out["violations"] else 1


# ----- Redis as a process the scenario can pause, stall and kill ----------------------------------------------------
class RedisProc:
    """``redis-server`` on a free port with an fsync'd AOF in ``workdir`` (restarts keep what it acknowledged)."""

    def __init__(self, workdir: str):
        self.workdir, self.port, self.proc = workdir, free_port(), None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProc":
        binary = redis_server_binary()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "yes", "--appendfsync", "always", "--dir", self.workdir,
                                      "--protected-mode", "no", "--loglevel", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        client = redis.Redis.from_url(self.url, socket_timeout=0.2, socket_connect_timeout=0.2)
        for _ in range(500):
            try:
                if client.ping():
                    break
            except redis.RedisError:
                time.sleep(0.02)
        client.close()
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


# ----- the system under test -------------------------------------------------------------------------------------
def gateway_yaml(upstream_url: str, redis_url: str, down_url: str) -> str:
    """Two models on one fake upstream: ``m`` (reports usage) and ``m-nousage`` (never does); ``m-down`` on
    ``down_url``, a port bound and never listening (every request accepted, none answered: a failed record each)."""
    from hashlib import sha256
    keys = "".join(f"    - {{tenant: {t}, sha256: {sha256(k.encode()).hexdigest()}}}\n"
                   for t, (k, _) in TENANTS.items())
    budgets = "".join(f"    {t}: {{usd: {usd}, period: day}}\n" for t, (_, usd) in TENANTS.items())
    backend = ("    type: openai\n    base_url: " + upstream_url + "\n    prices: {input: 1, output: 2}\n"
               "    timeouts: {connect_s: 2, read_s: 10, first_token_s: 5}\n")
    return (f"reload: {{watch: false}}\nauth:\n  keys:\n{keys}"
            f"state: {{redis_url: '{redis_url}', socket_timeout_s: 0.3, reconnect_min_s: 0.05, reconnect_max_s: 0.2,"
            f" sync_interval_s: 1}}\n"
            "resilience:\n  retry: {max_attempts: 1}\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            f"budgets:\n  tenants:\n{budgets}"
            "models:\n  - name: m\n  - name: m-nousage\n  - name: m-down\n"
            f"backends:\n  up:\n{backend}  nocount:\n{backend}    headers: {{x-usage: none}}\n"
            f"  down:\n{backend.replace(upstream_url, down_url)}"
            "routes:\n  counted:\n    targets: [{backend: up}]\n  uncounted:\n    targets: [{backend: nocount}]\n"
            "  unanswered:\n    targets: [{backend: down}]\n"
            "policy:\n  default_route: counted\n  rules:\n"
            "    - {name: nousage, match: {model: m-nousage}, route: uncounted}\n"
            "    - {name: down, match: {model: m-down}, route: unanswered}\n")


@dataclass
class Traffic:
    """What the clients saw: request ids answered 200 (served) or not (unserved) per tenant, and refusals by
    status."""

    served: dict[str, set[str]] = field(default_factory=lambda: {t: set() for t in TENANTS})
    unserved: dict[str, set[str]] = field(default_factory=lambda: {t: set() for t in TENANTS})
    refused: dict[int, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)


async def _one(client: httpx.AsyncClient, rng: random.Random, traffic: Traffic) -> None:
    tenant = "t2" if rng.random() < 0.25 else "t1"
    kind = rng.choice(["whole", "stream", "disconnect", "nousage-whole", "nousage-stream", "unanswered"])
    model = "m-nousage" if kind.startswith("nousage") else "m-down" if kind == "unanswered" else "m"
    body = {"model": model, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "count the ledger"}], "stream": kind != "whole" and
            kind != "nousage-whole"}
    headers = {"authorization": f"Bearer {TENANTS[tenant][0]}"}
    traffic.kinds[kind] = traffic.kinds.get(kind, 0) + 1
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                traffic.refused[r.status_code] = traffic.refused.get(r.status_code, 0) + 1
                traffic.unserved[tenant].add(r.headers.get("x-request-id", ""))
                return
            traffic.served[tenant].add(r.headers["x-request-id"])    # committed: it must be billed
            async for _ in r.aiter_raw():
                if kind == "disconnect":
                    break                                           # leaves after the first chunk
    except httpx.HTTPError:                                         # counted as status 0: not served
        traffic.refused[0] = traffic.refused.get(0, 0) + 1


async def _load(urls: list[str], concurrency: int, duration: float, seed: int, traffic: Traffic) -> None:
    clients = [httpx.AsyncClient(base_url=u, timeout=30) for u in urls]
    end = time.monotonic() + duration

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:
            await _one(clients[i % len(clients)], rng, traffic)

    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        for c in clients:
            await c.aclose()


async def _chaos(redis: RedisProc, duration: float, pause: float, log: list[str]) -> None:
    """Pause at 20 % of the run, stall (scripts run late) at 45 %, kill -9 and restart at 65 %."""
    t0 = time.monotonic()

    async def at(frac: float) -> None:
        await asyncio.sleep(max(0.0, t0 + frac * duration - time.monotonic()))

    await at(0.2)
    redis.signal(signal.SIGSTOP)
    log.append(f"{time.monotonic() - t0:.1f}s pause {pause:.1f}s")
    await asyncio.sleep(pause)
    redis.signal(signal.SIGCONT)
    await at(0.45)
    log.append(f"{time.monotonic() - t0:.1f}s stalls 3 x 0.6s")
    for _ in range(3):
        redis.signal(signal.SIGSTOP)
        await asyncio.sleep(0.6)
        redis.signal(signal.SIGCONT)
        await asyncio.sleep(0.3)
    await at(0.65)
    redis.kill()
    log.append(f"{time.monotonic() - t0:.1f}s kill -9, restart after 1.0s")
    await asyncio.sleep(1.0)
    await asyncio.to_thread(redis.start)


async def run_chaos(duration: float = 20.0, concurrency: int = 8, pause: float = 3.0, seed: int = 0) -> dict:
    """Run the scenario; the counts and the violated invariants (``violations``, empty when all hold)."""
    import uvicorn
    from aiohttp import web

    from gateway.config.compile import load_config_text
    from gateway.http.app import create_app
    from gateway.runtime import Gateway
    from loadtests.upstream import UpstreamConfig, make_app

    # the dead backend's port stays bound, never listening, for the whole run: refused, and no other server's
    with tempfile.TemporaryDirectory(prefix="tandem-ledger-") as work, socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        redis = RedisProc(work).start()
        # 5 ms between streamed tokens: a client that leaves after the first chunk leaves mid-stream
        runner = web.AppRunner(make_app(UpstreamConfig("up", output_tokens=MAX_TOKENS, itl=0.005)))
        await runner.setup()
        up_port = free_port()
        await web.TCPSite(runner, "127.0.0.1", up_port).start()
        cfg = gateway_yaml(f"http://127.0.0.1:{up_port}/v1", redis.url,
                           f"http://127.0.0.1:{dead.getsockname()[1]}/v1")
        gws, servers, urls = [], [], []
        try:
            for _ in range(2):
                gw = Gateway(None, load_config_text(cfg), start_engine=False)
                port = free_port()
                server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=port,
                                                       log_level="error", lifespan="on"))
                servers.append((server, asyncio.create_task(server.serve())))
                while not server.started:
                    await asyncio.sleep(0.02)
                gws.append(gw)
                urls.append(f"http://127.0.0.1:{port}")
            traffic, chaos_log = Traffic(), []
            await asyncio.gather(_load(urls, concurrency, duration, seed, traffic),
                                 _chaos(redis, duration, pause, chaos_log))
            settled = await _settle_down(gws)
            out = await _audit(redis.url, traffic, concurrency)
            out.update(chaos=chaos_log, kinds=traffic.kinds, refused=traffic.refused,
                       replays=sum(g.usage.replays for g in gws), outages=sum(g.usage.state.outages for g in gws))
            if not settled:
                out["violations"].append("replicas did not rejoin Redis with empty journals within 30 s")
            return out
        finally:
            for server, task in servers:
                server.should_exit = True
                await task
            await runner.cleanup()
            redis.kill()


async def _settle_down(gws) -> bool:
    """Wait (at most 30 s) until every replica is on Redis, has no request in flight and an empty journal. A
    replica idle while Redis restarted learns it here (its first call fails, it degrades, then rejoins)."""
    async def ping(r):
        return await r.ping()

    for _ in range(1500):
        reach = [await g.usage.state.call(ping, lambda: False) for g in gws]
        if all(reach) and all(g.in_flight == 0 and not len(g.usage.journal) for g in gws):
            await asyncio.sleep(0.3)                 # settles spawned by the last streams
            if all(not g.usage.state.degraded and not len(g.usage.journal) for g in gws):
                return True
        await asyncio.sleep(0.02)
    return False


async def _audit(redis_url: str, traffic: Traffic, concurrency: int) -> dict:
    """Read Redis and hold the ledger's invariants against what the clients saw. A budget may be overspent by
    the requests in flight when it ran out (one estimate each, ``concurrency`` at most) and, while Redis is
    unreachable, by what the other replica spends meanwhile: bounded here by one estimate per request in flight
    on each replica."""
    from gateway.billing.usage import UsageLedger
    from gateway.config.schema import StateSettings
    from gateway.state import SharedState

    out: dict = {"tenants": {}, "violations": []}
    state = SharedState(StateSettings(redis_url=redis_url, socket_timeout_s=5.0))   # a fresh client: Redis only
    try:
        await _audit_tenants(UsageLedger(state), traffic, concurrency, out)
    finally:
        if state.degraded:
            out["violations"].append("the audit could not read Redis")
        await state.close()
    return out


async def _audit_tenants(ledger, traffic: Traffic, concurrency: int, out: dict) -> None:
    from gateway.billing.prices import NANO, Price, cost_nusd
    from gateway.billing.usage import Budget

    r = ledger.state.redis
    bound = cost_nusd(Price(1, 2), 16, MAX_TOKENS) * concurrency * 2   # estimates <= 16 + MAX_TOKENS tokens
    for t, (_, usd) in TENANTS.items():
        recs = await ledger.records(t)
        served = traffic.served[t]
        report = await ledger.report(t)
        spent, reserved, limit = await ledger.budget_state(t, Budget(usd, "day"))
        held = [k async for k in r.scan_iter(match=ledger.state.key("budget", f"{t}:*:res"))]
        left = sum([await r.zcard(k) for k in held])
        total = sum(x.nusd for x in recs.values())
        failed = {rid for rid, x in recs.items() if x.failed}
        answered = set(recs) - failed
        row = {"served": len(served), "records": len(recs), "missing": len(served - answered),
               "extra": len(answered - served), "failed": len(failed),
               "failed_unseen": len(failed - traffic.unserved[t]), "estimated": sum(x.estimated for x in recs.values()),
               "disconnected": sum(x.disconnected for x in recs.values()), "records_nusd": total,
               "usage_nusd": round(report["cost_usd"] * NANO), "budget_spent_nusd": spent,
               "budget_nusd": limit, "reserved_nusd": reserved, "reservations_left": left,
               "overspend_nusd": max(0, spent - limit)}
        out["tenants"][t] = row
        if row["missing"] or row["extra"]:
            out["violations"].append(f"{t}: served {len(served)} != answered records {len(answered)}")
        if row["failed_unseen"] > traffic.refused.get(0, 0):   # a transport error hides its request id
            out["violations"].append(f"{t}: {row['failed_unseen']} failed records of requests no client saw fail")
        if not total == row["usage_nusd"] == spent:
            out["violations"].append(f"{t}: records {total} / usage {row['usage_nusd']} / budget {spent} nUSD")
        if reserved or left:
            out["violations"].append(f"{t}: {reserved} nUSD in {left} reservations left")
        if spent > limit + bound:
            out["violations"].append(f"{t}: spent {spent} > budget {limit} + in-flight bound")


def report(out: dict) -> str:
    """The scenario's figures as text."""
    lines = ["chaos: " + "; ".join(out.get("chaos", [])),
             f"traffic: {out.get('kinds')} refused by status: {out.get('refused')}",
             f"redis outages seen by the replicas: {out.get('outages')}, "
             f"journal entries replayed: {out.get('replays')}",
             "tenant  served  records  missing  extra  failed  estimated  disconnected  records_nUSD  usage_nUSD  "
             "budget_spent_nUSD  budget_nUSD  reserved_left  overspend_nUSD"]
    for t, r in out["tenants"].items():
        lines.append(f"{t:<7} {r['served']:>6} {r['records']:>8} {r['missing']:>8} {r['extra']:>6} "
                     f"{r['failed']:>7} {r['estimated']:>10} {r['disconnected']:>13} {r['records_nusd']:>13} "
                     f"{r['usage_nusd']:>11} "
                     f"{r['budget_spent_nusd']:>18} {r['budget_nusd']:>12} {r['reservations_left']:>14} "
                     f"{r['overspend_nusd']:>15}")
    lines.append("invariants: " + ("all hold" if not out["violations"] else "; ".join(out["violations"])))
    return "\n".join(lines)
