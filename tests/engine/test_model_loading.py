"""Model loading: a GGUF written like llama.cpp's converter loads to the same
model as its HF source, and broken inputs fail with clear errors."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from engine.config import EngineArgs, default_model_path
from engine.worker.device import resolve_device, resolve_dtype
from engine.model_loader import load_model
from engine.model_loader.gguf_loader import unpermute_qk
from engine.worker.model_runner import ModelRunner
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.tiny_models import hf_permute, write_llama_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_qk(hf_permute(w, 8), 8), w)
    assert not np.array_equal(hf_permute(w, 8), w)


def _tiny_llama(num_kv_heads=2):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=num_kv_heads, rope_theta=10000.0,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("qtype,quantization", [("F32", "none"), ("F16", "none"), ("Q8_0", "none"), ("Q4_0", "none"),
                                                ("Q4_1", "none"), ("Q4_0", "gguf"), ("Q4_1", "gguf"), ("Q8_0", "gguf")])
def test_gguf_matches_dequantized_source(tmp_path, qtype, quantization):
    """With quantization "gguf" the Q4_0/Q4_1 projections stay 4-bit (Q8_0 is dequantized) and give the same logits."""
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    model = _tiny_llama()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, model, qtype=qt)
    # The reference sees the same (de)quantized weights.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and qtype != "F32":
                a = p.numpy()
                if qtype == "F16":
                    a = a.astype(np.float16).astype(np.float32)
                else:
                    a = gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt)
                p.copy_(torch.from_numpy(np.array(a)))
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=16, quantization=quantization)
    ours, tok, cfg = load_model(args)
    int4 = sorted(ours.layers[0].int4)
    assert int4 == (["down_proj", "gate_up_proj", "o_proj", "qkv_proj"] if quantization == "gguf" and qtype[:2] == "Q4"
                    else [])
    assert all(ours.layers[0].qkv_proj.weight.numel() == 0 for _ in int4)  # the dense copy is freed
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.num_key_value_heads, cfg.name) == (
        "LlamaForCausalLM", True, 2, "tiny")
    assert tok.encode("<|im_start|>abc") == [1, 95, 69]
    _assert_last_logits_match(args, ours, cfg, model)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        EngineArgs(model=str(tmp_path / "nope.gguf"))
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(args)
    model = _tiny_llama()
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(args)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(args)


def test_a_broken_directory_names_the_file_and_the_setting(tmp_path):
    """A trial's broken checkpoints got errors naming neither the file nor the setting: a tokenizer.json of `{}`
    ("Exception: Model missing. at line 1 column 2"), a config.json vocab_size past the embedding's rows
    ("expected (vocab, 64)") and a shard the index lists that is not there (the tensors named, not the file)."""
    from tokenizers import Tokenizer, models

    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="100KB")   # sharded, with model.safetensors.index.json
    Tokenizer(models.WordLevel(vocab={"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu")
    load_model(args)   # whole, it loads
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    (tmp_path / shards[-1]).rename(tmp_path / "aside")
    with pytest.raises(FileNotFoundError, match=rf"{shards[-1]} listed in model\.safetensors\.index\.json is missing"):
        load_model(args)
    (tmp_path / "aside").rename(tmp_path / shards[-1])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"has shape \(96, 64\), expected \(100 rows or more, 64\): config\.json's "
                                         "vocab_size"):
        load_model(args)
    (tmp_path / "tokenizer.json").write_text("{}")
    from engine.tokenizer import Tokenizer as EngineTokenizer

    with pytest.raises(ValueError, match=r"tokenizer\.json: not a tokenizer the tokenizers library reads"):
        EngineTokenizer.from_hf_dir(str(tmp_path))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*config.json|config.json.*GPT2"):
        load_model(EngineArgs(model=str(tmp_path), device="cpu"))
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"falcon\.gguf: unsupported architecture 'falcon'"):
        load_model(EngineArgs(model=str(path), device="cpu"))


@pytest.mark.parametrize("keep", [3, 1000, 2_000_000, -100])
def test_corrupt_gguf(tmp_path, keep):
    src = default_model_path()
    data = open(src, "rb").read(os.path.getsize(src) + keep if keep < 0 else keep)
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"broken\.gguf: (truncated or corrupt|not a GGUF)"):
        load_model(EngineArgs(model=str(path), device="cpu"))


def test_resolve():
    assert resolve_dtype("auto") == torch.bfloat16 and resolve_dtype("float16") == torch.float16
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        resolve_dtype("int8")


def test_qwen3_gguf(tmp_path):
    """A qwen3 GGUF (q/k norms, head_dim apart from hidden / heads, no q/k permutation) loads through the
    registry and gives transformers' logits."""
    torch.manual_seed(2)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.3)
    path = tmp_path / "qwen3.gguf"
    write_llama_gguf(path, model, arch="qwen3", qtype=gguf.GGMLQuantizationType.F32)
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=16)
    ours, _, config = load_model(args)
    assert (type(ours).__name__, config.head_dim) == ("Qwen3ForCausalLM", 32)
    _assert_last_logits_match(args, ours, config, model)


def _assert_last_logits_match(args, ours, config, model) -> None:
    """One 7-token prefill through our ``ModelRunner`` gives transformers' last-position logits (fp32, 1e-4)."""
    runner = ModelRunner(args, ours, config, torch.device("cpu"), torch.float32, num_blocks=4)
    ids = [5, 17, 90, 33, 2, 8, 64]
    r = Request("r", ids, SamplingParams(temperature=0.0))
    out = runner.execute_model(SchedulerOutput([ScheduledRequest(r, 0, len(ids), [2, 1], True)], len(ids)))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], ref, atol=1e-4, rtol=0)


def test_open_gguf_reads_what_the_gguf_package_reads():
    """engine.gguf_file's reader (a plain ndarray over the mapping) parses the same fields and tensors as
    gguf.GGUFReader itself over its np.memmap."""
    from engine.gguf_file import open_gguf

    ours, theirs = open_gguf(default_model_path()), gguf.GGUFReader(default_model_path())
    assert type(ours.data) is np.ndarray
    _assert_same_fields(ours, theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (b.tensor_type, list(b.shape), b.data_offset)
        assert np.array_equal(a.data, b.data), a.name


def _assert_same_fields(ours, theirs) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.contents() == field.contents(), key
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert sum(int(p.nbytes) for p in mine.parts) == sum(int(p.nbytes) for p in field.parts), key
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.data:
            assert mine.contents(len(field.data) - 1) == field.contents(len(field.data) - 1), key


def test_open_gguf_reads_every_kind_of_array_as_the_package_does(tmp_path):
    """Arrays of strings (empty, multi-byte UTF-8), of each number type, of bools, empty, nested, read per
    array by engine.gguf_file, field for field as the package reads them; a file cut inside an array is a
    ValueError naming the file."""
    from engine.gguf_file import open_gguf

    path = str(tmp_path / "arrays.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("t.strings", ["", "a", "héllo wörld", "\u4e2d\u6587", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3e38])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.one", "single")
    w.add_uint32("t.number", 7)
    w.add_tensor("w", np.arange(32, dtype=np.float32).reshape(2, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    _assert_same_fields(ours, theirs)
    assert ours.fields["t.strings"].contents() == ["", "a", "héllo wörld", "\u4e2d\u6587", "x" * 300]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
    raw = open(path, "rb").read()
    cut = str(tmp_path / "cut.gguf")
    with open(cut, "wb") as f:
        f.write(raw[:raw.index(b"x" * 300) + 100])
    with pytest.raises(ValueError, match="truncated or corrupt GGUF"):
        open_gguf(cut)
