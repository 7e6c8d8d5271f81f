"""The decoder stack in one C call (kernels/cpu_decoder.py, csrc/decoder_cpu.c)
and its fused RoPE + cache write: RoPE against a float64 reference, the cache
slots written (and -1 skipped), and the whole stack giving the model's
per-operation path's bits (hidden states and caches) on mixed batches of
prefill chunks and decodes, with and without q/k/v biases, after a weight
changes, and where it must step aside; each on this CPU's build and the AVX2
one (tests/test_cpu_kernels.py's ``linear_build``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model_config import ModelConfig
from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.models.rope import rope_inv_freq
from kernels import cpu_decoder, cpu_linear, get_attention_backend
from tests.test_cpu_kernels import linear_build  # noqa: F401 (a fixture: each test runs on each build)

BLOCK = 16


def _config(bias: bool = False, layers: int = 3) -> ModelConfig:
    return ModelConfig(architecture="Qwen2ForCausalLM" if bias else "LlamaForCausalLM", hidden_size=128,
                       intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                       attention_bias=bias)


def _model(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    backend = get_attention_backend("cpu", "cpu", dtype=torch.bfloat16,
                                    heads=(config.num_attention_heads, config.num_key_value_heads, config.head_dim))
    model = LlamaForCausalLM(config, backend)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.08 * torch.randn(p.shape, generator=g))
    model = model.to(torch.bfloat16).eval()
    model.prepack_weights()
    return model


def _caches(config: ModelConfig, num_blocks: int = 24):
    shape = (num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
            for _ in range(config.num_hidden_layers)]


def _step(seqs: list[tuple[int, int, list[int]]], vocab: int, seed: int):
    """Flat inputs of one step: seqs = (tokens already cached, new tokens, block ids)."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, slots, qsl = [], [], [], [0]
    for cached, new, blocks in seqs:
        ids += torch.randint(0, vocab, (new,), generator=g).tolist()
        for p in range(cached, cached + new):
            pos.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
    width = max(len(b) for _, _, b in seqs)
    tables = torch.tensor([b + [0] * (width - len(b)) for _, _, b in seqs], dtype=torch.int32)
    md = AttentionMetadata(torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                           torch.tensor([c + n for c, n, _ in seqs], dtype=torch.int32), tables)
    return torch.tensor(ids), torch.tensor(pos), md


def _forward(model, caches, step, c_decoder: bool):
    model.use_c_decoder = c_decoder
    ids, pos, md = step
    md = AttentionMetadata(md.slot_mapping, md.query_start_loc, md.seq_lens, md.block_tables)  # a fresh plan
    with torch.inference_mode():
        out = model(ids, pos, md, caches)
    assert model._c_decoder is not None or not c_decoder  # the C stack ran when asked for
    return out


def _copy(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("bias", [False, True])
def test_the_stack_gives_the_per_operation_bits(linear_build, bias):
    """Prefill chunks (one starting past a cached prefix) and decodes in one
    step, then a step of decodes: hidden states and every cache byte equal."""
    config = _config(bias)
    model = _model(config)
    steps = [
        [(0, 37, [1, 2, 3]), (0, 5, [4]), (16, 20, [5, 6, 7])],  # prefills; the third's first block is cached
        [(37, 1, [1, 2, 3]), (5, 1, [4]), (36, 1, [5, 6, 7]), (0, 16, [8])],  # decodes beside a prefill
        [(38, 1, [1, 2, 3]), (6, 1, [4]), (37, 1, [5, 6, 7]), (16, 1, [8, 9])],
    ]
    per_op, stack = _caches(config), _caches(config)
    for i, seqs in enumerate(steps):
        step = _step(seqs, config.vocab_size, seed=i)
        a = _forward(model, per_op, step, c_decoder=False)
        b = _forward(model, stack, step, c_decoder=True)
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == (step[0].numel(), config.hidden_size)
        assert torch.equal(a, b)
        assert all(torch.equal(x, y) for (xk, xv), (yk, yv) in zip(per_op, stack) for x, y in ((xk, yk), (xv, yv)))
    assert per_op[0][0][1:10].abs().sum() > 0  # the caches were written


def test_a_row_does_not_depend_on_the_batch(linear_build):
    """A decode computed alone, and beside other decodes and a prefill, has the same bits."""
    config = _config()
    model = _model(config, seed=3)
    base = _caches(config)
    _forward(model, base, _step([(0, 30, [1, 2]), (0, 9, [3])], config.vocab_size, seed=0), c_decoder=True)
    alone = _forward(model, _copy(base), _step([(30, 1, [1, 2])], config.vocab_size, seed=7), c_decoder=True)
    ids, pos, md = _step([(30, 1, [1, 2])], config.vocab_size, seed=7)
    mixed_step = _step([(9, 1, [3]), (30, 1, [1, 2]), (0, 20, [4, 5])], config.vocab_size, seed=1)
    mixed_ids = mixed_step[0].clone()
    mixed_ids[1] = ids[0]
    mixed = _forward(model, _copy(base), (mixed_ids, mixed_step[1], mixed_step[2]), c_decoder=True)
    assert torch.equal(mixed[1], alone[0])


def test_a_changed_norm_weight_is_seen(linear_build):
    """The C stack reads the norms' weights where they are: one changed in place is seen at the next step."""
    config = _config(layers=2)
    model = _model(config)
    step = _step([(0, 12, [1])], config.vocab_size, seed=0)
    before = _forward(model, _caches(config), step, c_decoder=True)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight.mul_(1.5)
    after = _forward(model, _caches(config), step, c_decoder=True)
    assert not torch.equal(before, after)
    assert torch.equal(after, _forward(model, _caches(config), step, c_decoder=False))


def test_the_stack_steps_aside_where_it_cannot_run(linear_build):
    """float32, or a projection not on the C linear kernel: the per-operation path runs."""
    config = _config(layers=2)
    model = _model(config)
    caches = _caches(config)
    assert model._c_decoder_weights(caches) is not None
    model = _model(config)
    model.layers[1].packed._entries["o_proj"] = (model.layers[1].o_proj.weight,
                                                 model.layers[1].o_proj.weight._version, None)
    assert model._c_decoder_weights(caches) is None
    f32 = LlamaForCausalLM(config, get_attention_backend("cpu", "cpu")).eval()
    f32.build_rope_cache()
    shape = (4, BLOCK, config.num_key_value_heads, config.head_dim)
    assert f32._c_decoder_weights([(torch.zeros(shape), torch.zeros(shape))] * 2) is None


def test_rope_cache_matches_float64_and_writes_the_slots(linear_build):
    config = _config()
    h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(7, (h + 2 * kv) * d, generator=g).bfloat16()
    positions = torch.tensor([0, 1, 5, 17, 63, 100, 255])
    inv = rope_inv_freq(config).double()
    ang = positions.double()[:, None] * inv[None, :]
    cos_t, sin_t = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x = qkv.double()[:, :(h + kv) * d].view(7, h + kv, d)
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    ref = x * cos_t[:, None] + rot * sin_t[:, None]
    freqs = torch.arange(256, dtype=torch.float32)[:, None] * rope_inv_freq(config)[None, :]
    table_cos, table_sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    kc, vc = (torch.zeros(4, BLOCK, kv, d, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, 17, -1, 20, 40, 41, 63])
    out = qkv.clone()
    cpu_decoder.rope_cache(out, positions, table_cos, table_sin, h, kv, d, slots, kc, vc)
    got = out[:, :(h + kv) * d].view(7, h + kv, d).double()
    assert ((got - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()  # one rounding (float32 tables: ~1e-6 off)
    assert torch.equal(out[:, (h + kv) * d:], qkv[:, (h + kv) * d:])  # values untouched
    flat_k, flat_v = kc.view(-1, kv, d), vc.view(-1, kv, d)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], out[row, h * d:(h + kv) * d].view(kv, d))
            assert torch.equal(flat_v[slot], qkv[row, (h + kv) * d:].view(kv, d))
    written = {s for s in slots.tolist() if s >= 0}
    assert all(flat_k[s].abs().sum() == 0 for s in range(64) if s not in written)  # -1 wrote nothing
    with pytest.raises(ValueError, match="outside the RoPE tables"):
        cpu_decoder.rope_cache(qkv.clone(), torch.tensor([0, 1, 2, 3, 4, 5, 256]), table_cos, table_sin, h, kv, d,
                               slots, kc, vc)
    with pytest.raises(ValueError, match="rope_cache takes"):
        cpu_decoder.rope_cache(qkv.float(), positions, table_cos, table_sin, h, kv, d, slots, kc, vc)


def _gguf_model(config: ModelConfig, mode: str, seed: int = 0, release_dense: bool = True) -> LlamaForCausalLM:
    """The model with 4-bit GGUF projections (Q4_1, quantized by the gguf
    package): "dense" dequantized to bfloat16 only, "copy" dequantized with a
    4-bit copy beside (quantization none), "int4" kept in 4 bits only
    (quantization gguf)."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    from engine.layers.quant_linear import GGUFBlocks

    model = _model(config, seed)  # random norms and embeddings; projections replaced below
    fresh = LlamaForCausalLM(config, model.backend).to(torch.bfloat16)
    rng = np.random.default_rng(seed)
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size),
              "self_attn.v_proj": (kv, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q),
              "mlp.gate_proj": (c.intermediate_size, c.hidden_size), "mlp.up_proj": (c.intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    weights = [("model.embed_tokens.weight", model.embed_tokens.weight.float()), ("model.norm.weight", model.norm.weight.float()),
               ("lm_head.weight", model.lm_head.weight.float())]
    for i, layer in enumerate(model.layers):
        weights += [(f"model.layers.{i}.input_layernorm.weight", layer.input_layernorm.weight.float()),
                    (f"model.layers.{i}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight.float())]
        for name, shape in shapes.items():
            data = gguf.quants.quantize((rng.standard_normal(shape) * 0.08).astype(np.float32),
                                        gguf.GGMLQuantizationType.Q4_1)
            blocks = GGUFBlocks("Q4_1", shape, data)
            weights.append((f"model.layers.{i}.{name}.weight",
                            blocks.dequantize() if mode == "dense" else blocks))
    fresh.load_weights(weights, q4_copy=mode == "copy")
    fresh.prepack_weights(release_dense=release_dense)
    return fresh.eval()


def test_4bit_projections_give_the_bfloat16_bits(linear_build):
    """A 4-bit GGUF's projections three ways: dequantized to bfloat16, with the
    4-bit copy the stack reads for calls of up to two rows, and kept in 4
    bits only (quantization gguf): hidden states and caches equal bit for bit
    on prefills and on decodes of 1, 2, 3 and 5 rows, per-operation or one call,
    and a decode row's bits the same in each of those batches. On the integer
    builds (every x86 build with AVX2, AVX-512 included: cpu_linear.integer_copies),
    whose copies run integer dots at every row count (csrc/quant_int.h), the
    copy and 4-bit-only models equal each other, not the dequantized one."""
    from kernels import cpu_linear

    if not cpu_linear.q4_available():
        pytest.skip("no 4-bit C kernel")
    integer = cpu_linear.integer_copies()
    config = _config(layers=2)
    models = {mode: _gguf_model(config, mode) for mode in ("dense", "copy", "int4")}
    assert models["copy"].layers[0].q4_copy and not models["dense"].layers[0].q4_copy
    assert models["int4"].layers[0].int4["gate_up_proj"].c_packed is not None
    steps = [[(0, 20, [1, 2]), (0, 7, [3])], [(20, 1, [1, 2])], [(20, 1, [1, 2]), (7, 1, [3])],
             [(20, 1, [1, 2]), (7, 1, [3]), (0, 1, [4])],
             [(20, 1, [1, 2]), (7, 1, [3]), (0, 1, [4]), (0, 1, [5]), (0, 1, [6])]]
    runs = {(mode, c): _caches(config) for mode in models for c in (True, False)}
    # the run each must equal: on the integer builds the 4-bit ones have their own (integer-dot) bits
    ref_of = {key: ("int4" if integer and key[0] != "dense" else "dense", False) for key in runs}
    for i, seqs in enumerate(steps[:2]):
        step = _step(seqs, config.vocab_size, seed=i)
        outs = {key: _forward(models[key[0]], caches, step, c_decoder=key[1]) for key, caches in runs.items()}
        wrong = [k for k, o in outs.items() if not torch.equal(o, outs[ref_of[k]])]
        assert not wrong, wrong
        assert torch.equal(outs[("int4", False)], outs[("dense", False)]) == (not integer)
    first_rows = []
    for seqs in steps[2:]:  # 2, 3 and 5 decode rows, from fresh caches
        step = _step(seqs, config.vocab_size, seed=9)
        outs = {key: _forward(models[key[0]], _caches(config), step, c_decoder=key[1]) for key in runs}
        assert all(torch.equal(o, outs[ref_of[k]]) for k, o in outs.items())
        first_rows.append({key: o[0] for key, o in outs.items()})  # the same sequence, token and cache each time
    assert all(torch.equal(rows[key], first_rows[0][key]) for rows in first_rows for key in runs)


@pytest.mark.parametrize("smollm_heads", [False, True])
def test_a_4bit_decode_step_has_the_same_bits_on_any_team(linear_build, smollm_heads):
    """Decode steps of one and two rows on 4-bit weights run the layers in one parallel region
    (decoder_cpu.c's decode_team: its work items shared by the team, the norms and SwiGLU computed by every
    thread): hidden states and caches equal the per-operation path's on 1, 2 and 3 threads (where the
    attention's items are too few to share, it runs in two rounds, scores by parts of the context, then
    outputs by chunks of columns: attention_decode.h), with a context past one cache block; with
    SmolLM2's attention shape (groups of 3 query heads, head_dim 64: two column chunks) and a context of
    several blocks too."""
    from kernels import cpu_linear

    if not cpu_linear.q4_available():
        pytest.skip("no 4-bit C kernel")
    config = _config(layers=2)
    if smollm_heads:
        config = dataclasses.replace(config, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                                     head_dim=64)
    model = _gguf_model(config, "int4")
    long = 70 if smollm_heads else 20
    prefill = _step([(0, long, [1, 2, 5, 7, 9]), (0, 7, [3])], config.vocab_size, seed=0)
    base = _caches(config)
    _forward(model, base, prefill, c_decoder=False)
    threads = torch.get_num_threads()
    try:
        for seqs in ([(long, 1, [1, 2, 5, 7, 9])], [(long, 1, [1, 2, 5, 7, 9]), (7, 1, [3])]):
            step = _step(seqs, config.vocab_size, seed=5)
            torch.set_num_threads(2)
            ref_caches = _copy(base)
            ref = _forward(model, ref_caches, step, c_decoder=False)
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                caches = _copy(base)
                assert torch.equal(_forward(model, caches, step, c_decoder=True), ref), n
                assert all(torch.equal(x, y) for (xk, xv), (yk, yv) in zip(caches, ref_caches)
                           for x, y in ((xk, yk), (xv, yv))), n
    finally:
        torch.set_num_threads(threads)


def test_the_stack_and_the_copies_are_chosen_once(linear_build, monkeypatch):
    """With the dense weights kept, the stack's view of the weights is built
    once per set of caches, and each linear method asks once how many rows
    read its 4-bit copy, not per step (issue #32): a projection changed in
    place keeps the view until ``choose_kernels``, which stops reading its
    copy (it would be stale): a one-row step then equals the per-operation
    path again."""
    from kernels import cpu_linear

    if not cpu_linear.q4_available():
        pytest.skip("no 4-bit C kernel")
    config = _config(layers=2)
    model = _gguf_model(config, "copy", release_dense=False)
    caches = _caches(config)
    step = _step([(0, 1, [1])], config.vocab_size, seed=2)
    assert torch.equal(_forward(model, caches, step, c_decoder=True),
                       _forward(model, _caches(config), step, c_decoder=False))
    view = model._c_decoder

    def asked(*args, **kwargs):
        raise AssertionError("a copy's rows were asked for during a step")

    with monkeypatch.context() as m:
        m.setattr(cpu_linear, "copy_max_rows", asked)
        with torch.no_grad():
            model.layers[1].o_proj.weight.mul_(1.5)
        more = _step([(1, 5, [1])], config.vocab_size, seed=3)  # more rows than COPY_MAX_ROWS
        _forward(model, caches, more, c_decoder=True)
        _forward(model, _caches(config), more, c_decoder=False)
    assert model._c_decoder is view
    model.choose_kernels()
    changed = _forward(model, _caches(config), step, c_decoder=True)
    assert model._c_decoder.layers[1].q4["o"] is None and model._c_decoder.layers[0].q4["o"] is not None
    assert torch.equal(changed, _forward(model, _caches(config), step, c_decoder=False))
