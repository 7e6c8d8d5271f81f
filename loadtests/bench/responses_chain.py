"""A long chain of Responses turns (``previous_response_id``), each a large body, with ``truncation: auto``:
each turn's seconds and the gateway's resident memory, for two gateways on the local engine (SmolLM2) served
turn by turn, interleaved: one with ``server.max_body_size`` (the bound a chained conversation is held to,
``gateway/translate/responses_truncation.history_within``), one with a limit no chain reaches here (the
conversation whole, as before the bound). docs/benchmarks/responses-chain.md has the figures.

    python -m loadtests.bench.responses_chain [--turns 11] [--items 300] [--words 700] [--bound 4MiB]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.bench.structured_isolation import rss_mib
from loadtests.procs import Server, free_port, tandem_cmd

_WORDS = "the of and to in is was for on that with as by at from it an be this which or are".split()


def _config(max_body_size: str) -> str:
    return (f"server: {{max_body_size: {max_body_size}}}\nreload: {{watch: false}}\n"
            "resilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m\nbackends:\n  local:\n    type: local\n"
            "    engine: {served_model_name: m, max_model_len: 2048, kv_cache_memory: 128MiB}\n"
            "routes:\n  main:\n    targets: [{backend: local}]\npolicy:\n  default_route: main\n")


def _turn(rng: random.Random, items: int, words: int) -> list[dict]:
    """``items`` messages of ``words`` random common words, user and assistant in turn, the last a short ask."""
    turn = [{"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choice(_WORDS) for _ in range(words))}
            for i in range(items - 1)]
    return [*turn, {"role": "user", "content": "Say hi."}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=11)
    ap.add_argument("--items", type=int, default=300, help="input items per turn")
    ap.add_argument("--words", type=int, default=700, help="words per item")
    ap.add_argument("--bound", default="4MiB", help="the bounded gateway's server.max_body_size")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="responses-chain-"))
    gateways = {}
    try:
        for name, limit in (("bounded", args.bound), ("whole", "1GiB")):
            path = logs / f"{name}.yaml"
            path.write_text(_config(limit))
            port = free_port()
            gateways[name] = Server(tandem_cmd("serve", "--config", str(path), "--port", str(port)),
                                    f"http://127.0.0.1:{port}/health/ready", f"http://127.0.0.1:{port}",
                                    log_dir=logs, name=name).wait_ready(300)
        rows, prev = [], {name: None for name in gateways}
        rng = random.Random(0)
        for t in range(args.turns):
            items = _turn(rng, args.items, args.words)
            row = {"turn": t, "body_kib": len(json.dumps({"input": items})) // 1024}
            for name, server in gateways.items():      # the same turn on each, one after the other
                body = {"model": "m", "input": items, "truncation": "auto", "max_output_tokens": 16, "temperature": 0}
                if prev[name]:
                    body["previous_response_id"] = prev[name]
                t0 = time.monotonic()
                r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=900)
                row[f"{name}_s"] = round(time.monotonic() - t0, 2)
                r.raise_for_status()
                prev[name] = r.json()["id"]
                row[f"{name}_rss_mib"] = round(rss_mib(server.pid))
            row["time_whole_over_bounded"] = round(row["whole_s"] / row["bounded_s"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "turns": rows}, indent=1))
    finally:
        for server in gateways.values():
            server.stop()


if __name__ == "__main__":
    main()
