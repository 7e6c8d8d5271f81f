"""Load-test tool: workloads, stats, the runner against loadtests' own upstream,
reports, parity, and each scenario in a tiny configuration (no timing thresholds)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_models import save_byte_level_llama

from loadtests import cli
from loadtests.client import RequestResult, check_loopback
from loadtests.procs import Server, cpu_seconds, cpu_set, free_port, upstream_cmd
from loadtests.runner import LoadConfig, run_load_sync
from loadtests.scenarios.canary import split_by_phase
from loadtests.scenarios.failover import analyse
from loadtests.scenarios.parity import Answer, compare, cosine
from loadtests.stats import percentiles, summarize
from loadtests.workloads import LengthDist, build_workload, load_mt_bench, mt_bench_turn1, mt_bench_turn2, synthetic

ORDER = ("min", "p50", "p90", "p95", "p99", "max")


def assert_ordered(p: dict | None) -> None:
    assert p is not None
    vals = [p[k] for k in ORDER]
    assert vals == sorted(vals), p


def start_upstream(tmp_path, name: str = "upstream", *extra: str) -> Server:
    port = free_port()
    return Server(upstream_cmd(port, name, *extra), f"http://127.0.0.1:{port}/health",
                  f"http://127.0.0.1:{port}", log_dir=tmp_path, name=name).wait_ready(30)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    srv = start_upstream(tmp_path_factory.mktemp("up"))
    yield srv
    srv.stop()


# --- workloads ---------------------------------------------------------------
def test_mt_bench_turn2_extends_turn1():
    qs = load_mt_bench()
    assert len(qs) == 80
    t1, t2 = mt_bench_turn1(16), mt_bench_turn2(16, answers={81: "An answer."})
    assert len(t1) == len(t2) == 80
    for a, b in zip(t1, t2):
        assert b.messages[:1] == a.messages and len(b.messages) == 3
        assert b.prompt.startswith(a.prompt[: -len("\nAssistant:")])
    assert t2[0].messages[1]["content"] == "An answer."


@pytest.mark.parametrize("spec, lo, hi", [("fixed:7", 7, 7), ("12", 12, 12), ("uniform:3,9", 3, 9),
                                          ("normal:50,10", 1, 10**6), ("exponential:20", 1, 10**6)])
def test_length_distributions(spec, lo, hi):
    d = LengthDist.parse(spec)
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(500)]
    assert min(xs) >= lo and max(xs) <= hi
    if d.kind == "uniform":
        assert set(xs) == set(range(3, 10))


@pytest.mark.parametrize("spec", ["uniform:9,3", "poisson:4", "fixed:0", "normal:5", "uniform:a,b"])
def test_bad_length_distribution(spec):
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


def test_synthetic_is_deterministic_and_sized():
    a = synthetic(20, LengthDist.parse("uniform:5,40"), LengthDist.parse("fixed:9"), seed=3)
    b = synthetic(20, LengthDist.parse("uniform:5,40"), LengthDist.parse("fixed:9"), seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(5 <= len(s.prompt.split()) <= 40 and s.max_tokens == 9 for s in a)
    assert len({s.prompt.split()[0] for s in a}) == 20  # no shared first word
    body = build_workload("synthetic", num_prompts=2, max_tokens=4, ignore_eos=True)[0].body("completions", "m", True)
    assert body["prompt"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError):
        build_workload("nope", num_prompts=1)


# --- client / stats ----------------------------------------------------------
@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://localhost:1", "http://[::1]:80", "http://127.3.4.5"])
def test_loopback_allowed(url):
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "https://api.deepseek.com/v1", "http://0.0.0.0:80", "ftp://127.0.0.1"])
def test_non_loopback_refused(url):
    with pytest.raises(ValueError):
        check_loopback(url)
    if url.startswith("http"):
        check_loopback(url, allow_remote=True)


def test_cli_refuses_remote_target(capsys):
    assert cli.main(["run", "--url", "http://192.0.2.1:8000/v1", "--model", "m", "--num-requests", "1"]) == 2
    assert "non-loopback" in capsys.readouterr().err


def test_percentiles_and_summary_counts():
    rng = random.Random(1)
    assert percentiles([]) is None
    p = percentiles([rng.expovariate(1) for _ in range(1000)])
    assert_ordered(p)
    results = [RequestResult(ok=True, start=i, e2e=0.5 + i / 100, ttft=0.1, itls=[0.01] * 3, output_tokens=4,
                             prompt_tokens=10, backend="a" if i % 4 else "b") for i in range(20)]
    results += [RequestResult(ok=False, start=0, error="http_503"), RequestResult(ok=False, start=0, error="timeout")]
    s = summarize(results, 0.0, 10.0)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (22, 20, 2)
    assert s["errors_by_kind"] == {"http_503": 1, "timeout": 1}
    assert s["output_tokens"] == 80 and s["requests_per_s"] == pytest.approx(2.0)
    assert s["itl_s"]["count"] == 60 and s["tpot_s"]["p50"] == pytest.approx((0.5 + 0.095 - 0.1) / 3, rel=0.2)
    assert s["backends"] == {"a": 15, "b": 5}
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert_ordered(s[k])


# --- the runner against the upstream ------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_closed_loop_streaming_counts_add_up(upstream, endpoint):
    wl = build_workload("synthetic", num_prompts=10, max_tokens=5, input_len="uniform:3,30")
    cfg = LoadConfig(upstream.base_url + "/v1", "m", endpoint, stream=True, concurrency=4, num_requests=37,
                     progress=False)
    run = run_load_sync(cfg, wl)
    s = summarize(run.results, run.t_start, run.t_end)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (37, 37, 0)
    assert s["output_tokens"] == 37 * 5
    assert s["itl_s"]["count"] == 37 * 4 and s["ttft_s"]["count"] == 37
    assert sorted(r.index for r in run.results) == list(range(37))
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert_ordered(s[k])
    assert all(r.ttft <= r.e2e for r in run.results)


def test_open_loop_bounded_by_count_and_duration(upstream):
    wl = build_workload("mtbench", num_prompts=5, max_tokens=3)
    run = run_load_sync(LoadConfig(upstream.base_url, "m", rate=200.0, concurrency=8, num_requests=30,
                                   progress=False), wl)
    assert len(run.results) == 30 and all(r.ok and r.output_tokens == 3 for r in run.results)
    run = run_load_sync(LoadConfig(upstream.base_url, "m", rate=50.0, concurrency=8, duration=0.5,
                                   progress=False), wl)
    assert 1 <= len(run.results) < 200 and all(r.ok for r in run.results)
    assert max(r.start for r in run.results) - run.t_start < 0.5


def test_errors_are_counted_by_kind(upstream):
    wl = build_workload("mtbench", num_prompts=2, max_tokens=-1)  # the upstream answers 400
    run = run_load_sync(LoadConfig(upstream.base_url, "m", num_requests=3, progress=False), wl)
    assert summarize(run.results, run.t_start, run.t_end)["errors_by_kind"] == {"http_400": 3}
    dead = f"http://127.0.0.1:{free_port()}"
    run = run_load_sync(LoadConfig(dead, "m", num_requests=2, progress=False), wl)
    assert [r.error for r in run.results] == ["connect", "connect"]


def test_cli_run_sweep_writes_files(upstream, tmp_path, capsys):
    out = tmp_path / "res"
    rc = cli.main(["run", "--url", upstream.base_url + "/v1", "--model", "m", "--workload", "synthetic",
                   "--num-prompts", "8", "--max-tokens", "4", "--concurrency", "1,4", "--num-requests", "12",
                   "--stream", "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["summary"]["num_ok"] for r in data["runs"]] == [12, 12]
    for name in ("summary.md", "latency_cdf.png", "concurrency_sweep.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert "| c=4 | 12 | 12 | 0 |" in capsys.readouterr().out


def test_module_entry_point_and_cpu_time(upstream):
    out = subprocess.run([sys.executable, "-m", "loadtests", "--help"], capture_output=True, text=True, check=True)
    assert "parity" in out.stdout and "overhead" in out.stdout
    assert cpu_seconds(upstream.pid) > 0


# --- scenario pieces that need no server ---------------------------------------
def test_parity_compare_and_cosine():
    assert cosine({"a": -0.1, "b": -2.0}, {"a": -0.1, "b": -2.0}) == pytest.approx(1.0)
    assert cosine({"a": 0.0}, {"b": 0.0}) == 0.0
    a = Answer(["x", "y", "z"], [{"x": -0.1}, {"y": -0.2}, {"z": -0.3}], "xyz")
    b = Answer(["x", "y", "w"], [{"x": -0.1}, {"y": -0.2}, {"w": -0.1, "z": -0.5}], "xyw")
    c = compare(a, b)
    assert c["first_divergence"] == 2 and not c["exact_match"] and len(c["cosines"]) == 3
    assert compare(a, a)["first_divergence"] is None
    assert compare(a, Answer(["x", "y"], a.top[:2], "xy"))["first_divergence"] == 2


def test_canary_phase_split_and_failover_analysis():
    rs = [RequestResult(ok=True, start=0.1 * i, e2e=0.01, backend="canary" if i % 10 == 0 else "stable")
          for i in range(100)]
    rows, unassigned = split_by_phase(rs, [(10.0, 0.0, 5.0), (100.0, 5.05, 20.0)])
    assert rows[0]["requests"] + rows[1]["requests"] + unassigned == 100
    assert rows[0]["observed_pct"] == pytest.approx(10.0)
    f = analyse([RequestResult(ok=True, start=t, e2e=0.01, backend="primary" if t < 1 else "fallback")
                 for t in (0.1, 0.5, 1.2, 1.5, 3.0)], 1.0, 1.0)
    assert f["failed"] == 0 and f["fallback_share_after_kill_pct"] == 100.0 and f["requests_in_window"] == 2


# --- scenario 6 against two upstreams ------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_parity_same_target_passes(upstream, tmp_path, endpoint):
    rc = cli.main(["parity", "--a", upstream.base_url + "/v1", "--b", upstream.base_url, "--model", "m",
                   "--num-prompts", "3", "--max-tokens", "6", "--endpoint", endpoint, "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and res["summary"]["passed"]
    assert res["summary"]["exact_match_rate"] == 1.0 and res["summary"]["num_positions"] == 18
    assert res["summary"]["mean_cosine"] == pytest.approx(1.0)


def test_parity_divergent_target_fails(upstream, tmp_path):
    other = start_upstream(tmp_path, "other", "--diverge-at", "4", "--logprob-shift", "0.5")
    try:
        rc = cli.main(["parity", "--a", upstream.base_url, "--b", other.base_url, "--model", "m",
                       "--num-prompts", "2", "--max-tokens", "8", "--out", str(tmp_path / "p")])
    finally:
        other.stop()
    res = json.loads((tmp_path / "p" / "results.json").read_text())
    assert rc == 1 and not res["summary"]["passed"] and res["summary"]["exact_match_rate"] == 0.0
    assert [p["first_divergence"] for p in res["prompts"]] == [4, 4]
    assert all(len(p["cosines"]) == 5 for p in res["prompts"])
    assert res["summary"]["mean_cosine"] < 0.9985


# --- scenarios 1, 3, 4: the gateway in front of loadtests' upstreams -------------
def _results(path) -> dict:
    return json.loads((path / "results.json").read_text())


def _files_written(path, *names) -> None:
    for name in ("results.json", "summary.md", *names):
        assert (path / name).stat().st_size > 0, name


def test_scenario_overhead_tiny(tmp_path, capsys):
    rc = cli.main(["overhead", "--requests-c1", "30", "--requests-c32", "150", "--concurrency", "8",
                   "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    res = _results(tmp_path)
    assert set(res["figures"]) == {"non-stream", "stream"}
    for mode, f in res["figures"].items():
        assert f["errors"] == {"direct": 0, "gateway": 0}
        assert f["gateway_cpu_ms_per_request"] > 0 and f["direct_rps"] > 0 and f["gateway_rps"] > 0
    assert len(res["runs"]) == 8
    for run in res["runs"]:
        s = run["summary"]
        assert s["num_ok"] == s["num_requests"] == (30 if run["label"].endswith("c=1") else 150)
        assert s["output_tokens"] == 16 * s["num_ok"]
        assert_ordered(s["e2e_s"])
        if "gateway" in run["label"]:
            assert s["backends"] == {"upstream": s["num_ok"]}
    _files_written(tmp_path, "latency_cdf.png")
    assert "added p50 ms" in capsys.readouterr().out


def test_a_server_runs_on_the_cpus_it_is_given(tmp_path):
    """``Server(cpus=...)`` (the overhead scenario's ``--pin``): the child's affinity, its threads' too."""
    assert cpu_set("0,2-3") == {0, 2, 3} and cpu_set("1") == {1}
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    srv = Server([sys.executable, "-c", code], "http://127.0.0.1:1/", "", log_dir=tmp_path, cpus=str(cpu))
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{srv.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = [int(t) for t in os.listdir(f"/proc/{srv.pid}/task")]
        assert len(tids) == 2 and all(os.sched_getaffinity(t) == {cpu} for t in tids)
    finally:
        srv.stop()


def test_scenario_canary_tiny(tmp_path):
    rc = cli.main(["canary", "--phases", "0,25,100", "--phase-duration", "1.5", "--concurrency", "4",
                   "--tolerance-pp", "100", "--out", str(tmp_path), "--no-progress"])
    res = _results(tmp_path)
    assert rc == 0 and res["passed"]
    (p0, p25, p100) = res["phases"]
    assert p0["canary"] == 0 and p0["stable"] > 0
    assert p100["stable"] == 0 and p100["canary"] > 0
    assert 0 < p25["canary"] < p25["requests"]
    total = res["runs"][0]["summary"]["num_requests"]
    assert sum(p["requests"] for p in res["phases"]) + res["unassigned"] == total
    assert res["runs"][0]["summary"]["num_errors"] == 0
    # the servers' logs and the config the run wrote stay beside its report, not in a temporary folder
    assert {"gateway.log", "gateway.yaml", "upstream-stable.log"} <= {p.name for p in (tmp_path / "logs").iterdir()}


def test_scenario_failover_tiny(tmp_path):
    rc = cli.main(["failover", "--duration", "3", "--kill-at", "1", "--window", "1", "--concurrency", "4",
                   "--out", str(tmp_path), "--no-progress"])
    res = _results(tmp_path)
    f = res["figures"]
    assert rc == 0 and res["passed"] and f["failed"] == 0
    assert f["fallback_share_after_kill_pct"] == 100.0
    assert 0 < f["fallback_share_pct"] < 100.0
    assert f["requests"] == res["runs"][0]["summary"]["num_requests"] > f["requests_before_kill"] > 0
    assert f["p99_window_ms"] is not None


# --- scenarios 2, 5, 6 against `tandem engine serve` with a tiny random Llama ------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama, byte-level tokenizer (one character = one token), chat template."""
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096, printable_only=True)


ENGINE_ARGS = ["--engine-arg=--kv-cache-memory=64MiB", "--engine-arg=--uvicorn-log-level=warning"]


@pytest.mark.slow
def test_scenario_engine_tiny(tiny_model, tmp_path):
    rc = cli.main(["engine", "--model", tiny_model, "--dtype", "float32", "--concurrency", "1,3",
                   "--num-prompts", "4", "--max-tokens", "5", *ENGINE_ARGS, "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    res = _results(tmp_path)
    for run in res["runs"]:
        s = run["summary"]
        assert s["num_ok"] == s["num_requests"] == 4 and s["output_tokens"] == 20
        assert s["ttft_s"]["count"] == 4 and s["itl_s"]["count"] == 4 * 4
        assert_ordered(s["ttft_s"])
    for c in ("1", "3"):
        assert res["hf"][c]["output_tokens"] == 20 and res["hf"][c]["batch_size"] == int(c)
        f = res["figures"][c]
        assert f["tok_per_s_ratio"] == pytest.approx(f["tandem_output_tokens_per_s"] / f["hf_output_tokens_per_s"])
        assert f["tandem_ttft_p50_s"] <= f["tandem_ttft_p99_s"]
    _files_written(tmp_path, "latency_cdf.png", "concurrency_sweep.png")


@pytest.mark.slow
def test_scenario_prefix_tiny(tiny_model, tmp_path):
    rc = cli.main(["prefix", "--model", tiny_model, "--dtype", "float32", "--num-prompts", "3", "--turn1-tokens", "8",
                   "--turn2-tokens", "3", *ENGINE_ARGS, "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    res = _results(tmp_path)
    f = res["figures"]
    assert f["errors"] == {"on": 0, "off": 0}
    assert f["prefix_cache"]["on"]["hits"] > 0 and f["prefix_cache"]["off"]["hits"] == 0
    for run in res["runs"]:
        assert run["summary"]["num_ok"] == 3 and run["summary"]["output_tokens"] == 9
        assert_ordered(run["summary"]["ttft_s"])
    assert f["ttft_p50_speedup"] == pytest.approx(f["ttft_p50_off_s"] / f["ttft_p50_on_s"])


@pytest.mark.slow
def test_parity_engine_against_itself(tiny_model, tmp_path):
    from loadtests.scenarios.common import start_engine_server

    srv = start_engine_server(tmp_path, ["--model", tiny_model, "--served-model-name", "bench", "--dtype", "float32",
                                         "--kv-cache-memory", "64MiB", "--uvicorn-log-level", "warning"])
    try:
        for endpoint in ("completions", "chat"):
            out = tmp_path / endpoint
            rc = cli.main(["parity", "--a", srv.base_url + "/v1", "--b", srv.base_url + "/v1", "--model", "bench",
                           "--num-prompts", "3", "--max-tokens", "6", "--endpoint", endpoint, "--out", str(out)])
            s = _results(out)["summary"]
            assert rc == 0 and s["passed"] and s["num_failed_prompts"] == 0
            assert s["num_positions"] >= 3 and s["mean_cosine"] > 0.9985
    finally:
        srv.stop()


@pytest.mark.slow
def test_scenario_replicas_tiny(tiny_model, tmp_path):
    """Scenario 7 end to end on three tiny replicas: both policies measured in one run, the kill phase has a
    replica SIGKILLed and no failed request."""
    rc = cli.main(["replicas", "--model", tiny_model, "--replicas", "3", "--users", "6", "--kill-users", "6",
                   "--rounds", "1", "--resume-streams", "0",   # resume: tests/gateway/resilience/test_resume.py
                   "--max-tokens", "4", "--engine-arg=--dtype=float32", "--kv-cache-memory", "64MiB",
                   "--out", str(tmp_path),
                   "--no-progress"])
    assert rc == 0
    res = _results(tmp_path)
    f, kill = res["figures"], res["kill"]
    assert f["hit_rate_pa"] > 0 and f["hit_rate_ratio"] == pytest.approx(f["hit_rate_pa"] / f["hit_rate_rr"])
    assert set(res["phases"]) == {"rr round 1", "pa round 1"}
    for p in res["phases"].values():
        assert p["summary"]["num_ok"] == p["summary"]["num_requests"] == 18
    assert kill["killed_after_requests"] == 6 and kill["requests"] == 18 and kill["failed"] == 0
    assert res["counters"]["routed"] and res["counters"]["affinity"]
    _files_written(tmp_path, "latency_cdf.png")


@pytest.mark.slow
def test_scenario_failover_kills_a_tensor_parallel_rank(tiny_model, tmp_path):
    """Scenario 4 with a 2-rank engine as the primary: one rank SIGKILLed under load, the engine's /health
    stops answering 2xx within 5 s (the issue's bound), no request fails (the fallback serves), and none of
    the engine's processes is left once its server is stopped."""
    rc = cli.main(["failover", "--primary-tp", "2", "--model", tiny_model, "--duration", "8", "--kill-at", "3",
                   "--window", "2", "--concurrency", "4", "--engine-arg=--dtype=float32", *ENGINE_ARGS,
                   "--out", str(tmp_path), "--no-progress"])
    res = _results(tmp_path)
    f = res["figures"]
    assert rc == 0 and res["passed"] and f["failed"] == 0 and f["orphans"] == []
    assert f["unhealthy_after_s"] is not None and f["unhealthy_after_s"] <= 5.0
    assert f["requests_before_kill"] > 0 and f["fallback_share_pct"] < 100.0
    assert f["fallback_share_after_kill_pct"] > 0


def test_structured_isolation_takes_the_readers_own_cpu_wait_out_of_a_gap():
    """A gap the benchmark's reader thread spent runnable but not running is read late by the benchmark, not
    written late by the server: ``less_reader_wait`` takes it out; the raw figures keep it."""
    from loadtests.bench.structured_isolation import Gap, gap_figures

    fig = gap_figures([Gap(0.030, 0.0, 10.03, 0.0), Gap(1.800, 1.770, 11.83, 0.0), Gap(0.020, 0.001, 11.85, 0.0)])
    assert fig["max"] == pytest.approx(1800) and fig["less_reader_wait"]["max"] == pytest.approx(30)
    assert fig["reader_wait_max"] == pytest.approx(1770) and fig["less_steal"]["max"] == pytest.approx(1800)


def test_structured_isolation_takes_the_hosts_steal_out_of_a_gap():
    """A gap the hypervisor stretched (its CPUs' ``steal`` rose within it) is the host's: ``less_steal`` takes
    out the most one CPU lost, less one tick (a whole-tick counter can rise for a fraction of one), never the
    sum over CPUs; the raw figures keep it."""
    from loadtests.bench.structured_isolation import Gap, gap_figures, gap_steal

    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert gap_steal((100, 200), (100, 201)) == 0.0                          # one tick: maybe a fraction of one
    assert gap_steal((100, 200), (104, 202)) == pytest.approx(3 * tick)      # CPU 0 lost 4 ticks, CPU 1 two
    assert gap_steal((), (1, 2)) == 0.0 and gap_steal((1,), (5, 6)) == 0.0  # unknown: nothing taken out
    fig = gap_figures([Gap(0.030, 0.0, 1.0, 0.0), Gap(0.090, 0.0, 1.09, 0.060), Gap(0.020, 0.0, 1.11, 0.0)])
    assert fig["max"] == pytest.approx(90) and fig["less_steal"]["max"] == pytest.approx(30)
    assert fig["steal_max"] == pytest.approx(60) and fig["less_reader_wait"]["max"] == pytest.approx(90)


def test_structured_isolation_sends_window_keeps_only_the_gaps_ending_while_the_schema_was_in_flight():
    from loadtests.bench.structured_isolation import Gap, sends_window_gaps

    gaps = [Gap(0.09, 0.0, 99.9, 0.0), Gap(0.02, 0.0, 100.0, 0.0), Gap(0.03, 0.0, 112.0, 0.0),
            Gap(0.08, 0.0, 112.6, 0.0)]
    assert sends_window_gaps(gaps, 100.0, [12.0, 0.5]) == gaps[1:3]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat")
def test_structured_isolation_reads_the_machines_steal_time():
    """The steal time each phase reports is ``/proc/stat``'s, in seconds: the same figure as the file's own
    first line (field 8, in clock ticks), never going back."""
    from loadtests.bench.structured_isolation import steal_by_cpu, steal_seconds

    first = steal_seconds()
    with open("/proc/stat") as f:
        ticks = int(f.readline().split()[8])
    second = steal_seconds()
    assert first is not None and second is not None
    assert first <= ticks / os.sysconf("SC_CLK_TCK") <= second
    per_cpu = steal_by_cpu()   # the cpuN lines: one per CPU, together the first line's figure
    # read just after; each CPU's counter is rounded down to whole ticks on its own, the first line's once
    assert per_cpu and ticks - len(per_cpu) <= sum(per_cpu) <= ticks + 100


@pytest.mark.parametrize("handled", [True, False])
def test_a_loadtest_stopped_by_sigterm_stops_its_servers(tmp_path, handled):
    """Every ``loadtest`` sub-command runs through ``_stopping_servers_on_sigterm``: SIGTERM runs the scenario's
    ``finally`` (``Server.stop``); run bare, the server, in a session of its own, outlives the program (the
    orphan the unhandled case pins)."""
    pid_file = tmp_path / "server.pid"
    program = (
        "import sys, time\n"
        "from loadtests.cli import _stopping_servers_on_sigterm\n"
        "from loadtests.procs import Server\n"
        "def scenario(args):\n"
        "    s = Server([sys.executable, '-c', 'import time; time.sleep(600)'], 'http://127.0.0.1:9/', '', "
        f"log_dir={str(tmp_path)!r})\n"
        "    try:\n"     # the pid is written inside the try: a SIGTERM right after it still reaches the finally
        f"        open({str(pid_file)!r}, 'w').write(str(s.pid))\n"
        "        time.sleep(600)\n    finally:\n        s.stop()\n"
        f"{'_stopping_servers_on_sigterm(scenario, None)' if handled else 'scenario(None)'}\n")
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=str(Path(__file__).resolve().parents[1]))
    server_pid = None
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None, "the program ended before starting its server"
            time.sleep(0.05)
        server_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        try:  # a zombie is a dead server its parent has not reaped yet
            alive = not Path(f"/proc/{server_pid}/stat").read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            alive = False
        assert alive is not handled
        assert proc.returncode == (128 + signal.SIGTERM if handled else -signal.SIGTERM)
    finally:
        proc.kill()
        if server_pid is not None:
            try:
                os.kill(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_every_loadtest_sub_command_stops_its_servers_on_sigterm():
    """``add_commands`` (what ``tandem loadtest`` and ``python -m loadtests`` both register) wraps every
    sub-command's ``func``."""
    from loadtests.cli import _stopping_servers_on_sigterm

    sub = argparse.ArgumentParser().add_subparsers()
    cli.add_commands(sub)
    funcs = {name: p.get_default("func") for name, p in sub.choices.items()}
    assert {"run", "spill", "failover", "replicas"} <= set(funcs)
    assert all(getattr(f, "func", None) is _stopping_servers_on_sigterm for f in funcs.values()), funcs


@pytest.mark.parametrize("steps", [1, 8])
def test_the_kv_pool_bench_counts_decode_steps_of_any_number_of_tokens(steps):
    """``--kv-pool-cycle-tokens``' decode rate counts the steps where the whole batch decodes; with several steps
    per call (the default 8) a step gives each request several tokens, and a trial's runs counted none (nan)."""
    import math

    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from loadtests.bench.kv_pool import decode_tok_per_s
    engine = LLMEngine(EngineArgs(kv_cache_memory="16MiB", num_scheduler_steps=steps))   # SmolLM2: C decode steps
    rate, table = decode_tok_per_s(engine, [[5, 6, 7], [8, 9, 10]], 24, "t")
    assert math.isfinite(rate) and rate > 0 and table


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[1]))


@pytest.mark.parametrize("args, said", [
    (("bench", "engine", "--num-prompts", "0"), "--num-prompts: must be at least 1, got 0"),
    (("bench", "engine", "--peer-rounds", "-1"), "--peer-rounds: must be at least 1, got -1"),
    (("bench", "engine", "--compare-batch-invariant", "-1"), "--compare-batch-invariant: must be 0 (off) or more"),
    (("bench", "engine", "--compare-rounds", "0"), "--compare-rounds: must be at least 1, got 0"),
    (("loadtest", "run", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--duration", "0"),
     "--duration: must be > 0 seconds"),
])
def test_benchmark_counts_are_checked_before_anything_runs(args, said):
    """A benchmark trial's ``--num-prompts 0`` printed a table of nan and exited 0, ``--peer-rounds 0`` crashed
    after the whole run: every count is argparse's error (exit 2) naming the flag."""
    out = _tandem(*args)
    assert out.returncode == 2 and said in out.stderr, out.stderr[-500:]


def test_a_missing_peer_or_an_unanswered_load_is_a_failure_said_first(tmp_path):
    """A peer's missing interpreter is said before the Tandem run (it was said after minutes of it), LiteLLM's as
    vLLM's and llama.cpp's (a traceback before), an unknown ``--modes`` is refused, and a load test no request of
    which was answered exits 1 (it exited 0)."""
    out = _tandem("bench", "engine", "--peer", "vllm", "--peer-python", str(tmp_path / "none" / "python"),
                  "--num-prompts", "1")
    assert out.returncode == 1 and "no vLLM interpreter at" in out.stderr and "output tok/s" not in out.stdout
    out = _tandem("loadtest", "overhead", "--peer-litellm", str(tmp_path / "none" / "python"))
    assert out.returncode == 2 and "--peer-litellm: no Python at" in out.stderr and "Traceback" not in out.stderr
    out = _tandem("loadtest", "overhead", "--modes", "bogus")
    assert out.returncode == 2 and "--modes: non-stream, stream or both" in out.stderr
    from tests.conftest import free_port
    out = _tandem("loadtest", "run", "--url", f"http://127.0.0.1:{free_port()}/v1", "--model", "m",
                  "--num-requests", "2", "--no-progress", "--out", str(tmp_path / "out"))
    assert out.returncode == 1 and "no request was answered" in out.stderr, out.stderr[-500:]


def test_a_peers_failure_is_shown_by_its_end():
    """A trial's vLLM failure showed the first 500 characters of its stderr's last 2000: the exception line, last,
    was cut off."""
    from loadtests.bench.engine_throughput import _tail

    why = "Traceback ...\n" + "x" * 3000 + "\nOSError: Repo id must be in the form 'repo_name'"
    assert _tail(why, 200).endswith("OSError: Repo id must be in the form 'repo_name'") and len(_tail(why, 200)) == 203
    assert _tail("short", 200) == "short"
