"""The GPU check's tensor-parallel part (``loadtests/gpu_check.py``): the
engine's collectives and parallel layers over NCCL, on however many GPUs
the machine has.

* Every machine, one GPU included: a world of one rank over NCCL (gloo in
  the CPU dry run): the collectives the engine uses (fixed-order all-reduce,
  gather to the driver, the step inputs' broadcast, the minimum) give what
  they must, and the model built as rank 0 of that world (vocabulary-parallel
  embedding and head, row-parallel all-reduces bound) gives logits bitwise
  those of the model built without one (bfloat16, random weights of
  SmolLM2-135M's shape; the dry run: float32, the tiny shape).
* Two GPUs or more: the engine at ``tensor_parallel_size`` 2 (one rank a
  GPU, NCCL) against one rank, float32 greedy on a tiny random Llama,
  token-identical; and bfloat16 at 2 ranks, a prompt's tokens and logprobs
  bitwise the same alone and batched.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def _prefill_logits(model, ids: list[int], device: torch.device, block_size: int = 16) -> torch.Tensor:
    """The float32 logits of every position of one prompt run as one prefill over a fresh paged KV cache."""
    from engine.layers.attention import AttentionMetadata

    n = len(ids)
    blocks = -(-n // block_size) + 1
    c = model.config
    caches = [tuple(torch.zeros(blocks, block_size, model.shard.num_kv_heads, c.head_dim,
                                dtype=model.embed_tokens.weight.dtype, device=device) for _ in range(2))
              for _ in range(c.num_hidden_layers)]
    md = AttentionMetadata(slot_mapping=torch.arange(block_size, block_size + n, device=device),
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                           seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                           block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=device), torch.arange(n, device=device), md, caches)
        return model.compute_logits(hidden)


def world_of_one(model_dir: str, device: str) -> dict:
    """Rank 0 of a world of one (NCCL on CUDA, gloo on CPU): the collectives, and the model's logits with and
    without the group (see the module's docstring)."""
    from engine.distributed.parallel_state import TensorParallelGroup
    from engine.executor.ports import free_port
    from engine.model_loader import load_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    tp = TensorParallelGroup.join(0, 1, 0, dev, timeout_s=120)
    try:
        x = torch.randn(5, 7, device=dev, dtype=torch.bfloat16)
        collectives = {
            "all_reduce": torch.equal(tp.all_reduce(x.clone()), x),
            "gather_to_driver": torch.equal(tp.gather_to_driver(x)[0], x),
            "broadcast_ints": tp.broadcast_ints(1, [3], np.array([4, 5, 6]))[2].tolist() == [4, 5, 6],
            "broadcast_object": tp.broadcast_object({"a": 1}) == {"a": 1},
            "min_int": tp.min_int(7) == 7,
        }
        # bfloat16 on CUDA; float32 on CPU, where bfloat16 without the group would run the C decoder stack
        dtype = "bfloat16" if device == "cuda" else "float32"
        args = SimpleNamespace(model=model_dir, dtype=dtype, device=device, load_format="dummy", seed=0,
                               quantization="none", attention_backend="auto", batch_invariant=True, num_threads=None,
                               chat_template_source=None)
        alone, _, config = load_model(args)
        ranked, _, _ = load_model(args, tp)
        ids = torch.randint(3, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
        want, got = _prefill_logits(alone, ids, dev), _prefill_logits(ranked, ids, dev)
        return {"backend": "nccl" if device == "cuda" else "gloo", "dtype": dtype, "collectives": collectives,
                "logits_bitwise_equal": bool(torch.equal(want, got)),
                "max_abs_diff": float((want - got).abs().max()), "positions": len(ids)}
    finally:
        tp.close()


def two_ranks(model_dir: str, device: str) -> dict:
    """The engine over 2 ranks vs 1: float32 greedy tokens (tiny Llama with real weights in ``model_dir``),
    and bfloat16 batch invariance at 2 ranks."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (19, 3, 40, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    common = dict(model=model_dir, device=device, kv_cache_memory="16MiB", gpu_memory_utilization=0.2,
                  max_num_batched_tokens=32)
    results = {}
    for tp in (1, 2):
        llm = LLM(dtype="float32", tensor_parallel_size=tp, **common)
        results[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.shutdown()
    llm = LLM(dtype="bfloat16", tensor_parallel_size=2, **common)

    def bits(out):
        o = out.outputs[0]
        return o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
    alone = [bits(llm.generate([p], greedy)[0]) for p in prompts]
    batched = [bits(o) for o in llm.generate(prompts, greedy)]
    llm.shutdown()
    return {"fp32_tokens_equal_tp1": results[1] == results[2], "prompts": len(prompts),
            "bf16_differ_batched_vs_alone": sum(a != b for a, b in zip(alone, batched))}


def check_tensor_parallel(part, device: str, workdir: Path, write_model_dir, shapes: dict) -> None:
    """The part (``gpu_check.Part``): ``world_of_one`` on random weights of SmolLM2-135M's shape on CUDA (the
    tiny shape in the dry run); ``two_ranks`` where there are two GPUs (and in the CPU dry run, over gloo)."""
    shape = "smollm2-135m" if device == "cuda" else "tiny"
    part.results["world_of_one"] = one = world_of_one(write_model_dir(workdir / f"tp-{shape}", shapes[shape]), device)
    ok = all(one["collectives"].values()) and one["logits_bitwise_equal"]
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus < 2:
        part.results["two_ranks"] = f"skipped: {gpus} GPU (NCCL takes one rank a GPU)"
    else:
        import transformers

        path = workdir / "tp-tiny-hf"
        write_model_dir(path, shapes["tiny"])
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes["tiny"], bos_token_id=1, eos_token_id=2)
                                      ).float().eval().save_pretrained(path)
        part.results["two_ranks"] = two = two_ranks(str(path), device)
        ok = ok and two["fp32_tokens_equal_tp1"] and two["bf16_differ_batched_vs_alone"] == 0
    part.status = "ok" if ok else "failed"
