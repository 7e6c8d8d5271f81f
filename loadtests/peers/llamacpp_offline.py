"""Offline throughput of llama.cpp (llama-cpp-python) on a given workload; runs inside its own virtual environment.

    <llama-cpp-python venv>/bin/python loadtests/peers/llamacpp_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model": a .gguf file, "prompts": [[token ids], ...],
"output_len": int, "ignore_eos": bool (default true), "n_threads": int,
"n_ctx": int, "prompt_lookup": optional {"num_pred_tokens": int,
"max_ngram_size": int}}. llama-cpp-python's ``Llama`` runs one sequence at
a time, so the prompts run one after another (a single stream is
llama.cpp's own case; more prompts are that stream repeated). Each prompt's
token ids go in as they are (no tokenization, no BOS added), from an empty
KV cache (no prefix reuse between prompts), and ``output_len`` tokens come
out greedily (``top_k=1``, no penalties), fewer where EOS comes first unless
``ignore_eos``. With ``prompt_lookup``, llama-cpp-python's prompt-lookup
speculation (``LlamaPromptLookupDecoding``: the continuation of the last
1..max_ngram_size tokens' first earlier occurrence, num_pred_tokens of them,
verified in one batch; it makes ``Llama`` keep every position's logits).
One 4-token warm-up generation first. ``n_threads`` is both the decode and
the batch (prefill) thread count.

RESULT.json: {"elapsed_s", "output_tokens", "output_tok_per_s", "prefill_s"
(prompt evaluation up to each first token, summed), "decode_s" (the rest),
"decode_tok_per_s" (tokens after the first per decode second), "startup_s",
"n_threads", "llama_cpp"}. Only the standard library and llama_cpp are
imported (Tandem's packages are not installed there). Exit status 3:
llama_cpp is not importable.
"""

from __future__ import annotations

import json
import sys
import time

GREEDY = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "temp": 0.0, "repeat_penalty": 1.0}


def generate(llm, prompt: list[int], n: int, ignore_eos: bool = True) -> tuple[float, float, int]:
    """Generate ``n`` tokens after ``prompt`` from an empty cache (fewer at EOS unless ``ignore_eos``);
    (prefill s, decode s, tokens)."""
    llm.reset()                                   # no prefix reuse: eval() drops the cache from position 0
    start = time.perf_counter()
    first = start
    eos = llm.token_eos()
    count = 0
    for i, token in enumerate(llm.generate(prompt, reset=True, **GREEDY)):
        count = i + 1
        if i == 0:
            first = time.perf_counter()
        if count == n or (token == eos and not ignore_eos):
            break
    end = time.perf_counter()
    return first - start, end - first, count


def main(workload_path: str, result_path: str) -> int:
    w = json.loads(open(workload_path).read())
    t0 = time.perf_counter()
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama_cpp is not importable in {sys.executable}: {e}", file=sys.stderr)
        return 3
    draft = None
    if w.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(**w["prompt_lookup"])
    llm = llama_cpp.Llama(model_path=w["model"], n_ctx=w["n_ctx"], n_batch=min(w["n_ctx"], 2048),
                          n_threads=w["n_threads"], n_threads_batch=w["n_threads"], seed=0, verbose=False,
                          draft_model=draft)
    startup = time.perf_counter() - t0
    generate(llm, w["prompts"][0], 4)
    n = w["output_len"]
    prefill = decode = 0.0
    tokens = 0
    for prompt in w["prompts"]:
        p, d, count = generate(llm, prompt, n, w.get("ignore_eos", True))
        prefill, decode, tokens = prefill + p, decode + d, tokens + count
    elapsed = prefill + decode
    result = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
              "prefill_s": prefill, "decode_s": decode,
              "decode_tok_per_s": (tokens - len(w["prompts"])) / decode if decode else float("nan"),
              "startup_s": startup, "n_threads": w["n_threads"], "llama_cpp": llama_cpp.__version__,
              "prompt_lookup": w.get("prompt_lookup")}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
