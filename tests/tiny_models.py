"""Tiny random models for tests that need a real engine but not real text."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def save_byte_level_llama(path: Path, max_position_embeddings: int = 4096, printable_only: bool = False) -> str:
    """Save a 2-layer random Llama (GQA 4/2 heads, hidden 64) as an HF directory with a
    byte-level tokenizer (one character = one token, ``<s>``/``</s>`` = BOS/EOS) and a
    chat template. ``printable_only`` makes greedy decoding emit printable ASCII only,
    so one streamed chunk is one character. Returns the directory."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_position_embeddings,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    if printable_only:
        with torch.no_grad():
            printable = torch.tensor([chr(33) <= t <= chr(126) for t in sorted(vocab, key=vocab.get)])
            model.lm_head.weight[~printable] = 0.0
            model.lm_head.weight[printable] *= 4.0
    model.save_pretrained(path)
    return str(path)
