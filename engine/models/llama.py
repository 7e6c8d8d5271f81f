"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Phi-3) over a paged
KV cache, and the variants other model files select with a ``ModelSpec``
(``engine/models/spec.py``: q/k norms, Gemma's norms, embedding scaling) or
their config (sliding window, soft-capping, GeGLU, partial or per-layer RoPE).

Architecture: Touvron et al. 2023, "LLaMA" (RMSNorm pre-norm, SwiGLU MLP,
rotary position embeddings) with grouped-query attention (Ainslie et al. 2023)
and optional q/k/v biases (Qwen2). Numerics follow transformers'
``modeling_llama.py`` (RMSNorm in float32, RoPE cos/sin cast to the model's
dtype, rotate-half RoPE on HF-ordered q/k rows) so float32 logits match it.
Each variant is chosen once, at construction, and each kernel once for the
weights as they are (``choose_kernels``: at construction, when the weights
move to another dtype or device, once loaded or packed, and when
batch-invariant mode changes; vLLM's ``CustomOp`` idea), so ``forward`` runs
straight through; the linear methods are ``engine/layers/linear.py``'s. A
weight changed in place other than by ``load_weights`` is seen once
``choose_kernels`` runs again. The C decoder stack runs a model only when it
implements every feature its layers use (``kernels.cpu_decoder.IMPLEMENTED``).

Inputs are flat (vLLM style): ``input_ids``/``positions`` [num_tokens] for a
mixed batch of prefill chunks and decodes, with an ``AttentionMetadata`` that
tells the attention kernels where each sequence's tokens go (slot mapping)
and which cache blocks it reads (block tables).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.activation import gated_activation
from engine.layers.attention import AttentionMetadata, windowed_attention
from engine.layers.linear import PROJECTIONS, c_head, head_method, linear_method, pack_projections
from engine.layers.norm import GemmaRMSNorm, RMSNorm
from engine.layers.parallel_linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding, gather_vocab,
                                           row_parallel_method)
from engine.model_config import ModelConfig
from engine.layers.packed_linear import PackedWeights
from engine.layers.fp8_linear import FP8Linear
from engine.layers.int8_linear import Int8Linear
from engine.layers.quant_linear import Int4Linear
from engine.layers.triton_packed_linear import TritonPackedLinear
from engine.distributed.shard_plan import Span, TPShard, plan_shard
from engine.models.c_stack import c_stack_weights
from engine.models.weight_loading import load_hf_weights
from engine.models.rope import RopeInputs, apply_rope, rope_inv_freq
from engine.models.spec import ModelSpec, stack_features
from kernels import cpu_decoder, cpu_linear, cpu_norm_act

__all__ = ["AttentionMetadata", "LlamaDecoderLayer", "LlamaForCausalLM", "RMSNorm"]


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: attention with fused q/k/v, a gated MLP with fused
    gate/up; with ``spec.sandwich_norms`` (Gemma) ``post_attention_layernorm``
    norms the attention's output and ``pre_/post_feedforward_layernorm``
    surround the MLP, else ``post_attention_layernorm`` is the MLP's pre-norm.

    Args:
        layer_idx: the layer's index (its attention type: ``config.is_sliding``).
        shard: this rank's heads and intermediate span (``plan_shard``; None: the whole layer).
        tp: the ``TensorParallelGroup`` with several ranks (the row-parallel projections' all-reduce), else None.
    """

    def __init__(self, config: ModelConfig, backend, row_checks: dict | None = None,
                 spec: ModelSpec = ModelSpec(), layer_idx: int = 0, shard: TPShard | None = None,
                 tp=None) -> None:
        super().__init__()
        c = config
        shard = shard or plan_shard(c)
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (c.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.backend = backend
        norm = GemmaRMSNorm if spec.gemma_norms else RMSNorm
        self.input_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(c.hidden_size, c.rms_norm_eps)
            self.post_feedforward_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.q_norm = norm(c.head_dim, c.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = norm(c.head_dim, c.rms_norm_eps) if spec.qk_norm else None
        self.local_rope = c.rope_local_theta is not None and c.is_sliding(layer_idx)  # Gemma 3's local layers
        self.window = c.sliding_window if c.is_sliding(layer_idx) else None
        self.softcap = c.attn_logit_softcapping
        self.windowed = self.window is not None or self.softcap is not None  # engine/layers/attention.py
        self.hidden_act = c.hidden_act
        # the C RoPE + cache write takes neither q/k norms (between projection and RoPE) nor partial RoPE
        self.c_rope_ok = not spec.qk_norm and c.rotary_dim == c.head_dim
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                          shard.q_heads, shard.kv_heads, bias=c.attention_bias)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                        Span(shard.q_heads.start * c.head_dim, self.q_size))
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, c.intermediate_size, 2, shard.intermediate)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, shard.intermediate)
        self.packed = PackedWeights(row_checks)
        # projections kept packed: 4-bit (quantization="gguf", 4-bit checkpoints) or FP8 (FP8 checkpoints)
        self.int4: dict[str, Int4Linear | FP8Linear | Int8Linear | TritonPackedLinear] = {}
        # quantization="none" from a 4-bit GGUF: a 4-bit copy beside the bfloat16 weight, read for calls of up
        # to cpu_linear.copy_max_rows() rows (every call on x86: integer dots; the portable build's few-row
        # steps, the same bits from 5 bits per weight instead of 16): name -> (copy, the weight it was made
        # from, that weight's version)
        self.q4_copy: dict[str, tuple[cpu_linear.PackedQ4Linear, torch.Tensor, int]] = {}
        self.choose_kernels()

    def _apply(self, fn, recurse=True):  # .to(), .bfloat16(), .to_empty(): the weights moved
        out = super()._apply(fn, recurse)
        self.choose_kernels()
        return out

    def choose_kernels(self) -> None:
        """Bind the layer's kernels for its weights as they are now (dtype,
        device, 4-bit forms and copies, batch-invariant mode): ``proj`` (each
        projection's linear method, ``engine/layers/linear.py``, with its
        4-bit copy when fresh now), ``act``,
        the q/k/v path and ``c_rope``: whether RoPE and the cache write run
        in C (``kernels.cpu_decoder.rope_cache``: bfloat16 on CPU with the
        ``cpu`` attention backend, full-width RoPE, no q/k norms)."""
        w = self.o_proj.weight
        self.proj = {name: linear_method(getattr(self, name), name, self.packed, self.int4.get(name),
                                         self.fresh_q4_copy(name))
                     for name in PROJECTIONS}
        if self.tp is not None:  # several ranks: o_proj and down_proj sum their partial outputs
            for name in ("o_proj", "down_proj"):
                self.proj[name] = row_parallel_method(self.proj[name], self.tp)
        self.act = gated_activation(self.hidden_act, w.dtype, w.device)
        self.c_rope = w.dtype == torch.bfloat16 and w.device.type == "cpu" and self.backend.name == "cpu" \
            and self.c_rope_ok and cpu_norm_act.available()
        self._qkv_to_cache = self._rope_cache_c if self.c_rope else \
            self._rope_cache if self.q_norm is None else self._qk_norm_rope_cache
        self._attention_out_and_mlp = self._sandwich if self.sandwich else self._pre_norm

    def fresh_q4_copy(self, name: str) -> cpu_linear.PackedQ4Linear | None:
        """Projection ``name``'s 4-bit copy when it was made from the weight as it is now, else None."""
        copy, source, version = self.q4_copy.get(name, (None, None, None))
        weight = getattr(self, name).weight
        fresh = weight.numel() == 0 or (weight is source and weight._version == version)
        return copy if fresh else None

    def norms(self) -> list[nn.Module]:
        """Every norm of the layer."""
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "q_norm", "k_norm")
        return [m for m in (getattr(self, n, None) for n in names) if m is not None]

    def forward(self, x: torch.Tensor, rope: RopeInputs, md: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        key_cache, value_cache = kv_cache
        q = self._qkv_to_cache(self.proj["qkv_proj"](self.input_layernorm(x)), rope, md, key_cache, value_cache)
        o = None
        if self.softcap is None:    # soft-capped scores: every row is windowed_attention's
            extra = {} if md.attn_plan is None else {"plan": md.attn_plan}
            o = self.backend.paged_attention(q, key_cache, value_cache, md.query_start_loc, md.seq_lens,
                                             md.block_tables, self.scale, **extra)
        if self.windowed:  # the rows whose attention the paged kernel cannot give
            o = windowed_attention(q, key_cache, value_cache, md, self.scale, self.window, self.softcap, o)
        return self._attention_out_and_mlp(x, o.reshape(t, self.q_size))

    def _rope_cache_c(self, qkv, rope, md, key_cache, value_cache) -> torch.Tensor:
        """RoPE in place on q and k (float32, one rounding) and the cache write, in C; returns q."""
        cpu_decoder.rope_cache(qkv, rope.positions, rope.cos_table, rope.sin_table, self.num_heads,
                               self.num_kv_heads, self.head_dim, md.slot_mapping, key_cache, value_cache)
        return qkv[:, :self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim)

    def _rope_cache(self, qkv, rope, md, key_cache, value_cache) -> torch.Tensor:
        t = qkv.shape[0]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, rope.cos, rope.sin)  # RoPE on q and k heads at once
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        self.backend.reshape_and_cache(k, v.view(t, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                                       md.slot_mapping)
        return q

    def _qk_norm_rope_cache(self, qkv, rope, md, key_cache, value_cache) -> torch.Tensor:
        """q/k norms over each head, then RoPE (Qwen3, Gemma 3)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), rope.cos, rope.sin)
        k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), rope.cos, rope.sin)
        self.backend.reshape_and_cache(k, v.reshape(t, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                                       md.slot_mapping)
        return q

    def _pre_norm(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self.proj["o_proj"](attn, x)
        act = self.act(self.proj["gate_up_proj"](self.post_attention_layernorm(x)))
        return self.proj["down_proj"](act, x)

    def _sandwich(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.proj["o_proj"](attn))
        h = self.proj["down_proj"](self.act(self.proj["gate_up_proj"](self.pre_feedforward_layernorm(x))))
        return x + self.post_feedforward_layernorm(h)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache; a subclass sets ``spec``
    for its architecture's variants (``engine/models/registry.py``).

    Args:
        config: the model's shape.
        backend: attention kernels (``kernels.get_attention_backend``), with
            ``reshape_and_cache`` and ``paged_attention``.
        tp: the ``TensorParallelGroup`` when the model is split over several
            ranks (this process builds its rank's part: ``plan_shard``), else None.
    """

    spec = ModelSpec()

    def __init__(self, config: ModelConfig, backend, tp=None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.tp = tp
        self.shard = plan_shard(config, tp.rank, tp.world_size) if tp is not None else plan_shard(config)
        s = self.shard
        self.embed_tokens = VocabParallelEmbedding(s.vocab, s.vocab_per_rank, config.hidden_size, tp)
        self._row_checks: dict = {}  # shared by the layers' PackedWeights: one check per weight shape
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, self._row_checks, self.spec, i, s, tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = (GemmaRMSNorm if self.spec.gemma_norms else RMSNorm)(config.hidden_size, config.rms_norm_eps)
        # the layer features the C decoder stack lacks (chosen once): any -> the per-operation path; it runs
        # the whole stack in one call, with no place for the row-parallel projections' all-reduce
        self.c_stack_refusal = cpu_decoder.unimplemented(stack_features(config, self.spec)) | \
            ({"tensor_parallel"} if tp is not None else set())
        self.embed_scale = config.hidden_size ** 0.5 if self.spec.embed_scale else None
        self.final_softcap = config.final_logit_softcapping
        self.rope_local_cos: torch.Tensor | None = None  # Gemma 3's sliding-window layers' tables
        self.rope_local_sin: torch.Tensor | None = None
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(s.vocab, s.vocab_per_rank, config.hidden_size)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.packed = PackedWeights(self._row_checks)
        # The whole stack in one C call where it can run (bfloat16, CPU, the
        # C kernels): see _c_decoder_weights. False keeps the per-operation path.
        self.use_c_decoder = True
        # A Q8_0 output head from a GGUF, bfloat16 on CPU: its 8-bit copy, read for logits of up to
        # cpu_linear.copy_max_rows() rows (cpu_linear.PackedQ8Linear: about half the bytes; head_method)
        self.lm_head_q8: cpu_linear.PackedQ8Linear | None = None
        self._lm_head_q8_of: tuple[torch.Tensor, int] | None = None  # (head weight, its version) it was made from
        self._c_decoder: cpu_decoder.DecoderWeights | None = None  # see _c_decoder_weights
        self._c_decoder_key: tuple | None = None  # the caches and RoPE tables it was built for
        self._choose_model_kernels()

    def _apply(self, fn, recurse=True):  # the layers chose theirs in their own _apply
        out = super()._apply(fn, recurse)
        self._choose_model_kernels()
        return out

    def choose_kernels(self) -> None:
        """Bind every kernel for the weights as they are now (see the module's docstring)."""
        for layer in self.layers:
            layer.choose_kernels()
        self._choose_model_kernels()

    def _choose_model_kernels(self) -> None:
        self._gather_rope = not all(layer.c_rope for layer in self.layers)  # the per-op path's cos/sin rows
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        q8 = self._fresh_q8_head(head.weight)
        self._logits = head_method(head, self.packed, q8)
        self._c_head = c_head(head, self.packed, q8)
        self._c_decoder = self._c_decoder_key = None  # rebuilt for the weights as they are now

    def _fresh_q8_head(self, weight: torch.Tensor) -> cpu_linear.PackedQ8Linear | None:
        """The head's 8-bit copy when it was made from ``weight`` as it is now, else None."""
        if self.lm_head_q8 is None or self._lm_head_q8_of[0] is not weight \
                or self._lm_head_q8_of[1] != weight._version:
            return None
        return self.lm_head_q8

    def build_rope_cache(self, max_positions: int | None = None) -> None:
        """Precompute cos/sin [max_positions, head_dim] (float32) on the model's device."""
        n = max_positions or self.config.max_position_embeddings
        device = self.embed_tokens.weight.device
        for local in (False, True) if any(layer.local_rope for layer in self.layers) else (False,):
            inv_freq = rope_inv_freq(self.config, local).to(device)
            freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            if local:
                self.rope_local_cos, self.rope_local_sin = emb.cos(), emb.sin()
            else:
                self.rope_cos, self.rope_sin = emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layers: tuple[int, int] | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder over a flat batch (through ``layers`` only: a pooling chunk carried through part of
        the layers per step, ``engine/core/step_cost.py``; each layer's arithmetic is the same, so the bits are).

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64, each token's position in its sequence.
            attn_metadata: slot mapping, query/sequence lengths, block tables.
            kv_caches: per layer (key_cache, value_cache), each
                [num_blocks, block_size, num_kv_heads, head_dim], model dtype;
                the new tokens' keys and values are written into them.
            layers: (first, end) layers to run; None: all.
            hidden: [num_tokens, hidden_size] model dtype, the residual stream
                entering layer ``first`` when it is not 0 (what an earlier
                call through layers ending there returned; may be overwritten).

        Returns:
            [num_tokens, hidden_size] final-normed hidden states, model dtype;
            when ``layers`` ends before the last layer, the residual stream
            leaving it instead (not normed).
        """
        if self.rope_cos is None or self.rope_cos.device != input_ids.device:
            self.build_rope_cache()
        if attn_metadata.attn_plan is None and self.backend.plan is not None:
            attn_metadata.attn_plan = self.backend.plan(
                kv_caches[0][0], self.shard.num_heads, attn_metadata.query_start_loc,
                attn_metadata.seq_lens, attn_metadata.block_tables)
        first, end = layers or (0, len(self.layers))
        if first:
            x = hidden
        else:
            x = self.embed_tokens(input_ids)
            if self.embed_scale is not None:  # Gemma: the scale rounded to the model's dtype first, as HF does
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        stack = self._c_decoder_weights(kv_caches) if self.use_c_decoder else None
        if stack is not None:
            plan = attn_metadata.attn_plan
            return cpu_decoder.forward(stack, x, positions, attn_metadata.slot_mapping, plan.block_tables,
                                       plan.seq_lens, plan.query_start_loc, (first, end))
        rope = RopeInputs(positions, self.rope_cos, self.rope_sin)
        local = RopeInputs(positions, self.rope_local_cos, self.rope_local_sin)
        if self._gather_rope:
            rope.cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
            rope.sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
            if self.rope_local_cos is not None:
                local.cos = self.rope_local_cos[positions].to(x.dtype).unsqueeze(1)
                local.sin = self.rope_local_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv in zip(self.layers[first:end], kv_caches[first:end]):
            x = layer(x, local if layer.local_rope else rope, attn_metadata, kv)
        return self.norm(x) if end == len(self.layers) else x

    def _c_decoder_weights(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> cpu_decoder.DecoderWeights | None:
        """The C decoder stack's view of the weights and caches
        (``kernels.cpu_decoder``), or None where it cannot run: not bfloat16
        on CPU with the ``cpu`` attention backend, a projection on neither C
        linear kernel (bfloat16 panels, 4-bit GGUF), shapes the kernels
        refuse, or a model whose layers use a feature the stack does not
        implement (``c_stack_refusal``). Chosen once per set of caches and
        RoPE tables (the first step that brings them) for the weights as
        they are, and again after the kernels are chosen again
        (``choose_kernels``: the weights moved, loaded or packed, or
        batch-invariant mode changed), not per step: a projection weight
        changed in place or replaced later is seen once ``choose_kernels``
        runs (the norms' weights are read where they are). A 4-bit copy is
        used while its weight is the one it was made from, unchanged, or has
        been released (``prepack_weights``), as ``fresh_q4_copy`` says then."""
        if self.c_stack_refusal:
            return None
        if self.rope_cos is None:
            self.build_rope_cache()
        key = (kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr(), len(kv_caches), self.rope_cos.data_ptr())
        if key != self._c_decoder_key:
            self._c_decoder, self._c_decoder_key = c_stack_weights(self, kv_caches), key
        return self._c_decoder

    def can_decode_greedy(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether :meth:`decode_greedy` runs with these caches (the C stack and the C head, no soft cap, no
        embedding scale)."""
        return self._greedy_head_ready() and self._c_decoder_weights(kv_caches) is not None

    def _greedy_head_ready(self) -> bool:
        """The C stack asked for, the head on the C kernel, no soft cap on the logits, no embedding scale."""
        return self.use_c_decoder and self._c_head is not None and self.final_softcap is None \
            and self.embed_scale is None

    def decode_greedy(self, token_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> torch.Tensor | None:
        """``steps`` greedy decode steps of a batch in one C call (``kernels.cpu_decoder.decode_greedy``: the
        tokens :meth:`forward`, :meth:`compute_logits` and the sampler's argmax give one step at a time), or
        None where the model cannot: off the C stack or the C head, a soft cap or an embedding scale.

        Args:
            token_ids: [rows] int64, each sequence's next input token; positions: [rows] int64, its position.
            block_tables: [rows, max_blocks] int32, long enough for ``positions + steps - 1``.

        Returns:
            [steps, rows] int64, the token each step chose per row.
        """
        stack = self._c_decoder_weights(kv_caches) if self._greedy_head_ready() else None
        if stack is None:
            return None
        return cpu_decoder.decode_greedy(stack, self.embed_tokens.weight, self._c_head(token_ids.shape[0]),
                                         token_ids, positions, block_tables, steps)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make each row's logits independent of the rest of the batch: on
        CPU the linear layers run in fixed row tiles (:class:`PackedWeights`;
        the tiling checks of each weight shape run now, at start-up, not in
        the first request); on CUDA the linear layers and RMSNorms run
        fixed-configuration Triton kernels (``kernels.triton_batch_invariant``),
        as they do on CPU with the Triton attention backend (Triton's
        interpreter, for tests)."""
        device = self.embed_tokens.weight.device
        use_triton = enabled and (device.type == "cuda" or self.backend.name == "triton")
        kernels = None
        if use_triton:
            from kernels import triton_batch_invariant as kernels  # imports triton: CUDA (or its interpreter) only
        for packed in [self.packed] + [layer.packed for layer in self.layers]:
            packed.batch_invariant = enabled
            packed.triton_linear = kernels.linear if use_triton else None
        for norm in [self.norm] + [n for layer in self.layers for n in layer.norms()]:
            if isinstance(norm, RMSNorm):  # Gemma's norms have no batch-invariant kernel: PyTorch's
                norm.use_triton(kernels.rms_norm if use_triton else None)
        self.choose_kernels()
        if not enabled or use_triton or device.type != "cpu":
            return
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        uses = [(self.packed, "lm_head", head, False)]
        for layer in self.layers[:1]:  # every layer has the same shapes, and the checks are shared by shape
            uses += [(layer.packed, name, getattr(layer, name).weight, name in ("o_proj", "down_proj"))
                     for name in PROJECTIONS if name not in layer.int4]
        for packed, name, weight, with_residual in uses:
            packed._needs_padding(weight, packed.get(name, weight), with_residual)

    @torch.no_grad()
    def prepack_weights(self, release_dense: bool = True) -> None:
        """Pack the bfloat16 and float32 CPU linear weights now (:func:`_pack_for_cpu`)
        rather than in the first forward pass, and choose the kernels for
        them; a no-op for other dtypes and devices. Weights loaded later are
        repacked when used (changed in place: once ``choose_kernels`` runs).

        Args:
            release_dense: free each decoder projection's dense weight once
                the C kernel's panels hold it (``kernels.cpu_linear``, ``kernels.cpu_linear_f32``), so the
                weights are not kept twice (-212 MB for SmolLM2-135M); the
                parameter becomes an empty tensor and the layer can no longer
                be reloaded or repacked. The embedding (also the tied
                output head) stays: lookups read it.
        """
        if self.backend.name == "triton":   # its batch-invariant Triton linear reads the dense weights
            release_dense = False
        for layer in self.layers:
            pack_projections(layer, release_dense)
        self.packed.get("lm_head", self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        self.choose_kernels()  # for the weights as packed (released ones are empty now)

    def weight_bytes(self) -> int:
        """Bytes of every weight this model (this rank's part) holds: parameters (empty once released for
        their packed copies), packed copies, 4-bit forms and copies, the 8-bit head copy (the loader's count)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters()) + self.packed.nbytes()
        for layer in self.layers:
            total += layer.packed.nbytes() + sum(q.nbytes for q in layer.int4.values())
            total += sum(copy.nbytes for copy, _, _ in layer.q4_copy.values())
        return total + (self.lm_head_q8.nbytes if self.lm_head_q8 is not None else 0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 logits
        (unrounded sums with the C linear kernel; elsewhere the model dtype's
        rounding, cast: ``engine.layers.linear.head_method``), capped by
        ``final_logit_softcapping`` when set (Gemma 2: ``cap * tanh(logits /
        cap)``, in float32). Over several ranks each computes its vocabulary
        rows' logits and the driver gets them all (``gather_vocab``); the
        other ranks get None."""
        logits = self._logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits if self.tp is None else gather_vocab(self.tp, logits, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], q4_copy: bool = False) -> None:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight``...)
        into the fused parameters, this rank's part of each only
        (``engine/models/weight_loading.py``: a GGUF's 4-bit blocks, a
        GPTQ/AWQ/W4A16 ``Int4Weight`` or an ``FP8Weight`` kept packed where
        its whole fused projection is), and choose the kernels for them.

        Raises:
            ValueError: an unexpected name or shape, or parameters left unloaded.
        """
        load_hf_weights(self, weights, q4_copy)
        self.choose_kernels()
