"""``tandem bench engine --compare-model PATH``: the engine on another model file of the same shape
(another quantization format: a W4A16 checkpoint against the GGUF Q4_1 it was made from), interleaved
with the engine under test on the same prompts, in one process; and ``make_w4a16``, which writes that
checkpoint from the embedded model.

Each round runs both engines on the round's prompts (their first token shifted by the round, so no run
reads an earlier run's prefix cache), alternating which goes first; single stream (``--compare-single-
stream``: the prompts one at a time) or all at once.

    python -m loadtests.bench.model_compare OUT_DIR [--group 64]   # the W4A16 checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine.arg_values import flag_type, positive_count
from engine.sampling_params import SamplingParams
from loadtests.bench.spec_decode import run_prompts


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``--compare-model``."""
    parser.add_argument("--compare-model", default=None,
                        help="also run the engine on this model (same shape, another format), interleaved")
    parser.add_argument("--compare-quantization", default="none",
                        help="--quantization of the --compare-model engine (gguf for a GGUF kept in 4 bits)")
    parser.add_argument("--compare-rounds", type=flag_type(positive_count), default=3,
                        help="rounds of (this engine, the other)")
    parser.add_argument("--compare-single-stream", action="store_true",
                        help="--compare-model runs the prompts one at a time instead of all at once")


def compare_models(engine, args, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Output tok/s of ``engine`` and of an engine on ``args.compare_model``, interleaved.

    Returns:
        {"this": [tok/s per round], "other": [...], "ratio_this_other": median(this) / median(other),
        "round_ratios": [this / other per round: paired, so steadier on a shared box], "single_stream": bool,
        "other_model": path}.
    """
    from engine.llm_engine import LLMEngine

    other = LLMEngine(dataclasses.replace(engine.args, model=args.compare_model,
                                          quantization=args.compare_quantization))
    vocab = engine.model_config.vocab_size
    runs: dict[str, list[float]] = {"this": [], "other": []}
    for r in range(args.compare_rounds):
        order = (("this", engine), ("other", other)) if r % 2 == 0 else (("other", other), ("this", engine))
        for label, eng in order:
            salted = [[(p[0] + 1 + r) % vocab] + p[1:] for p in prompts]
            n, dt = run_prompts(eng, salted, params, args.compare_single_stream, f"compare-{label}-{r}")
            runs[label].append(n / dt)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {**runs, "ratio_this_other": med(runs["this"]) / med(runs["other"]),
            "round_ratios": [t / o for t, o in zip(runs["this"], runs["other"])],
            "single_stream": args.compare_single_stream, "other_model": args.compare_model}


def make_w4a16(out_dir: Path, group: int, gguf: Path | None = None) -> Path:
    """A compressed-tensors ``pack-quantized`` W4A16 checkpoint (symmetric, groups of ``group`` inputs,
    the head left dense as llm-compressor's recipes ``ignore`` it) of the embedded model's GGUF (or
    ``gguf``), dequantized to float32 by transformers first, written by tests/quant_checkpoints.py's
    packer (the format's documented layout); tokenizer and chat template from the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import default_model_path
    from tests.quant_checkpoints import write_compressed_tensors

    gguf = gguf or Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_compressed_tensors(out_dir, model, group, sym=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the W4A16 checkpoint of the embedded model")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--group", type=int, default=64, help="inputs per group (SmolLM2's 576 take 32, 64, 192)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (None: the embedded default model)")
    args = parser.parse_args(argv)
    print(make_w4a16(args.out_dir, args.group, args.gguf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
