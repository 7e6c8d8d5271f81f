"""The peers tooling's own parts (no peer installed): the memory a server's process tree holds, the medians
and ratios of ``serve_compare``, the one vLLM configuration every workload gets."""

from __future__ import annotations

import os
import subprocess
import sys

from loadtests.bench.peer_engines import PEERS, VLLM_MAX_MODEL_LEN, VLLM_MAX_NUM_SEQS, peer_workload
from loadtests.peers.serve_compare import PeakMemory, compare, tree_memory_kib


def test_tree_memory_counts_a_child_process():
    """A child that holds 64 MiB (written, so resident) raises its parent tree's RSS and PSS by about that,
    and the sampler's peak sees it."""
    before_rss, before_pss = tree_memory_kib(os.getpid())
    assert 0 < before_pss <= before_rss
    code = "import sys; b = b'x' * (64 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        mem = PeakMemory(os.getpid(), period_s=0.05)
        rss, pss = tree_memory_kib(os.getpid())
        peak = mem.stop()
    finally:
        child.communicate(b"")
    assert rss - before_rss > 64 * 1024 and pss - before_pss > 64 * 1024
    assert peak["peak_rss_mib"] > (before_rss + 64 * 1024) / 1024 and peak["peak_pss_mib"] <= peak["peak_rss_mib"]


def test_compare_takes_medians_then_their_ratio():
    def run(tok, ttft):
        return {"output_tokens_per_s": tok, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft, "tpot_p50_s": 0.01,
                "startup_s": 10.0, "peak_rss_mib": 500.0, "peak_pss_mib": 400.0}

    c = compare({"tandem": [run(300, 0.2), run(100, 0.4), run(200, 0.3)],
                 "vllm": [run(100, 1.0), run(150, 0.5)]})
    assert c["medians"]["tandem"]["output_tokens_per_s"] == 200 and c["medians"]["vllm"]["ttft_p50_s"] == 0.75
    assert c["ratio_tandem_over_vllm"]["output_tokens_per_s"] == 200 / 125
    assert c["ratio_tandem_over_vllm"]["ttft_p50_s"] == 0.3 / 0.75


def test_vllm_gets_one_configuration_for_every_workload():
    """vLLM's torch.compile cache is keyed by its configuration: a single stream and 64 streams share one."""
    one = peer_workload(PEERS["vllm"], "/m", [[1] * 100], 128, True, 2)
    many = peer_workload(PEERS["vllm"], "/m", [[1] * 100] * 64, 128, True, 2)
    assert (one["max_num_seqs"], one["max_model_len"]) == (many["max_num_seqs"], many["max_model_len"])
    assert (one["max_num_seqs"], one["max_model_len"]) == (VLLM_MAX_NUM_SEQS, VLLM_MAX_MODEL_LEN)
    assert peer_workload(PEERS["vllm"], "/m", [[1] * 4000], 8, True, 2)["max_model_len"] == 4024


def test_hf_directory_from_the_default_gguf_holds_its_weights_and_chat_template(tmp_path, monkeypatch):
    """The directory vLLM loads, from the GGUF ``main`` takes by default (the embedded model; here a tiny random
    Llama written as Q4_1 like it, so the test takes seconds): a Llama config, the GGUF's embedding rows exactly
    (float32 keeps Q4_1/Q8_0 values exact), and the tokenizer with the GGUF's chat template."""
    import json

    import engine.config
    import numpy as np
    import torch
    import transformers
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    from loadtests.peers.make_hf_from_gguf import main
    from tests.tiny_models import write_llama_gguf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    gguf_path = tmp_path / "tiny-q4_1.gguf"
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    write_llama_gguf(gguf_path, transformers.LlamaForCausalLM(cfg).eval(), qtype=GGMLQuantizationType.Q4_1,
                     chat_template=template)
    monkeypatch.setattr(engine.config, "default_model_path", lambda: str(gguf_path))
    assert main([str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    t = next(t for t in GGUFReader(gguf_path).tensors if t.name == "token_embd.weight")
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    expected = dequantize(t.data, t.tensor_type).reshape(config["vocab_size"], config["hidden_size"])
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        got = f.get_tensor("model.embed_tokens.weight")
    assert np.array_equal(got, expected)
    assert "<|im_start|>" in (tmp_path / "hf" / "chat_template.jinja").read_text()
