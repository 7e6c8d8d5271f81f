"""``make demo``: a canary a new user can watch, with no key and nothing installed by hand.

It starts the keyless canary arm of ``config.example.yaml`` (``local-f32``: ``tandem engine serve`` in float32 on
a free port) and the gateway on that config with the embedded Redis (``state: {redis: embedded}``), then walks
the canary 5 -> 25 -> 100 % with ``tandem ctl weights`` and rolls back with ``tandem ctl rollback``, sending
``--requests`` chat requests per step (each with its own ``user``, the canary key) and printing the split the
gateway answered with (``x-tandem-backend``) against the weight. The ops console shows the same live while it runs.
Exit status 1 when a step's observed share is more than ``--tolerance`` points from its weight.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from gateway.config import EXAMPLE_CONFIG
from loadtests.procs import Server, free_port, tandem_cmd

ROUTE, STABLE, CANARY = "local-first", "local", "local-f32"
TOKEN = "demo-admin-token"


def demo_config(example: str, engine_port: int, data_dir: Path) -> str:
    """``config.example.yaml`` with the canary arm on ``engine_port`` and the embedded Redis under ``data_dir``."""
    text = example.replace("http://127.0.0.1:8001/v1", f"http://127.0.0.1:{engine_port}/v1")
    text = re.sub(r"(?m)^  redis: null\b", "  redis: embedded", text)
    text = re.sub(r"(?m)^  data_dir: \.tandem\b", f"  data_dir: {data_dir}", text)
    assert f":{engine_port}/v1" in text and "redis: embedded" in text and str(data_dir) in text
    return text


def ctl(gateway_url: str, *args: str) -> None:
    """``tandem ctl`` against the demo gateway, its output shown."""
    out = subprocess.run(tandem_cmd("ctl", "--url", gateway_url, *args), capture_output=True, text=True,
                         env={**os.environ, "TANDEM_ADMIN_TOKEN": TOKEN}, timeout=60)
    print(f"$ tandem ctl {' '.join(args)}\n{out.stdout.rstrip()}")
    if out.returncode != 0:
        raise RuntimeError(f"tandem ctl failed: {out.stderr}")


def observe(gateway_url: str, n: int, concurrency: int) -> Counter:
    """The backends ``n`` chat requests (users ``demo-0`` ... ``demo-n-1``) were answered by."""

    def one(client: httpx.Client, i: int) -> str:
        r = client.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
            "temperature": 0, "user": f"demo-{i}"})
        r.raise_for_status()
        return r.headers["x-tandem-backend"]

    with httpx.Client(base_url=gateway_url, timeout=120) as client, ThreadPoolExecutor(concurrency) as pool:
        return Counter(pool.map(lambda i: one(client, i), range(n)))


def report(step: str, weight: float, seen: Counter, n: int, tolerance: float) -> bool:
    share = 100 * seen[CANARY] / n
    ok = abs(share - weight) <= tolerance
    print(f"  {step}: weight {weight:g} % -> observed {CANARY} {seen[CANARY]}/{n} = {share:.1f} %, "
          f"{STABLE} {seen[STABLE]}/{n}{'' if ok else f'  (more than {tolerance:g} points off)'}\n")
    return ok


def walk(gateway_url: str, steps: list[float], n: int, concurrency: int, tolerance: float) -> bool:
    """The canary walk and the rollback; True when every observed split is within ``tolerance`` points."""
    ok = report("before", 5, observe(gateway_url, n, concurrency), n, tolerance)
    for weight in steps:
        ctl(gateway_url, "weights", ROUTE, f"{CANARY}={weight:g}", f"{STABLE}={100 - weight:g}")
        ok &= report(f"step {weight:g} %", weight, observe(gateway_url, n, concurrency), n, tolerance)
    ctl(gateway_url, "rollback")           # back to the version before the last step
    ok &= report("after rollback", steps[-2] if len(steps) > 1 else 5, observe(gateway_url, n, concurrency), n,
                 tolerance)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="25,100", help="canary weights after the config's 5 %%, in order")
    p.add_argument("--requests", type=int, default=400, help="chat requests per step (one user each)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=5.0, help="points an observed share may be off its weight")
    p.add_argument("--port", type=int, default=0, help="the gateway's port (0: a free one)")
    args = p.parse_args(argv)
    steps = [float(s) for s in args.steps.split(",")]
    work = Path(tempfile.mkdtemp(prefix="tandem-demo-"))
    engine_port, gw_port = free_port(), args.port or free_port()
    config = work / "config.yaml"
    config.write_text(demo_config(Path(EXAMPLE_CONFIG).read_text(), engine_port, work / "data"))
    print(f"starting the canary arm ({CANARY}: tandem engine serve --dtype float32 on :{engine_port}) and the "
          f"gateway on :{gw_port} (config.example.yaml, embedded Redis under {work / 'data'}); logs in {work}")
    engine = Server(tandem_cmd("engine", "serve", "--port", str(engine_port), "--dtype", "float32",
                               "--served-model-name", "smollm2", "--max-model-len", "2048",
                               "--kv-cache-memory", "512MiB"),
                    f"http://127.0.0.1:{engine_port}/health", f"http://127.0.0.1:{engine_port}", log_dir=work,
                    name="engine-f32")
    gateway = None
    try:
        engine.wait_ready(timeout=600)
        gateway = Server(tandem_cmd("serve", "--config", str(config), "--port", str(gw_port)),
                         f"http://127.0.0.1:{gw_port}/health/ready", f"http://127.0.0.1:{gw_port}",
                         env={"TANDEM_ADMIN_TOKEN": TOKEN}, log_dir=work, name="gateway").wait_ready(timeout=600)
        print(f"ready. The ops console shows the walk live: {gateway.base_url}/admin/ui (token {TOKEN})\n")
        started = time.monotonic()
        ok = walk(gateway.base_url, steps, args.requests, args.concurrency, args.tolerance)
        print(f"done in {time.monotonic() - started:.0f} s: every observed split within {args.tolerance:g} points"
              if ok else "some observed split was off its weight")
        return 0 if ok else 1
    finally:
        if gateway is not None:
            gateway.stop(timeout=40)
        engine.stop(timeout=40)


if __name__ == "__main__":
    sys.exit(main())
