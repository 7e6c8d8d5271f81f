"""Reports: results as JSON, a markdown summary, and PNG plots (matplotlib, Agg).

Files written into an output directory:
``results.json`` (config + summaries + scenario figures), ``summary.md``,
``latency_cdf.png`` (end-to-end and TTFT CDFs of each run) and, for a sweep,
``concurrency_sweep.png`` (throughput and p99 latency against concurrency).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from loadtests.runner import RunResult
from loadtests.stats import summarize


def run_record(run: RunResult) -> dict:
    """JSON-ready record of a run: its config and summary."""
    cfg = dataclasses.asdict(run.config)
    cfg["headers"] = {k: ("***" if k.lower() == "authorization" else v) for k, v in cfg["headers"].items()}
    return {"label": run.config.label, "config": cfg, "summary": summarize(run.results, run.t_start, run.t_end)}


def write_json(path: str | Path, obj) -> Path:
    """Write ``obj`` as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def _ms(p: dict | None, key: str) -> str:
    return "-" if not p else f"{p[key] * 1e3:.2f}"


def runs_table(records: list[dict]) -> str:
    """Markdown table of run summaries: counts, throughput and latency percentiles (ms)."""
    head = ("| run | requests | ok | errors | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | "
            "E2E p50 | E2E p90 | E2E p95 | E2E p99 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        s = rec["summary"]
        lines.append(f"| {rec['label']} | {s['num_requests']} | {s['num_ok']} | {s['num_errors']} | "
                     f"{s['requests_per_s']:,.1f} | {s['output_tokens_per_s']:,.1f} | {_ms(s['ttft_s'], 'p50')} | "
                     f"{_ms(s['ttft_s'], 'p99')} | {_ms(s['tpot_s'], 'p50')} | {_ms(s['itl_s'], 'p50')} | "
                     f"{_ms(s['e2e_s'], 'p50')} | {_ms(s['e2e_s'], 'p90')} | {_ms(s['e2e_s'], 'p95')} | "
                     f"{_ms(s['e2e_s'], 'p99')} |")
    errs = {rec["label"]: rec["summary"]["errors_by_kind"] for rec in records if rec["summary"]["errors_by_kind"]}
    if errs:
        lines.append("")
        lines.append("Errors by kind: " + "; ".join(f"{k}: {v}" for k, v in errs.items()))
    return "\n".join(lines)


def plot_latency_cdf(runs: list[RunResult], path: str | Path) -> Path:
    """CDF of end-to-end latency (and TTFT where streamed) of each run, ms, log x."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ok = [r for r in run.results if r.ok]
        for name, vals in (("e2e", [r.e2e for r in ok]), ("TTFT", [r.ttft for r in ok if r.ttft is not None])):
            if not vals:
                continue
            x = np.sort(np.asarray(vals)) * 1e3
            y = np.arange(1, x.size + 1) / x.size
            ax.step(x, y, where="post", label=f"{run.config.label or 'run'} {name}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_sweep(series: dict[str, list[tuple[int, dict]]], path: str | Path,
               throughput_key: str = "requests_per_s") -> Path:
    """Throughput (left) and p99 end-to-end latency (right) against concurrency.

    Args:
        series: name -> [(concurrency, summary dict)], one line per name.
        throughput_key: ``requests_per_s`` or ``output_tokens_per_s``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in series.items():
        points = sorted(points, key=lambda p: p[0])
        xs = [c for c, _ in points]
        ax1.plot(xs, [s[throughput_key] for _, s in points], marker="o", label=name)
        ax2.plot(xs, [(s["e2e_s"] or {}).get("p99", float("nan")) * 1e3 for _, s in points], marker="o", label=name)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel(throughput_key.replace("_per_s", "/s").replace("_", " "))
    ax1.set_title("Throughput")
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("p99 end-to-end latency (ms)")
    ax2.set_title("p99 latency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def write_report(out_dir: str | Path, title: str, runs: list[RunResult], extra: dict | None = None,
                 extra_md: str = "", sweep: dict[str, list[tuple[int, dict]]] | None = None,
                 sweep_key: str = "requests_per_s") -> dict[str, Path]:
    """Write ``results.json``, ``summary.md``, ``latency_cdf.png`` (and
    ``concurrency_sweep.png`` for a sweep) into ``out_dir``.

    Returns:
        name -> path of each file written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [run_record(r) for r in runs]
    files = {"json": write_json(out / "results.json", {"title": title, "runs": records, **(extra or {})})}
    md = f"# {title}\n\n"
    if extra_md:
        md += extra_md.rstrip() + "\n\n"
    md += runs_table(records) + "\n\nLatencies in ms. TTFT/TPOT/ITL only for streamed runs.\n"
    (out / "summary.md").write_text(md)
    files["markdown"] = out / "summary.md"
    if runs:
        files["cdf"] = plot_latency_cdf(runs, out / "latency_cdf.png")
    if sweep:
        files["sweep"] = plot_sweep(sweep, out / "concurrency_sweep.png", sweep_key)
    return files


def _save(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG (creating folders) and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
