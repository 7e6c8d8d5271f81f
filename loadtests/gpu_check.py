"""GPU check: everything worth measuring on a lent CUDA machine, in one run.

    loadtests/gpu_check.sh [OUT_DIR]              # what to run on the GPU box
    python -m loadtests.gpu_check --out DIR       # the module it runs

Made for a bare machine (Python with its own torch and triton, no network,
no model files): the models are random weights of real shapes
(``load_format="dummy"``), and the pure-Python packages it lacks come as
wheels from ``.gpu-wheels/`` (``make gpu-wheels``). Parts, each timed and
recorded even when another fails:

1. kernels: the Triton kernels against the float64 reference and
   ``loadtests/bench/kernels_gpu.py``'s decode timings (bandwidth vs copy bandwidth, vs SDPA).
2. parity: the engine on the Triton backend vs transformers on a tiny random
   Llama, float32 greedy, token-identical (a divergence at a top-2 logit gap
   below 1e-3 is reported as a near-tie, not a failure).
3. batch invariance: on the Triton path, greedy tokens and logprobs of 8
   prompts alone, batched and from the prefix cache are bitwise equal
   (bfloat16, SmolLM2-135M's shape), and output tok/s with the mode on/off.
4. tensor parallelism (``loadtests/gpu_check_tp.py``): a world of one rank
   over NCCL (collectives, and logits bitwise those without the group); with
   two GPUs, the engine at 2 ranks vs 1 (float32 tokens, bfloat16 batch
   invariance).
5. packed weights (``loadtests/gpu_check_quant.py``): the Triton GEMM that
   dequantizes 4-bit, int8 and FP8 weights in its tiles, bitwise the dense
   GEMM on the reference dequantization and row-invariant, at a Llama-3-8B
   MLP shape, with its time and bytes against the dense GEMM's.
6. throughput: the engine on random weights of SmolLM2-135M's and
   Llama-3-8B's shapes, 64 x (512 in, 128 out), ignore_eos, vs transformers
   ``generate`` on the same model in one batch of 64 (ratio of output tok/s).

Without a CUDA device it says so and runs a dry run on CPU in about a minute:
the kernels checks on tiny shapes in Triton's interpreter, parity likewise,
tensor parallelism over gloo (2 ranks), throughput on a tiny shape; ``tests/test_gpu_check.py`` runs it. Writes
``gpu_check.json`` and ``gpu_check.md`` to ``--out``; exit status 1 when a
part failed (a skipped part is not a failure).
"""

from __future__ import annotations

import os

# Triton's interpreter must be chosen before triton is imported (as tests/conftest.py).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from loadtests.gpu_check_quant import check_packed_gemm  # noqa: E402
from loadtests.gpu_check_tp import check_tensor_parallel  # noqa: E402

# Shapes from the models' config.json (HuggingFaceTB/SmolLM2-135M-Instruct, meta-llama/Meta-Llama-3-8B).
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False,
                 max_position_embeddings=256, rms_norm_eps=1e-5),
}
# Interpreter-sized kernel checks: (name, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, splits).
TINY_KERNEL_CHECKS = [
    ("decode mixed, 4/2 heads, d32, bs16", [1, 17, 40], [1, 1, 1], 4, 2, 32, 16, 1),
    ("prefill chunk + decode, 4/2 heads, d32, bs16", [30, 5], [12, 1], 4, 2, 32, 16, 1),
    ("split-KV decode, 4/2 heads, d32, bs16", [70, 9], [1, 1], 4, 2, 32, 16, 2),
]
TIE_GAP = 1e-3


@dataclass
class Part:
    """One part's outcome: status ok | failed | skipped: <why>; figures in ``results``."""

    name: str
    status: str = "pending"
    seconds: float = 0.0
    results: dict = field(default_factory=dict)
    error: str | None = None


def write_model_dir(path: Path, shape: dict) -> str:
    """An HF directory with ``config.json`` of ``shape`` (a Llama) and a
    word-level ``tokenizer.json`` of ``vocab_size`` tokens ("t0", "t1", ...),
    enough for ``load_format="dummy"``. Returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=shape["hidden_size"]
               // shape["num_attention_heads"], bos_token_id=1, eos_token_id=2, hidden_act="silu",
               torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def check_kernels(part: Part, out: Path, cuda: bool, budget_s: float) -> None:
    """Part 1: loadtests/bench/kernels_gpu.py on CUDA; on CPU its checks on tiny shapes (interpreter) and its dry run."""
    from loadtests.bench import kernels_gpu as bench

    if cuda:
        rc = bench.main(["--out", str(out / "kernels"), "--budget-s", str(budget_s)])
        data = json.loads((out / "kernels" / "kernels_bench.json").read_text())
        checks = data["checks"]
        part.results = {"checks_ok": sum(c["ok"] for c in checks), "checks": len(checks),
                        "copy_gbps": data["copy_gbps"], "report": str(out / "kernels" / "kernels_bench.md"),
                        "decode": [{k: r[k] for k in ("num_seqs", "context_len", "triton_us", "triton_frac_copy",
                                                      "sdpa_us", "status")} for r in data["decode"]]}
        part.status = "ok" if rc == 0 else "failed"
        return
    checks = bench.run_checks(torch.device("cpu"), TINY_KERNEL_CHECKS, dtypes=(torch.float16,))
    bench.main(["--out", str(out / "kernels"), "--dry-run"])
    part.results = {"checks_ok": sum(c["ok"] for c in checks), "checks": len(checks),
                    "note": "no CUDA device: tiny shapes, float16 only (the interpreter miscomputes bfloat16), "
                            "bench dry run"}
    part.status = "ok" if all(c["ok"] for c in checks) else "failed"


def check_parity(part: Part, device: str, workdir: Path) -> None:
    """Part 2: engine (Triton backend, float32) vs transformers greedy on a tiny random Llama."""
    if importlib.util.find_spec("transformers") is None:
        part.status = "skipped: transformers not installed (make gpu-wheels ships it)"
        return
    import transformers

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    path = workdir / "tiny-hf"
    write_model_dir(path, SHAPES["tiny"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in SHAPES["tiny"].items()}, bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.save_pretrained(path)
    hf = hf.to(device)
    gen = torch.Generator().manual_seed(1)
    lengths, new = ((19, 3, 40, 9), 16) if device == "cuda" else ((19, 3), 4)  # the interpreter is slow
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    refs = []
    for ids in prompts:
        with torch.inference_mode():
            o = hf.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                            device=device), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
        refs.append((o.sequences[0, len(ids):].tolist(), [step[0].float().cpu() for step in o.logits]))
    del hf
    llm = LLM(model=str(path), dtype="float32", device=device, attention_backend="triton", block_size=16,
              max_num_batched_tokens=32, kv_cache_memory="16MiB", gpu_memory_utilization=0.2)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    exact = near_ties = 0
    mismatches = []
    for (ref, logits), o in zip(refs, outs):
        got = o.outputs[0].token_ids
        if got == ref:
            exact += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        top2 = torch.topk(logits[step], 2).values
        gap = float(top2[0] - top2[1])
        if gap < TIE_GAP:
            near_ties += 1
        else:
            mismatches.append({"step": step, "got": got[step], "reference": ref[step], "top2_gap": gap})
    part.results = {"prompts": len(prompts), "exact": exact, "near_ties": near_ties, "mismatches": mismatches,
                    "backend": llm.engine.model_runner.model.layers[0].backend.name}
    part.status = "ok" if not mismatches else "failed"


def check_batch_invariance(part: Part, device: str, workdir: Path) -> None:
    """Part 3: batch-invariant mode on the Triton path (Triton linears, RMSNorm
    and attention): each prompt's greedy tokens and logprobs alone, in one
    batch, and again from the prefix cache must be bitwise equal. On CUDA:
    SmolLM2-135M's shape, random weights, bfloat16, plus output tok/s with the
    mode on and off (``loadtests.bench.engine_throughput.compare_batch_invariant``); the dry run:
    the tiny shape in float32 in the interpreter."""
    from loadtests.bench.engine_throughput import compare_batch_invariant
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cuda = device == "cuda"
    shape_name, dtype = ("smollm2-135m", "bfloat16") if cuda else ("tiny", "float32")
    model_dir = write_model_dir(workdir / f"invariance-{shape_name}", SHAPES[shape_name])
    llm = LLM(model=model_dir, load_format="dummy", dtype=dtype, device=device, attention_backend="triton",
              max_model_len=512 if cuda else 128, max_num_batched_tokens=256,
              kv_cache_memory="256MiB" if cuda else "4MiB", gpu_memory_utilization=0.3, seed=0)
    vocab = SHAPES[shape_name]["vocab_size"]
    gen = torch.Generator().manual_seed(5)
    lengths, new = ((20, 45, 90, 130, 200, 260, 300, 33), 32) if cuda else ((19, 3), 4)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=1)

    def answers(outs) -> list:
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    alone = [answers(llm.generate([p], params))[0] for p in prompts]
    batched = answers(llm.generate(prompts, params))
    cached = answers(llm.generate(prompts, params))
    part.results = {"shape": shape_name, "dtype": dtype, "prompts": len(prompts), "new_tokens": new,
                    "differ_batched_vs_alone": sum(a != b for a, b in zip(alone, batched)),
                    "differ_cache_hit_vs_alone": sum(a != b for a, b in zip(alone, cached))}
    if cuda:
        engine = llm.engine
        ab_prompts = [torch.randint(3, vocab, (128,), generator=gen).tolist() for _ in range(64)]
        part.results["tok_per_s_on_off"] = compare_batch_invariant(
            engine, ab_prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), rounds=2)
    del llm
    _free(device)
    bad = part.results["differ_batched_vs_alone"] + part.results["differ_cache_hit_vs_alone"]
    part.status = "ok" if bad == 0 else "failed"


def _bench_engine(model_dir: str, device: str, n: int, input_len: int, output_len: int, seed: int) -> dict:
    from loadtests.bench.engine_throughput import bench_tandem
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16", device=device,
                                  max_model_len=input_len + output_len + 16, max_num_seqs=max(n, 8),
                                  gpu_memory_utilization=0.45, kv_cache_memory="256MiB", seed=seed))
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    warm = [torch.randint(3, vocab, (16,), generator=gen).tolist() for _ in range(2)]
    bench_tandem(engine, warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # compile kernels
    prompts = [torch.randint(3, vocab, (input_len,), generator=gen).tolist() for _ in range(n)]
    result = bench_tandem(engine, prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    del engine
    return result


def _bench_hf(shape: dict, device: str, n: int, input_len: int, output_len: int, seed: int) -> dict:
    import transformers

    cfg = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg).to(device)  # its buffers were left on meta
    ids = torch.randint(3, shape["vocab_size"], (n, input_len), generator=gen, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2, :16], max_new_tokens=4, min_new_tokens=4, **{**kw, "attention_mask": None})
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - input_len) * n
    del model, out
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed, "batch_size": n}


def check_throughput(part: Part, shape_name: str, device: str, workdir: Path, n: int, input_len: int,
                     output_len: int) -> None:
    """Part 4: engine output tok/s on random weights of ``shape_name`` vs HF generate (one batch of n)."""
    shape = SHAPES[shape_name]
    model_dir = write_model_dir(workdir / shape_name, shape)
    part.results = {"shape": shape_name, "workload": f"{n} x ({input_len} in, {output_len} out)", "dtype": "bfloat16"}
    t = _bench_engine(model_dir, device, n, input_len, output_len, seed=0)
    part.results["tandem"] = {k: t[k] for k in ("elapsed_s", "output_tok_per_s", "total_tok_per_s", "ttft_s",
                                                  "tpot_s", "num_preemptions")}
    _free(device)
    if importlib.util.find_spec("transformers") is None:
        part.results["hf"] = "skipped: transformers not installed"
    else:
        h = _bench_hf(shape, device, n, input_len, output_len, seed=0)
        part.results["hf"] = h
        part.results["ratio_output_tok_per_s"] = t["output_tok_per_s"] / h["output_tok_per_s"]
        _free(device)
    part.status = "ok"


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_part(part: Part, fn, *args, deadline: float | None = None) -> Part:
    """Run one part; an exception marks it failed with its traceback and the
    run goes on; past ``deadline`` (``time.perf_counter()``) it is skipped."""
    print(f"== {part.name}", flush=True)
    t0 = time.perf_counter()
    if deadline is not None and t0 > deadline:
        part.status = "skipped: time budget (--budget-s)"
        return part
    try:
        fn(part, *args)
    except Exception as e:  # a part's failure must not stop the others
        part.status = "failed"
        part.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    part.seconds = time.perf_counter() - t0
    print(f"   {part.status} in {part.seconds:.1f} s {json.dumps(part.results, default=str)[:600]}", flush=True)
    if part.error:
        print(part.error, flush=True)
    return part


def environment(cuda: bool) -> dict:
    """Versions and device of this run, and which optional packages are present."""
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name(0) if cuda else "no CUDA device (dry run on CPU)",
           "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    for pkg in ("numpy", "tokenizers", "jinja2", "safetensors", "transformers", "gguf", "msgspec"):
        env[pkg] = importlib.util.find_spec(pkg) is not None
    return env


def write_summary(out: Path, env: dict, parts: list[Part], elapsed: float) -> Path:
    """gpu_check.json and gpu_check.md in ``out``; returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"environment": env, "elapsed_s": elapsed,
                                                    "parts": [asdict(p) for p in parts]}, indent=2, default=str))
    lines = [f"# GPU check: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; {elapsed:.0f} s in all.", "",
             "| part | status | s | figures |", "|---|---|---:|---|"]
    for p in parts:
        r = p.results
        if "ratio_output_tok_per_s" in r:
            figures = (f"{r['workload']}: tandem {r['tandem']['output_tok_per_s']:.0f} out tok/s, HF "
                       f"{r['hf']['output_tok_per_s']:.0f}, ratio {r['ratio_output_tok_per_s']:.2f}x")
        elif "tandem" in r:
            figures = f"{r['workload']}: tandem {r['tandem']['output_tok_per_s']:.0f} out tok/s; HF {r.get('hf', 'not run')}"
        elif "checks" in r:
            figures = f"{r['checks_ok']}/{r['checks']} checks ok" + (
                f", copy {r['copy_gbps']:.0f} GB/s, table: {r['report']}" if r.get("copy_gbps") else "")
        elif "world_of_one" in r:
            one, two = r["world_of_one"], r.get("two_ranks")
            figures = (f"world of 1 over {one['backend']}: collectives {sum(one['collectives'].values())}/"
                       f"{len(one['collectives'])} ok, logits bitwise equal {one['logits_bitwise_equal']}; 2 ranks: "
                       + (two if isinstance(two, str) else f"fp32 tokens = 1 rank's {two['fp32_tokens_equal_tp1']}, "
                          f"bf16 batched != alone {two['bf16_differ_batched_vs_alone']}"))
        elif "exact" in r:
            figures = f"{r['exact']}/{r['prompts']} exact, {r['near_ties']} near-ties, {len(r['mismatches'])} mismatches"
        else:
            figures = ""
        lines.append(f"| {p.name} | {p.status} | {p.seconds:.0f} | {figures} |")
    for p in parts:
        if p.error:
            lines += ["", f"## {p.name} failed", "", "```", p.error.strip(), "```"]
    md = out / "gpu_check.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    """Run every part (GPU or dry run), write the summary; 1 if a part failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    p.add_argument("--kernel-budget-s", type=float, default=150.0, help="loadtests/bench/kernels_gpu.py timing budget")
    p.add_argument("--skip-8b", action="store_true", help="no Llama-3-8B-shape throughput part")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no throughput part after this many seconds (the script kills the run at 480)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    late = t0 + args.budget_s - 90  # a throughput part takes up to ~90 s
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA device: dry run on CPU (Triton's interpreter, tiny shapes)", flush=True)
    device = "cuda" if cuda else "cpu"
    env = environment(cuda)
    print(json.dumps(env), flush=True)
    parts: list[Part] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        parts.append(run_part(Part("kernels"), check_kernels, args.out, cuda, args.kernel_budget_s))
        write_summary(args.out, env, parts, time.perf_counter() - t0)
        parts.append(run_part(Part("parity (triton, fp32, tiny Llama)"), check_parity, device, work))
        parts.append(run_part(Part("batch invariance (triton path)"), check_batch_invariance, device, work))
        parts.append(run_part(Part("tensor parallel"), check_tensor_parallel, device, work, write_model_dir, SHAPES))
        parts.append(run_part(Part("packed weights (triton, 4-bit/int8/fp8)"), check_packed_gemm, device))
        write_summary(args.out, env, parts, time.perf_counter() - t0)  # a partial record if the run is killed
        if cuda:
            parts.append(run_part(Part("throughput smollm2-135m shape"), check_throughput, "smollm2-135m", device,
                                  work, 64, 512, 128, deadline=late))
            if args.skip_8b:
                parts.append(Part("throughput llama3-8b shape", status="skipped: --skip-8b"))
            else:
                parts.append(run_part(Part("throughput llama3-8b shape"), check_throughput, "llama3-8b", device,
                                      work, 64, 512, 128, deadline=late))
        else:
            parts.append(run_part(Part("throughput tiny shape (CPU)"), check_throughput, "tiny", device, work,
                                  4, 16, 8))
    md = write_summary(args.out, env, parts, time.perf_counter() - t0)
    print(md.read_text())
    print(f"wrote {md} and {md.with_suffix('.json')}")
    return 1 if any(p.status == "failed" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
