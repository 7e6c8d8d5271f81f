"""Tiny random models for tests that need a real engine but not real text."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def save_byte_level_llama(path: Path, max_position_embeddings: int = 4096, printable_only: bool = False,
                          num_hidden_layers: int = 2) -> str:
    """Save a random Llama (``num_hidden_layers`` layers, GQA 4/2 heads, hidden 64) as an HF directory with a
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
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=num_hidden_layers,
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


def save_byte_level_qwen3_draft(path: Path, target: str) -> str:
    """Save a 2-layer Qwen3 (another architecture than the byte-level Llama at ``target``) with that Llama's
    tokenizer and weights (Qwen3's extra q/k norms at 1, so it attends otherwise): a draft model whose guesses
    the Llama often takes, not always. Returns the directory."""
    import shutil

    import torch
    import transformers

    llama = transformers.LlamaForCausalLM.from_pretrained(target)
    c = llama.config
    cfg = transformers.Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                   num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                                   head_dim=c.hidden_size // c.num_attention_heads,
                                   max_position_embeddings=c.max_position_embeddings, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("q_norm" in k or "k_norm" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.fill_(1.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(target) / name, path / name)
    return str(path)


# A tiny GGUF's tokenizer: three special tokens (BOS 1, EOS 2) and 92 printable characters, then the caller's
GGUF_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(i) for i in range(ord("!"), ord("!") + 92)]


def tiny_gguf_writer(path: Path, arch: str, config, extra_tokens: list[str]):
    """A ``gguf.GGUFWriter`` for ``path`` holding what convert_hf_to_gguf.py
    writes for a tiny transformers ``config`` of llama.cpp architecture
    ``arch`` besides RoPE and the architecture's own keys: the name "tiny",
    the shape (blocks, context, widths, heads, key length, RMSNorm epsilon,
    vocabulary) and a GPT-2 tokenizer (pre-tokenizer "smollm") whose tokens
    are :data:`GGUF_TOKENS` and ``extra_tokens`` (``config.vocab_size`` in
    all), with the one merge "a b". The caller adds the rest and the tensors,
    and writes the file."""
    import gguf

    c = config
    tokens = GGUF_TOKENS + extra_tokens
    assert len(tokens) == c.vocab_size, (len(tokens), c.vocab_size)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def hf_permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF row order of q/k projections)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, arch: str = "llama", qtype=None, chat_template: str | None = None) -> None:
    """Write the transformers ``model`` (Llama or Qwen3, tied embeddings) as a GGUF file the way llama.cpp's
    convert_hf_to_gguf.py does: q/k rows permuted for llama, every 2-D weight as ``qtype`` (a
    ``gguf.GGMLQuantizationType``; default F16), 1-D ones F32, and a 96-token byte-level BPE vocabulary
    (``<|endoftext|>``, ``<|im_start|>`` = BOS, ``<|im_end|>`` = EOS, 92 printable characters, one merge ``a b``),
    named ``tiny``, with ``chat_template`` when given."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType.F16 if qtype is None else qtype
    c = model.config
    w = tiny_gguf_writer(path, arch, c, ["ab"])
    w.add_rope_freq_base(10000.0)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{idx}.{names[module]}.{kind}"
            if module == "self_attn.q_proj" and arch == "llama":
                a = hf_permute(a, c.num_attention_heads)
            elif module == "self_attn.k_proj" and arch == "llama":
                a = hf_permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype(np.float16))
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
