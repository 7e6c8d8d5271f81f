"""``python -m loadtests.bench.structured_isolation``: can a schema hurt the others?

Against a real ``tandem engine serve`` process (issue #34's figures):

1. Baseline: one streamed chat request (greedy, ``ignore_eos``, ``--max-tokens``
   tokens) alone, ``--baseline-runs`` times; its inter-token gaps (time
   between SSE content events), p50/p99/max. ``/health`` is polled through
   both phases, so the schema is the one difference between them.
2. Under a large schema: the same stream, run again and again from before
   until after another client sends a ``--schema-kb`` KB JSON schema
   (nested objects of enums, inside the supported subset) twice, one after
   the other (its compile, then the cached repeat); the streams' largest
   gap, and ``/health``'s slowest answer, polled meanwhile. Target: no gap
   over 2x the baseline p99. Also the largest gap that ended while the sends
   were in flight (``sends_window_max_gap_over_baseline_p99``): the phase
   starts 1 s before the first send and ends with the stream running when the
   second is answered.
2b. Control: the same streams again for as long as phase 2 lasted, no schema
   sent (it is compiled and cached by then): the largest gap the host gives
   this stream in a window that long without any schema, the noise floor of
   phase 2's figure. Each phase also reports the steal time of the machine's
   CPUs (``/proc/stat``: time a virtual machine's CPUs were runnable but the
   hypervisor ran something else), which no process in it can act on.

Each gap is also given less the time the stream's reader thread waited for a
CPU within it (``less_reader_wait``, Linux's schedstat): on a loaded shared
host this process is starved too, and a gap it reads late is its own. And
less the CPU time the hypervisor stole within it (``less_steal``: the most
any one virtual CPU lost in the gap by ``/proc/stat``'s per-CPU ``steal``,
less one clock tick for the counter's resolution, so never more than the
host took): a step of the engine waits for its slowest thread, so a gap the
host stretched is the host's. Each thread (stream, ``/health``, sends) has
its own kept-alive client.
3. Embeddings (``loadtests/bench/embedding_isolation.py``): the same streams while ``--embeds`` embeddings of
   ``--embed-tokens`` tokens arrive one after the other, and a short prompt's TTFT meanwhile; the largest gap over
   the baseline's p99 (target: <= 2x). ``--only-embeddings``: the baseline and this phase alone.
   ``--only-embedding-queue``: instead, a 2-token embedding's seconds alone and 1 s after another client's call
   of ``--batch-inputs`` inputs of ``--batch-tokens`` tokens, ``--queue-rounds`` times (``measure_embedding_queue``).
4. Memory: the engine core's RSS (``/proc/<pid>/status`` VmRSS) every 100 of
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
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx

from loadtests.bench.embedding_isolation import embeddings_figures, measure_embedding_queue, measure_embeddings_phase
from loadtests.procs import Server, descendants, exit_on_sigterm, free_port, tandem_cmd

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


class Gap(NamedTuple):
    """One inter-token gap of the measured stream, as its reader saw it."""

    seconds: float       # between two consecutive content events
    reader_wait: float   # of those, seconds the reader thread was runnable but not running (``reader_wait``)
    end: float           # ``time.perf_counter()`` at the second event
    steal: float         # of those, seconds the hypervisor stole from the virtual CPU it stole most from


def stream_gaps(client: httpx.Client, base: str, model: str, max_tokens: int) -> list[Gap]:
    """The ``Gap`` between each two consecutive content events of one streamed chat request."""
    body = {"model": model, "messages": ASK, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") and '"content":""' not in \
                    line.replace(" ", ""):
                times.append((time.perf_counter(), reader_wait(), steal_by_cpu()))
    return [Gap(b - a, wb - wa, b, gap_steal(sa, sb)) for (a, wa, sa), (b, wb, sb) in zip(times, times[1:])]


def reader_wait() -> float:
    """Seconds this thread has been runnable but not running, since it started (Linux's schedstat run-queue
    wait; 0 elsewhere). On a loaded shared host the benchmark's own process waits for a CPU too: an event
    the server wrote on time is read late, and the gap is this process's (seen: a 1.8 s gap here while the
    server, timing its own writes, had none over 0.33 s)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def steal_seconds() -> float | None:
    """CPU seconds stolen from this (virtual) machine so far, all CPUs (``/proc/stat``'s ``steal``; None where
    unreadable)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def steal_by_cpu() -> tuple[int, ...]:
    """Clock ticks stolen from each virtual CPU so far (``/proc/stat``'s ``cpuN`` lines, field 8; empty where
    unreadable). Read at every token: one small file, tens of microseconds."""
    try:
        with open("/proc/stat") as f:
            return tuple(int(line.split()[8]) for line in f if line.startswith("cpu") and line[3].isdigit())
    except (OSError, IndexError, ValueError):
        return ()


def gap_steal(before: tuple[int, ...], after: tuple[int, ...]) -> float:
    """Seconds the hypervisor surely stole within a gap: the most any one CPU's counter rose between its two
    reads (``steal_by_cpu``), less one tick, since a counter in whole ticks can rise by one for a fraction of a
    tick (0 where unknown). The most from one CPU, not the sum: a step waits for its slowest thread, and two
    CPUs robbed at once delay it once."""
    if not before or len(before) != len(after):
        return 0.0
    ticks = max(b - a for a, b in zip(before, after))
    return max(ticks - 1, 0) / os.sysconf("SC_CLK_TCK")


def gap_figures(gaps: list[Gap]) -> dict:
    """p50, p99 and max (ms) of the gaps as read, of the gaps less the reader's own wait for a CPU, and of the
    gaps less the host's steal within them."""
    raw = [g.seconds for g in gaps]

    def less(taken: list[float]) -> dict:
        net = [g - t for g, t in zip(raw, taken)]
        return {"p50": statistics.median(net) * 1e3, "p99": pct(net, 0.99) * 1e3, "max": max(net) * 1e3}

    return {"p50": statistics.median(raw) * 1e3, "p99": pct(raw, 0.99) * 1e3, "max": max(raw) * 1e3,
            "n": len(raw), "less_reader_wait": less([g.reader_wait for g in gaps]),
            "less_steal": less([g.steal for g in gaps]),
            "reader_wait_max": max(g.reader_wait for g in gaps) * 1e3, "steal_max": max(g.steal for g in gaps) * 1e3}


def sends_window_gaps(gaps: list[Gap], t0: float, send_seconds: list[float]) -> list[Gap]:
    """The gaps that ended from the first send (``t0``, ``time.perf_counter()``) until the last send was
    answered (the sends, back to back, took ``send_seconds``): the phase less the stream time around it that no
    schema traffic can explain."""
    end = t0 + sum(send_seconds)
    return [g for g in gaps if t0 <= g.end <= end]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def schema_body(model: str, schema: dict) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 4,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                      ).encode()


def send_schema(client: httpx.Client, base: str, body: bytes) -> tuple[int, float]:
    """POST a pre-encoded body (encoding 400 KB here would hold this process's GIL, the stream reader's too)."""
    start = time.perf_counter()
    r = client.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                    timeout=600)
    return r.status_code, time.perf_counter() - start


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def core_rss_by_schemas(client: httpx.Client, base: str, model: str, server_pid: int, schemas: int
                        ) -> list[tuple[int, float]]:
    """(schemas sent, the engine core's RSS in MiB) before and after every 100 of ``schemas`` distinct small
    schemas, 4 at a time (the core: the server's largest child process, or the server itself)."""
    core = descendants(server_pid)
    core_pid = max(core, key=rss_mib) if core else server_pid
    rss = [(0, rss_mib(core_pid))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for start in range(0, schemas, 100):
            codes = list(pool.map(lambda i: send_schema(client, base, schema_body(model, small_schema(i)))[0],
                                  range(start, min(start + 100, schemas))))
            assert all(c == 200 for c in codes), codes
            rss.append((min(start + 100, schemas), rss_mib(core_pid)))
    return rss


@dataclass
class Phases:
    """What ``measure_phases`` measured: each phase's gaps (``Gap``), ``/health`` seconds and
    steal seconds (None where unknown); the two sends' (status, seconds); ``time.perf_counter()`` at the first
    send."""

    baseline: list
    under_schema: list
    control: list
    sends: list
    health_alone: list
    health: list
    steal_s: dict
    t0: float


def measure_phases(streamer: httpx.Client, poller: httpx.Client, sender: httpx.Client, base: str, model: str,
                   big: bytes, baseline_runs: int, max_tokens: int) -> Phases:
    """The measured phases, ``/health`` polled through all (the schema is their one difference): the stream
    alone ``baseline_runs`` times; streams back to back while ``big`` is sent twice; the same streams as long
    again with no schema sent (control)."""
    health: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            poller.get(f"{base}/health", timeout=60)
            health.append(time.perf_counter() - t)
            time.sleep(0.05)

    sent = threading.Event()

    def streams_until(done) -> list[Gap]:
        """Gaps of back-to-back streams until ``done()`` (gaps within a stream only)."""
        out = []
        while not done():
            out += stream_gaps(streamer, base, model, max_tokens)
        return out

    marks = [steal_seconds()]   # the machine's steal time at the start and at each phase's end
    # `/health` is polled through the baseline too: the one difference between the two figures is the schema.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        try:
            health_f = pool.submit(poll_health)
            baseline = [g for _ in range(baseline_runs) for g in stream_gaps(streamer, base, model, max_tokens)]
            marks.append(steal_seconds())
            health_alone, health[:] = list(health), []
            started = time.perf_counter()
            gaps_f = pool.submit(streams_until, sent.is_set)
            time.sleep(1.0)
            t0 = time.perf_counter()
            sends = [send_schema(sender, base, big), send_schema(sender, base, big)]
            sent.set()
            gaps = gaps_f.result()
            marks.append(steal_seconds())
            health_under = list(health)
            end = 2 * time.perf_counter() - started   # as long again
            control = streams_until(lambda: time.perf_counter() >= end)
            marks.append(steal_seconds())
            stop.set()
            health_f.result()
        finally:  # interrupted (Ctrl-C, SIGTERM): the loops end, so the pool's exit does not wait forever
            sent.set()
            stop.set()
    steal = {phase: None if a is None or b is None else b - a
             for phase, a, b in zip(("baseline", "under_schema", "control"), marks, marks[1:])}
    return Phases(baseline, gaps, control, sends, health_alone, health_under, steal, t0)


def embeddings_phase(args, streamer: httpx.Client, base: str, model: str, alone: dict) -> dict:
    """Phase 3's figures (``loadtests/bench/embedding_isolation.py``) against the baseline's gap figures."""
    def streams_until(done) -> list[Gap]:
        out = []
        while not done():
            out += stream_gaps(streamer, base, model, args.max_tokens)
        return out

    phase = measure_embeddings_phase(streams_until, base, model, args.embed_tokens, args.embeds, args.short_after_s)
    return embeddings_figures(phase, alone["p99"], alone["less_steal"]["p99"])


def run(args) -> dict:
    load_before = os.getloadavg()  # a shared host's load decides how far the gaps can be read
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = Server(tandem_cmd("engine", "serve", "--port", str(port), "--dtype", "bfloat16",
                               "--kv-cache-memory", "256MiB", "--max-model-len", str(max(2048, args.embed_tokens + 16)),
                               "--structured-outputs-cache-entries", str(args.cache_entries),
                               "--structured-outputs-compile-timeout-s", str(args.compile_timeout_s)),
                    f"{base}/health", base, name="engine").wait_ready(600)
    # One client (a kept-alive connection) per thread, made before measuring: httpx.get() builds a client,
    # its SSL context included, per call: 85-225 ms of this process's CPU on a loaded 2-core host, partly with
    # the GIL the stream reader needs (its gaps were up to 10x the server's own, timed where it writes them).
    streamer, poller, sender = httpx.Client(), httpx.Client(), httpx.Client()
    try:
        model = sender.get(f"{base}/v1/models").json()["data"][0]["id"]
        stream_gaps(streamer, base, model, 16)  # warm-up
        if args.only_embedding_queue:
            return {"embedding_queue": measure_embedding_queue(base, model, args.batch_inputs, args.batch_tokens,
                                                               args.queue_rounds),
                    "load_average_before_after": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count()}
        if args.only_embeddings:
            alone = gap_figures([g for _ in range(args.baseline_runs)
                                 for g in stream_gaps(streamer, base, model, args.max_tokens)])
            return {"baseline_gap_ms": alone, "embeddings": embeddings_phase(args, streamer, base, model, alone),
                    "load_average_before_after": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count()}
        send_schema(sender, base, schema_body(model, small_schema(-1)))  # builds the grammar manager
        poller.get(f"{base}/health")
        schema = big_schema(args.schema_kb)
        size_kb = len(json.dumps(schema)) / 1000
        big = schema_body(model, schema)
        # This process's own full collections would walk the schema's ~8,600 containers (and httpx's modules)
        # with the GIL held, while the stream reader waits: a gap of the client, not the server's.
        del schema
        gc.collect()
        gc.freeze()
        ph = measure_phases(streamer, poller, sender, base, model, big, args.baseline_runs, args.max_tokens)
        worst = max(ph.under_schema, key=lambda g: g.seconds)
        during = sends_window_gaps(ph.under_schema, ph.t0, [t for _, t in ph.sends])
        alone, under, control = gap_figures(ph.baseline), gap_figures(ph.under_schema), gap_figures(ph.control)
        embeddings = embeddings_phase(args, streamer, base, model, alone)
        rss = core_rss_by_schemas(sender, base, model, server.pid, args.schemas)
        return {
            "embeddings": embeddings,
            "baseline_gap_ms": alone,
            "schema_kb": size_kb, "schema_sends": [{"status": s, "seconds": round(t, 3)} for s, t in ph.sends],
            "under_schema_gap_ms": under,
            "max_gap_over_baseline_p99": under["max"] / alone["p99"],
            "less_reader_wait_max_gap_over_baseline_p99": under["less_reader_wait"]["max"] / alone[
                "less_reader_wait"]["p99"],
            # when the largest gap ended, in seconds after the first send began (its compile: the first send's
            # seconds; the cached repeat after that; negative: before the schema was sent)
            "largest_gap_at_s": round(worst.end - ph.t0, 3),
            # that gap, and how much of it the reader waited for a CPU and the host stole
            "largest_gap_ms": {"gap": worst.seconds * 1e3, "reader_wait": worst.reader_wait * 1e3,
                               "steal": worst.steal * 1e3},
            "less_steal_max_gap_over_baseline_p99": under["less_steal"]["max"] / alone["less_steal"]["p99"],
            # the largest gap that ended while the schema was being sent and answered (its compile included)
            "sends_window_max_gap_over_baseline_p99": max((g.seconds for g in during), default=0.0) * 1e3
            / alone["p99"],
            "sends_window_less_steal_max_gap_over_baseline_p99": max(
                (g.seconds - g.steal for g in during), default=0.0) * 1e3 / alone["less_steal"]["p99"],
            "control_gap_ms": control,
            "control_max_gap_over_baseline_p99": control["max"] / alone["p99"],
            "control_less_steal_max_gap_over_baseline_p99": control["less_steal"]["max"] / alone["less_steal"]["p99"],
            "steal_ms": {phase: None if s is None else round(s * 1e3) for phase, s in ph.steal_s.items()},
            "health_max_ms": max(ph.health) * 1e3 if ph.health else None,
            "health_max_alone_ms": max(ph.health_alone) * 1e3 if ph.health_alone else None,
            "core_rss_mib_by_schemas": rss, "cache_entries": args.cache_entries,
            "load_average_before_after": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count(),
        }
    finally:
        for client in (streamer, poller, sender):
            client.close()
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
    parser.add_argument("--embed-tokens", type=int, default=8000, help="tokens of each embedding input")
    parser.add_argument("--embeds", type=int, default=2, help="embeddings sent, one after the other")
    parser.add_argument("--short-after-s", type=float, default=1.0,
                        help="seconds after each embedding is sent that the short prompt is")
    parser.add_argument("--only-embeddings", action="store_true", help="the baseline and the embeddings phase alone")
    parser.add_argument("--only-embedding-queue", action="store_true",
                        help="a short embedding alone and behind another call's batch, nothing else")
    parser.add_argument("--batch-inputs", type=int, default=12, help="inputs of the batch the short one follows")
    parser.add_argument("--batch-tokens", type=int, default=1560, help="tokens of each of the batch's inputs")
    parser.add_argument("--queue-rounds", type=int, default=3, help="rounds of the embedding-queue measure")
    parser.add_argument("--output-json", default=None, help="also write the results here")
    args = parser.parse_args()
    exit_on_sigterm()  # stopped by `timeout`: its server stopped too
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text)


if __name__ == "__main__":
    main()
