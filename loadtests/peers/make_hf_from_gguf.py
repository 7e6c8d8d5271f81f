"""A Hugging Face model directory made from a GGUF file, so that a peer that reads only HF checkpoints (vLLM)
loads the very weights Tandem serves: the embedded SmolLM2-135M-Instruct Q4_1 GGUF, dequantized.

    python -m loadtests.peers.make_hf_from_gguf OUT_DIR [--gguf FILE] [--dtype bfloat16]

Runs in Tandem's own environment (transformers and gguf are its dependencies; no network). transformers
dequantizes the GGUF's blocks (``from_pretrained(..., gguf_file=...)``, gguf-py's dequantizers) and builds
the tokenizer and chat template from the GGUF's metadata; the model is written as safetensors in ``--dtype``
(Q4_1 values are ``d * q + m`` with float16 ``d``, ``m``: bfloat16 rounds them, float32 keeps them exact).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def make_hf_dir(gguf_path: Path, out_dir: Path, dtype: str) -> Path:
    """Write ``gguf_path``'s model, tokenizer and chat template to ``out_dir`` as an HF directory.

    Returns:
        ``out_dir``, holding ``config.json``, ``model.safetensors``, the tokenizer files and
        ``generation_config.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dtype))
    # The weights are dequantized dense tensors now; only the label says "gguf" (and blocks saving).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from engine.config import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory to write (created)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (None: the embedded default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = parser.parse_args(argv)
    out = make_hf_dir(args.gguf or Path(default_model_path()), args.out_dir, args.dtype)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
