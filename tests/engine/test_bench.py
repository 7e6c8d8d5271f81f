"""``tandem bench engine``: its peer tooling (``--peer vllm``, ``--peer llamacpp``) never installs
anything and says why a peer was skipped; a run on a tiny model fills its JSON. No test needs a peer
installed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from loadtests.bench.engine_throughput import _hf_baseline_missing, _peer_rows, add_bench_args, engine_threads
from loadtests.bench.engine_throughput import run_bench
from loadtests.bench.peer_engines import PEERS, ROOT, peer_command, peer_model, peer_python, peer_workload, run_peer
from loadtests.bench.peer_engines import salted, summarize
from engine.config import add_engine_cli_args
from tests.tiny_models import save_byte_level_llama


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    add_engine_cli_args(p)
    return p.parse_args(list(argv))


def test_the_peer_gets_the_engines_threads_of_a_quiet_machine():
    """Not the count the engine's last step took under load (engine/worker/cpu_threads.py): the most it takes,
    or --num-threads."""
    import torch

    from engine.worker.cpu_threads import LoadFollowingThreads

    following = LoadFollowingThreads(3, {0, 1, 2}, set_threads=lambda n: None)
    following.threads = 1
    engine = argparse.Namespace(model_runner=argparse.Namespace(cpu_threads=following))
    assert engine_threads(engine, _args()) == 3
    assert engine_threads(engine, _args("--num-threads", "2")) == 2
    fixed = argparse.Namespace(model_runner=argparse.Namespace(cpu_threads=None))
    assert engine_threads(fixed, _args()) == torch.get_num_threads()


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peer_without_its_interpreter_is_skipped(tmp_path, name):
    workload = peer_workload(PEERS[name], "m.gguf", [[1, 2, 3]], 4, True, 2)
    result = run_peer(PEERS[name], tmp_path / "nope" / "python", workload)
    assert "interpreter at" in result["skipped"] and PEERS[name].python_env in result["skipped"]


@pytest.mark.parametrize("name, package", [("vllm", "vllm"), ("llamacpp", "llama_cpp")])
def test_peer_without_its_package_installed_is_skipped(name, package):
    """This venv's python runs the peer's script, which finds no peer package (exit 3)."""
    workload = peer_workload(PEERS[name], "m.gguf", [[1, 2, 3]], 4, True, 2)
    result = run_peer(PEERS[name], Path(sys.executable), workload, timeout_s=120)
    assert f"{package} is not importable" in result["skipped"], result


def test_llamacpp_workload_and_command_line(tmp_path):
    """llama.cpp gets the prompt token ids as they are, the output length, Tandem's thread count and a context
    that holds the longest prompt and its output; its script runs under the peer's interpreter."""
    peer = PEERS["llamacpp"]
    w = peer_workload(peer, "/m/model.gguf", [[5, 6, 7], [8] * 100], 128, True, 3)
    assert w == {"model": "/m/model.gguf", "prompts": [[5, 6, 7], [8] * 100], "output_len": 128, "ignore_eos": True,
                 "n_threads": 3, "n_ctx": 244}
    cmd = peer_command(peer, Path("/venv/bin/python"), tmp_path / "w.json", tmp_path / "r.json")
    assert cmd == ["/venv/bin/python", str(ROOT / "loadtests/peers/llamacpp_offline.py"), str(tmp_path / "w.json"),
                   str(tmp_path / "r.json")]
    assert Path(cmd[1]).is_file()


def test_peer_interpreter_and_model_resolution(monkeypatch):
    peer = PEERS["llamacpp"]
    monkeypatch.delenv(peer.python_env, raising=False)
    assert peer_python(peer, None) == ROOT / ".venv-llamacpp/bin/python"
    monkeypatch.setenv(peer.python_env, "/env/python")
    assert peer_python(peer, None) == Path("/env/python")
    assert peer_python(peer, "/flag/python") == Path("/flag/python")
    assert peer_model(peer, None, "/m/SmolLM2.gguf", True) == "/m/SmolLM2.gguf"
    with pytest.raises(ValueError, match="--peer-model"):
        peer_model(peer, None, "/m/hf-directory", False)
    assert peer_model(PEERS["vllm"], None, "/m/SmolLM2.gguf", True) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert peer_model(PEERS["vllm"], None, "/m/hf-directory", False) == "/m/hf-directory"


def test_rounds_salt_prompts_and_ratios_use_medians():
    assert salted([[1, 2], [9, 3]], 0, 10) == [[1, 2], [9, 3]]
    assert salted([[1, 2], [9, 3]], 2, 10) == [[3, 2], [1, 3]]
    runs = [{"output_tok_per_s": 100.0}, {"output_tok_per_s": 50.0}, {"output_tok_per_s": 80.0}]
    s = summarize([120.0, 90.0, 60.0], runs)
    assert s["round_ratios"] == [1.2, 1.8, 0.75] and s["ratio"] == 90.0 / 80.0
    assert summarize([120.0], [{"failed": "exit 1"}]) == {}


def test_peer_table_rows_from_a_llamacpp_result():
    """The rows printed from the runner's JSON (the keys ``llamacpp_offline.py`` writes) and Tandem's rounds."""
    from rich.table import Table

    runs = [{"output_tok_per_s": 100.0, "prefill_s": 0.25, "decode_tok_per_s": 110.0, "llama_cpp": "0.3.36"},
            {"output_tok_per_s": 80.0, "prefill_s": 0.5, "decode_tok_per_s": 90.0, "llama_cpp": "0.3.36"}]
    tandem_runs = [{"output_tok_per_s": x, "ttft_s": {50: 0.1}, "tpot_s": {50: 0.008}} for x in (120.0, 120.0)]
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    _peer_rows(table, "llamacpp", {"tandem_output_tok_per_s": [120.0, 120.0], "tandem_runs": tandem_runs,
                                   "runs": runs, "threads": 2, "read_gb_per_s": [25.0, 20.0],
                                   "read_at_weights_gb_per_s": [50.0, 40.0],
                                   **summarize([120.0, 120.0], runs)}, weight_bytes=100_000_000)
    rows = dict(zip(table.columns[0]._cells, table.columns[1]._cells))
    assert rows["llama.cpp 0.3.36 output tok/s, interleaved"] == "100.0, 80.0"
    assert rows["llama.cpp prefill s / decode tok/s, per round"] == "0.250 / 110.0, 0.500 / 90.0"
    assert rows["Tandem TTFT p50 s / TPOT p50 ms, per round"] == "0.100 / 8.0, 0.100 / 8.0"
    assert rows["ratio tandem / llama.cpp per round"] == "1.20x, 1.50x"
    assert rows["ratio tandem / llama.cpp (medians, 2 threads)"] == "1.33x"
    # the roofline: 100 MB at 25 and 20 GB/s is 4 and 5 ms; a TPOT of 8 ms is 2x and 1.6x it
    assert rows["read GB/s (sum of 512 MiB) / roofline ms (100.0 MB of weights), per round"] == "25.0 / 4.00, 20.0 / 5.00"
    assert rows["Tandem TPOT p50 / roofline (sum of 512 MiB), per round"] == "2.00x, 1.60x"
    # and at the weights' size (95 MiB), which a large last-level cache may hold: 2 and 2.5 ms
    assert rows["read GB/s (sum of 95 MiB, the weights' size) / roofline ms (100.0 MB of weights), per round"] == \
        "50.0 / 2.00, 40.0 / 2.50"
    assert rows["Tandem TPOT p50 / roofline (sum of 95 MiB, the weights' size), per round"] == "4.00x, 3.20x"
    assert rows["Tandem decode tok/s (1 / TPOT p50) / llama.cpp's, per round"] == "1.14x, 1.39x"
    # a read slowed by other load puts the floor above the step: said so (a trial's 0.62x had no word)
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    _peer_rows(table, "llamacpp", {"tandem_output_tok_per_s": [120.0], "tandem_runs": tandem_runs[:1], "runs": runs[:1],
                                   "threads": 2, "read_gb_per_s": [5.0], **summarize([120.0], runs[:1])},
               weight_bytes=100_000_000)
    rows = dict(zip(table.columns[0]._cells, table.columns[1]._cells))
    assert rows["Tandem TPOT p50 / roofline (sum of 512 MiB), per round"].startswith("0.40x (below 1: faster than")


def test_bench_engine_on_a_tiny_model(tmp_path, capsys):
    model = save_byte_level_llama(tmp_path)
    out = tmp_path / "r.json"
    base = ("--model", model, "--num-prompts", "3", "--input-len", "8", "--output-len", "5", "--ignore-eos",
            "--no-baseline", "--kv-cache-memory", "8MiB", "--output-json", str(out))
    # a comparison asked for that cannot be made: said and failed before the Tandem run (a trial waited minutes)
    assert run_bench(_args(*base, "--peer", "vllm", "--peer-python", str(tmp_path / "missing"))) == 1
    assert not out.exists() and "--peer vllm: no vLLM interpreter at" in capsys.readouterr().err
    assert run_bench(_args(*base)) == 0
    result = json.loads(out.read_text())
    assert result["tandem"]["output_tokens"] == 15
    # the tiny model runs on the C stack from bfloat16 panels of 64 output columns: per layer q/k/v 128 x 64,
    # o 64 x 64, gate/up 256 x 64, down 64 x 128 and two norms of 64; the final norm; the head's 258 rows
    # padded to 320; one embedding row
    layer = (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128 + 2 * 64) * 2
    assert result["roofline"]["weight_bytes"] == 2 * layer + 64 * 2 + 320 * 64 * 2 + 64 * 2
    assert result["roofline"]["read_gb_per_s"][0] > 0 and result["roofline"]["read_at_weights_gb_per_s"][0] > 0
    assert "ratio_vs_vllm" not in result and "output tok/s" in capsys.readouterr().out


def test_bench_engine_llamacpp_peer_runs_its_script_and_reports_it_skipped(tmp_path, capsys):
    """--peer llamacpp on an HF-directory model needs --peer-model; given one, Tandem runs a round and the peer
    script runs under the given interpreter (this venv: no llama_cpp), and the table says why it was skipped."""
    model = save_byte_level_llama(tmp_path)
    base = ["--model", model, "--num-prompts", "1", "--input-len", "8", "--output-len", "5", "--ignore-eos",
            "--no-baseline", "--kv-cache-memory", "8MiB", "--peer", "llamacpp", "--peer-rounds", "2"]
    out = tmp_path / "r.json"
    assert run_bench(_args(*base, "--output-json", str(out), "--peer-python", sys.executable)) == 1
    assert "--peer-model" in json.loads(out.read_text())["llamacpp"]["skipped"]
    assert run_bench(_args(*base, "--output-json", str(out), "--peer-python", sys.executable,
                           "--peer-model", str(tmp_path / "m.gguf"))) == 1
    result = json.loads(out.read_text())
    assert "llama_cpp is not importable" in result["llamacpp"]["skipped"] and "ratio_vs_llamacpp" not in result
    assert "llama_cpp is not importable" in capsys.readouterr().out


def test_hf_baseline_of_a_gguf_without_accelerate_is_skipped_with_the_reason(monkeypatch):
    """`make serve`'s install has no accelerate, which transformers needs to read a GGUF: the baseline is skipped
    with the reason (the fresh-user trial got a traceback instead of Tandem's figures)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    assert _hf_baseline_missing("/models/m.gguf") == ""          # this venv has accelerate
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    assert "accelerate" in _hf_baseline_missing("/models/m.gguf")
    assert _hf_baseline_missing("/models/hf-dir") == ""           # HF directories load without it


def test_a_baseline_transformers_cannot_load_is_skipped_and_the_run_kept(tmp_path, capsys, monkeypatch):
    """A trial's GPTQ directory: the engine's run finished, then transformers' load raised ImportError (it needs
    optimum for GPTQ, compressed-tensors for its format), and the run's table and JSON were lost to a traceback.
    The baseline is skipped with transformers' reason and the engine's figures kept."""
    import loadtests.bench.engine_throughput as bench

    def unloadable(*args, **kw):
        raise ImportError("Loading a GPTQ quantized model requires optimum (`pip install optimum`)")

    monkeypatch.setattr(bench, "bench_hf", unloadable)
    model = save_byte_level_llama(tmp_path)
    out = tmp_path / "r.json"
    args = _args("--model", model, "--num-prompts", "2", "--input-len", "8", "--output-len", "5", "--ignore-eos",
                 "--kv-cache-memory", "8MiB", "--output-json", str(out))
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["tandem"]["output_tokens"] == 10 and "hf_transformers" not in result
    printed = " ".join(capsys.readouterr().out.replace("│", " ").split())   # the table's cells, unwrapped
    assert "skipped: transformers cannot load this checkpoint here (Loading a GPTQ" in printed


def test_bench_engine_compare_model_runs_both_engines_interleaved(tmp_path, capsys):
    """--compare-model: the second engine (another file of the model) runs the same prompts in each round,
    single stream here; the table and JSON carry each round's figures and the ratio of the medians."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = save_byte_level_llama(tmp_path / "a"), save_byte_level_llama(tmp_path / "b")
    out = tmp_path / "r.json"
    args = _args("--model", a, "--num-prompts", "2", "--input-len", "8", "--output-len", "5", "--ignore-eos",
                 "--no-baseline", "--kv-cache-memory", "8MiB", "--output-json", str(out), "--compare-model", b,
                 "--compare-rounds", "2", "--compare-single-stream")
    assert run_bench(args) == 0
    ab = json.loads(out.read_text())["model_ab"]
    assert len(ab["this"]) == len(ab["other"]) == 2 and ab["single_stream"] and ab["other_model"] == b
    assert ab["ratio_this_other"] > 0 and len(ab["round_ratios"]) == 2
    assert "ratio this / other (medians)" in capsys.readouterr().out


def test_bench_engine_compare_tensor_parallel_reports_both_engines_and_each_rank(tmp_path, capsys):
    """--compare-tensor-parallel 2: the split engine (two real ranks) runs the same prompts in each round; the
    JSON has each round's figures, the ratio of the medians and each rank's memory, the split engine's ranks
    each holding less than the whole model's weights and a KV pool of their own."""
    import statistics

    model = save_byte_level_llama(tmp_path)
    out = tmp_path / "r.json"
    args = _args("--model", model, "--num-prompts", "2", "--input-len", "8", "--output-len", "5", "--ignore-eos",
                 "--no-baseline", "--kv-cache-memory", "8MiB", "--output-json", str(out),
                 "--compare-tensor-parallel", "2", "--tp-rounds", "2")
    assert run_bench(args) == 0
    ab = json.loads(out.read_text())["tensor_parallel_ab"]
    assert len(ab["tp1"]) == len(ab["tp2"]) == 2
    assert ab["ratio"] == pytest.approx(statistics.median(ab["tp2"]) / statistics.median(ab["tp1"]))
    (whole,), ranks = ab["memory"]["tp1"], ab["memory"]["tp2"]
    assert [m["rank"] for m in ranks] == [0, 1]
    assert all(0 < m["weight_bytes"] < whole["weight_bytes"] and m["kv_bytes"] > 0 for m in ranks)
    printed = capsys.readouterr().out
    assert "ratio 2 ranks / 1 (medians)" in printed and "rank 1 of 2: weights / resident / KV pool" in printed


def test_collective_latency_times_the_engines_all_reduce_between_two_processes():
    """python -m loadtests.bench.collective_latency: two processes join as the engine's ranks do and time
    all-reduces of each size asked for."""
    from loadtests.bench.collective_latency import measure

    result = measure(argparse.Namespace(world_size=2, hidden=64, rows=[1, 8], iters=20, threads=1))
    assert set(result["us_per_all_reduce"]) == {1, 8}
    assert all(us > 0 for us in result["us_per_all_reduce"].values())
