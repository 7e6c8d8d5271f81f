"""Offline throughput of vLLM on a given workload; runs inside vLLM's own virtual environment.

    <vllm venv>/bin/python loadtests/peers/vllm_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model": HF id or directory, "prompts": [[token ids], ...],
"output_len": int, "ignore_eos": bool, "dtype": "bfloat16", "max_num_seqs":
int, "max_model_len": int, "kv_cache_gib": float}. Every prompt is submitted
at once, greedy, as ``tandem bench engine`` does; one 4-token warm-up request
first. RESULT.json: {"elapsed_s", "output_tokens", "output_tok_per_s",
"startup_s", "vllm"}. Only the standard library and vllm are imported
(Tandem's packages are not installed there). Exit status 3: vllm is not
importable.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(workload_path: str, result_path: str) -> int:
    w = json.loads(open(workload_path).read())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(w.get("kv_cache_gib", 1)))
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        print(f"vllm is not importable in {sys.executable}: {e}", file=sys.stderr)
        return 3
    llm = LLM(model=w["model"], dtype=w.get("dtype", "bfloat16"), max_num_seqs=w.get("max_num_seqs", 256),
              max_model_len=w.get("max_model_len", 2048), seed=0)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids in w["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=w["output_len"], ignore_eos=w.get("ignore_eos", False))
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
              "startup_s": startup, "vllm": vllm.__version__}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
