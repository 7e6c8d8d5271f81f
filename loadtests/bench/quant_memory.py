"""Resident memory and load time of each quantized checkpoint format
(``docs/engine/quantization.md``): ``python -m loadtests.bench.quant_memory``.

A random Llama (default: hidden 1024, intermediate 2816, 8 layers, vocabulary
1024, tied embeddings: 90 M projection weights, little else) is written once
per format by ``tests/quant_checkpoints.py`` (GPTQ asymmetric, GPTQ with
act-order, AWQ, compressed-tensors W4A16, all in groups of 128, and FP8 per
channel) and once dense; each is then loaded by the engine in bfloat16 on CPU
in a fresh process (``engine.model_loader.load_model`` and the packing the
model runner does, ``prepack_weights``). Reported per format:

* checkpoint: bytes of the projections' tensors in the checkpoint file
  (codes, scales, zero points, g_idx), i.e. the packed size;
* held: the bytes the engine's packed projections hold (their ``nbytes``);
* resident: the process's RSS after a second load minus before it (a first
  load, freed, has imported what loading needs and built the kernels),
  minus the other parameters' bytes (embedding, norms, the head's panels),
  after ``malloc_trim``;
* load time: the second ``load_model`` plus the packing, seconds of wall
  clock and of the process's CPU (the box is shared: CPU seconds compare
  better from run to run).

The load average is printed with the figures (the box is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FORMATS = ("gptq", "gptq_desc_act", "awq", "w4a16", "fp8", "dense")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_checkpoint(path: Path, fmt: str, hidden: int, intermediate: int, layers: int, group: int) -> None:
    """A random float32 Llama saved at ``path`` in ``fmt`` (tests/quant_checkpoints.py's writers)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.quant_checkpoints import write_awq, write_compressed_tensors, write_fp8, write_gptq

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                   num_key_value_heads=hidden // 256, tie_word_embeddings=True,
                                   max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    path.mkdir(parents=True, exist_ok=True)
    writers = {"gptq": lambda: write_gptq(path, model, group, sym=False),
               "gptq_desc_act": lambda: write_gptq(path, model, group, sym=False, desc_act=True),
               "awq": lambda: write_awq(path, model, group),
               "w4a16": lambda: write_compressed_tensors(path, model, group, sym=True),
               "fp8": lambda: write_fp8(path, model, "channel"),
               "dense": lambda: model.save_pretrained(path)}
    writers[fmt]()
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(1024)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def checkpoint_projection_bytes(path: Path) -> int:
    """Bytes of the decoder layers' projection tensors in ``path``'s safetensors."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if ".layers." in name and ("_proj." in name):
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


def measure(path: Path) -> dict:
    """In this (fresh) process: the engine's load of ``path`` in bfloat16 on CPU, as the docstring says."""
    import gc
    import time

    import torch

    from engine.config import EngineArgs
    from engine.model_loader import load_model, release_freed_memory
    from kernels.cpu_build import load_library

    load_library()

    def load():
        model, _, _ = load_model(EngineArgs(model=str(path), dtype="bfloat16", device="cpu"))
        model.prepack_weights()
        return model

    del_model = load()  # a first load imports what loading needs and warms the kernels; its memory is freed
    del del_model
    gc.collect()
    release_freed_memory()
    before = _rss()
    t0, c0 = time.perf_counter(), time.process_time()
    model = load()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    gc.collect()
    release_freed_memory()
    after = _rss()
    held = sum(q.nbytes for layer in model.layers for q in layer.int4.values())
    held += sum(layer.packed.get(name, getattr(layer, name).weight).nbytes
                for layer in model.layers for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                if name not in layer.int4)
    proj = {f"layers.{i}.{n}." for i in range(len(model.layers)) for n in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj")}
    other = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if not any(name.startswith(x) for x in proj))
    head = model.packed.get("lm_head", model.embed_tokens.weight)
    other += head.nbytes if head is not None and head is not model.embed_tokens.weight else 0
    return {"held": held, "resident": after - before - other, "other": other, "load_s": seconds,
            "load_cpu_s": cpu_seconds,
            "weights": sum(layer.qkv_proj.in_features * layer.qkv_proj.out_features + layer.o_proj.in_features
                           * layer.o_proj.out_features + layer.gate_up_proj.in_features
                           * layer.gate_up_proj.out_features + layer.down_proj.in_features
                           * layer.down_proj.out_features for layer in model.layers),
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            path = Path(tmp) / fmt
            write_checkpoint(path, fmt, args.hidden, args.intermediate, args.layers, args.group)
            out = subprocess.run([sys.executable, "-m", "loadtests.bench.quant_memory", "--measure", str(path)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r["checkpoint"] = checkpoint_projection_bytes(path)
            results[fmt] = r
            mib = 2**20
            print(f"{fmt:14s} checkpoint {r['checkpoint'] / mib:8.2f} MiB ({8 * r['checkpoint'] / r['weights']:.2f} "
                  f"bits/w)  held {r['held'] / mib:8.2f} MiB ({r['held'] / r['checkpoint']:.3f}x)  resident "
                  f"{r['resident'] / mib:8.2f} MiB ({r['resident'] / r['checkpoint']:.3f}x)  load {r['load_s']:.2f} s "
                  f"({r['load_cpu_s']:.2f} s CPU)  "
                  f"load avg {os.getloadavg()[0]:.1f}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
