"""The HF transformers baseline of the engine-serving scenario.

The same prompts as the engine gets (the engine's own tokenizer and chat
template, so identical token ids), generated greedily with
``model.generate`` in static batches of ``batch_size`` (left-padded),
``max_new_tokens = min_new_tokens = max_tokens`` (what ``ignore_eos`` does on
the server). Each batch starts when the previous one ends, all its prompts
"arrive" at its start: TTFT is measured from the batch start to the first
call of a logits processor (the prefill's logits), the same for every
prompt of the batch. This is generous to the baseline, which has no queue:
in a served closed loop a request also waits for a free slot.
"""

from __future__ import annotations

import os
import time

from loadtests.stats import percentiles


def resolve_dtype(dtype: str):
    """The torch dtype of an engine ``--dtype`` ("auto" = bfloat16, as the engine on CPU)."""
    import torch
    return {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[dtype]


def load_tokenizer(model_path: str):
    """The engine's :class:`engine.tokenizer.Tokenizer` for a .gguf or HF directory."""
    from engine.tokenizer import Tokenizer
    return Tokenizer.from_gguf(model_path) if model_path.endswith(".gguf") else Tokenizer.from_hf_dir(model_path)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt rendered with the model's template (as the engine server does)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def load_hf_model(model_path: str, dtype: str):
    """``AutoModelForCausalLM`` from a .gguf file (dequantized) or an HF directory, eval mode."""
    from transformers import AutoModelForCausalLM
    torch_dtype = resolve_dtype(dtype)
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                     gguf_file=os.path.basename(model_path), dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.eval()


def hf_generate_bench(model, prompts: list[list[int]], batch_size: int, max_tokens: int, pad_id: int) -> dict:
    """Generate for every prompt in static batches; time it.

    Args:
        prompts: token ids per prompt.
        batch_size: prompts per ``generate`` call.
        max_tokens: new tokens per prompt (EOS ignored).

    Returns:
        ``output_tokens``, ``duration_s``, ``output_tokens_per_s``,
        ``ttft_s`` (percentiles dict), ``batch_size``.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstLogits(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    ttfts, out_tokens = [], 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        first = FirstLogits()
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
                                 logits_processor=LogitsProcessorList([first]))
        out_tokens += int(gen[:, width:].numel())
        ttfts += [(first.t or time.perf_counter()) - t0] * len(batch)
    duration = time.perf_counter() - start
    return {"output_tokens": out_tokens, "duration_s": duration, "output_tokens_per_s": out_tokens / duration,
            "ttft_s": percentiles(ttfts), "batch_size": batch_size}
