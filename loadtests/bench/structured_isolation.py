"""``python -m loadtests.bench.structured_isolation``: can a schema hurt the others?

Against a real ``tandem engine serve`` process (issue #34's figures):

1. Baseline: one streamed chat request (greedy, ``ignore_eos``, ``--max-tokens``
   tokens) alone, ``--baseline-runs`` times; its inter-token gaps (time
   between SSE content events), p50/p99/max.
2. Under a large schema: the same stream, run again and again from before
   until after another client sends a ``--schema-kb`` KB JSON schema
   (nested objects of enums, inside the supported subset) twice, one after
   the other (its compile, then the cached repeat); the streams' largest
   gap, and ``/health``'s slowest answer, polled meanwhile. Target: no gap
   over 2x the baseline p99.
3. Memory: the engine core's RSS (``/proc/<pid>/status`` VmRSS) every 100 of
   ``--schemas`` distinct small schemas (each a 1-token request), with the
   grammar cache bounded at ``--cache-entries``: flat past the bound.

Prints one JSON object; ``--output-json`` writes it too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

from loadtests.procs import Server, _children, free_port, tandem_cmd

ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def big_schema(kb: int) -> dict:
    """A schema of about ``kb`` KB: objects of 20 enum-valued properties each."""
    def group(i: int) -> dict:
        return {"type": "object", "properties": {
            f"q{j}": {"type": "string", "enum": [f"v{i}_{j}_{k}" for k in range(5)]} for j in range(20)}}
    n = max(1, kb * 1000 // 1960)
    return {"type": "object", "properties": {f"p{i}": group(i) for i in range(n)}, "required": ["p0"]}


def small_schema(i: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": i + 1}}, "required": [f"k{i}"]}


def stream_gaps(base: str, model: str, max_tokens: int) -> list[float]:
    """Seconds between consecutive content events of one streamed chat request."""
    body = {"model": model, "messages": ASK, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") and '"content":""' not in \
                    line.replace(" ", ""):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def schema_body(model: str, schema: dict) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 4,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                      ).encode()


def send_schema(base: str, body: bytes) -> tuple[int, float]:
    """POST a pre-encoded body (encoding 400 KB here would hold this process's GIL, the stream reader's too)."""
    start = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=600)
    return r.status_code, time.perf_counter() - start


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(args) -> dict:
    load_before = os.getloadavg()  # a shared host's load decides how far the gaps can be read
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = Server(tandem_cmd("engine", "serve", "--port", str(port), "--dtype", "bfloat16",
                               "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                               "--structured-outputs-cache-entries", str(args.cache_entries),
                               "--structured-outputs-compile-timeout-s", str(args.compile_timeout_s)),
                    f"{base}/health", base, name="engine").wait_ready(600)
    try:
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        stream_gaps(base, model, 16)  # warm-up
        send_schema(base, schema_body(model, small_schema(-1)))  # builds the grammar manager (imports xgrammar)
        schema = big_schema(args.schema_kb)
        size_kb = len(json.dumps(schema)) / 1000
        big = schema_body(model, schema)
        # This process's own full collections would walk the schema's ~8,600 containers (and httpx's modules)
        # with the GIL held, while the stream reader waits: a gap of the client, not the server's.
        del schema
        gc.collect()
        gc.freeze()
        baseline = [g for _ in range(args.baseline_runs) for g in stream_gaps(base, model, args.max_tokens)]
        health: list[float] = []
        stop = threading.Event()

        def poll_health() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                httpx.get(f"{base}/health", timeout=60)
                health.append(time.perf_counter() - t)
                time.sleep(0.05)

        sent = threading.Event()

        def streams_until_sent() -> list[float]:
            """Gaps of back-to-back streams, until both sends are answered (gaps within a stream only)."""
            out = []
            while not sent.is_set():
                out += stream_gaps(base, model, args.max_tokens)
            return out

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            gaps_f = pool.submit(streams_until_sent)
            health_f = pool.submit(poll_health)
            time.sleep(1.0)
            sends = [send_schema(base, big), send_schema(base, big)]
            sent.set()
            gaps = gaps_f.result()
            stop.set()
            health_f.result()
        core = _children(server.pid)
        core_pid = max(core, key=rss_mib) if core else server.pid
        rss = [(0, rss_mib(core_pid))]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for start in range(0, args.schemas, 100):
                codes = list(pool.map(lambda i: send_schema(base, schema_body(model, small_schema(i)))[0],
                                      range(start, min(start + 100, args.schemas))))
                assert all(c == 200 for c in codes), codes
                rss.append((min(start + 100, args.schemas), rss_mib(core_pid)))
        return {
            "baseline_gap_ms": {"p50": statistics.median(baseline) * 1e3, "p99": pct(baseline, 0.99) * 1e3,
                                "max": max(baseline) * 1e3, "n": len(baseline)},
            "schema_kb": size_kb, "schema_sends": [{"status": s, "seconds": round(t, 3)} for s, t in sends],
            "under_schema_gap_ms": {"p50": statistics.median(gaps) * 1e3, "p99": pct(gaps, 0.99) * 1e3,
                                    "max": max(gaps) * 1e3, "n": len(gaps)},
            "max_gap_over_baseline_p99": max(gaps) / pct(baseline, 0.99),
            "health_max_ms": max(health) * 1e3 if health else None,
            "core_rss_mib_by_schemas": rss, "cache_entries": args.cache_entries,
            "load_average_before_after": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count(),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens of the measured stream")
    parser.add_argument("--baseline-runs", type=int, default=3, help="streams measured alone")
    parser.add_argument("--schema-kb", type=int, default=400, help="size of the large schema, KB")
    parser.add_argument("--schemas", type=int, default=1000, help="distinct small schemas for the RSS figure")
    parser.add_argument("--cache-entries", type=int, default=256, help="--structured-outputs-cache-entries")
    parser.add_argument("--compile-timeout-s", type=float, default=60.0,
                        help="--structured-outputs-compile-timeout-s (high enough that the large schema compiles "
                             "on a loaded machine: the figure is about its compile's effect on the others)")
    parser.add_argument("--output-json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text)


if __name__ == "__main__":
    main()
