"""Load a model, its tokenizer and its shape from a ``.gguf`` file or a HF directory."""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.worker.device import configure_core_threads, resolve_device, resolve_dtype
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``): the
    float32 copies made while dequantizing, the dense weights replaced by
    4-bit ones or freed once packed for the C linear kernel, otherwise stay
    in the process's RSS (70-230 MiB for SmolLM2).
    A no-op where glibc is absent."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def import_loader_modules() -> None:
    """Import what loading a model imports (the readers, the tokenizer, the C kernels' libraries), so that a
    measure of resident memory taken after this and after the load counts the weights, not the imports
    (``ModelRunner.memory_report``)."""
    from engine.model_loader import gguf_loader, hf  # noqa: F401
    from engine import tokenizer  # noqa: F401
    from kernels import cpu_attention, cpu_linear, cpu_norm_act

    cpu_linear.available(), cpu_norm_act.available(), cpu_attention.available()


def _size_on_disk(path: str) -> int:
    """Bytes of a model file, or of the files of a model directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file()) if os.path.isdir(path) else 0


_PROGRESS_EVERY_S = 2.0  # seconds between two "loading weights" log lines


def _logged(weights, t0: float):
    """The ``(name, tensor)`` iterator, logging the weights read so far (MB,
    seconds since ``t0``) every ``_PROGRESS_EVERY_S`` and once at the end."""
    read, tensors, last = 0, 0, time.perf_counter()
    for name, value in weights:
        read += getattr(value, "nbytes", 0) or getattr(getattr(value, "data", None), "nbytes", 0)
        tensors += 1
        now = time.perf_counter()
        if now - last >= _PROGRESS_EVERY_S:
            logger.info("loading weights: %d tensors, %.0f MB in %.1f s", tensors, read / 2**20, now - t0) if read \
                else logger.info("loading weights: %d tensors in %.1f s", tensors, now - t0)
            last = now
        yield name, value
    if read:
        logger.info("weights read: %d tensors, %.0f MB in %.1f s", tensors, read / 2**20, time.perf_counter() - t0)
    else:   # not read yet when yielded: a tensor-parallel rank reads its part of each
        logger.info("weights read: this rank's part of %d tensors in %.1f s", tensors, time.perf_counter() - t0)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place (vLLM's ``load_format="dummy"``): normal(0,
    0.02) matrices, zero biases, unit norms; drawn on the model's device.
    Meant for speed checks of real shapes without their files."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _read_model(path: str, dummy: bool, keep_int4: bool, quantization: str = "none", lazy: bool = False):
    """(model config, tokenizer, weight iterator or None for dummy weights) of a
    HF directory or a .gguf file; the config's EOS/BOS default to the tokenizer's.
    A quantized HF checkpoint's layers come as one weight each, packed where the
    4-bit kernels read them (``engine.quantization``). With ``lazy`` the weights
    come unread, for a tensor-parallel rank to read its part of each (a
    quantized checkpoint's layers are read whole, then split: ``narrow``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsupportedQuantization: a quantization the engine does not implement.
    """
    from engine.gguf_file import open_gguf
    from engine.model_loader.gguf_loader import gguf_model_config, gguf_weights
    from engine.model_loader.hf import hf_model_config, hf_weights
    from engine.quantization import get_quantization_config

    if os.path.isdir(path):
        config = hf_model_config(path)
        quant = get_quantization_config(path, quantization)
        weights = None if dummy else hf_weights(path, lazy=lazy and quant is None)
        if quant is not None:
            logger.info("checkpoint quantization %s (%s)", quant.name, quant)
            weights = weights if weights is None else quant.quantized_weights(weights)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif os.path.isfile(path):
        reader = open_gguf(path)
        config = gguf_model_config(reader, path)
        tokenizer = Tokenizer.from_gguf(path, reader=reader)
        weights = gguf_weights(reader, config, path, keep_int4=keep_int4, lazy=lazy)
        if not config.name:
            config.name = os.path.basename(path).removesuffix(".gguf")
    else:
        raise FileNotFoundError(f"model {path!r}: no such file or directory")
    if config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return config, tokenizer, weights


def read_model_config(path: str) -> ModelConfig:
    """The model config of a HF directory (``config.json``) or a ``.gguf`` file (its metadata), reading no
    weights: what a tensor-parallel driver checks its split against before it starts the other ranks.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    from engine.gguf_file import open_gguf
    from engine.model_loader.gguf_loader import gguf_model_config
    from engine.model_loader.hf import hf_model_config

    if os.path.isdir(path):
        return hf_model_config(path)
    if os.path.isfile(path):
        return gguf_model_config(open_gguf(path), path)
    raise FileNotFoundError(f"model {path!r}: no such file or directory")


def _log_quantized(model, quantization: str, dtype: torch.dtype) -> None:
    """Log what a GGUF's quantized weights became: projections computed from their 4-bit codes
    (quantization gguf), or bfloat16 weights with the codes kept beside them for decode steps of a few
    sequences (quantization none; same outputs, fewer bytes read) and what those copies cost."""
    from kernels import cpu_linear

    int4 = sum(len(layer.int4) for layer in model.layers)
    copies = sum(len(layer.q4_copy) for layer in model.layers)
    if int4:
        logger.info("%d projections kept packed and computed from their codes (4-bit, int8 or FP8; no dense %s "
                    "copy)", int4, dtype)
    if copies or model.lm_head_q8 is not None:
        mib = sum(packed.nbytes for layer in model.layers for packed, _, _ in layer.q4_copy.values()) / 2**20
        head = model.lm_head_q8
        when = (f"for every step (integer dots, {cpu_linear.quant_body()}: outputs within the inputs' 8-bit "
                "rounding, the same for any batch; these layers' bits are the same on AVX2 and AVX-512 machines, "
                "the model's answers not: its attention and bfloat16 layers differ)" if cpu_linear.integer_copies()
                else f"for decode steps of up to {cpu_linear.COPY_MAX_ROWS} sequences (same outputs, fewer bytes)")
        logger.info("weights in %s (quantization %s); the engine also keeps the GGUF's 4-bit codes of %d "
                    "projections (+%.0f MiB)%s and reads them instead %s", dtype, quantization, copies, mib,
                    "" if head is None else f" and the 8-bit output head (+{head.nbytes / 2**20:.0f} MiB)", when)


def _linear_path() -> str:
    """Which body runs the bfloat16 linear layers on this CPU, and why (the start-up log's words)."""
    from kernels import cpu_linear

    isa = cpu_linear.isa()
    if cpu_linear.available():
        widened = "bfloat16 weights widened to float32 in registers; " if isa == "avx2" else ""
        amx = "; AMX tile multiplies for calls of 16 rows or more, the same bits" if cpu_linear.uses_amx() else ""
        return f"C (kernels/csrc, {isa} body: {widened}GGUF 4-bit/8-bit weights by integer dot products on " \
            f"8-bit-rounded inputs, as llama.cpp, {cpu_linear.quant_body()}{amx})" if cpu_linear.integer_copies() else \
            f"C (kernels/csrc, {isa} body)"
    why = "the C library does not build here" if isa is None else \
        "this CPU has neither AVX512-BF16 nor AVX2/FMA; the portable C body is slower"
    return f"oneDNN ({why})"


def _check_source(path: str, quantization: str, dummy: bool, device: torch.device) -> None:
    """Refuse a quantization or load format the model at ``path`` cannot have (``load_model``'s ValueErrors)."""
    if quantization != "gguf" and quantization != "none" and not os.path.isdir(path):
        raise ValueError(f"quantization {quantization!r} needs a HF checkpoint directory (got a file)")
    if quantization == "gguf" and (os.path.isdir(path) or device.type != "cpu"):
        raise ValueError("quantization 'gguf' needs a .gguf model on CPU "
                         f"(got {'a HF directory' if os.path.isdir(path) else 'device ' + str(device)})")
    if dummy and not os.path.isdir(path):
        raise ValueError("load_format 'dummy' needs a HF directory (config.json + tokenizer.json)")


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (built on the meta device) given empty storage on ``device`` in ``dtype``.

    Raises:
        MemoryError: the weights do not fit, naming their size.
    """
    try:
        # converted on meta (no float32 copy is allocated), then given storage by a factory: ``to_empty``'s
        # ``empty_like`` of a meta tensor runs PyTorch's Python reference, whose import (sympy) took ~0.5 s
        return model.to(dtype)._apply(
            lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    except (torch.OutOfMemoryError, RuntimeError) as e:
        n = sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8
        raise MemoryError(
            f"the model's weights ({n / 2**30:.2f} GiB in {dtype}) do not fit on {device}: {e}; "
            "use a smaller dtype (--dtype bfloat16) or another device"
        ) from None


def load_model(args, tp=None) -> tuple[torch.nn.Module, Tokenizer, ModelConfig]:
    """Build the model described by ``args.model`` on ``args.device`` in ``args.dtype``
    (with ``tp``, a ``TensorParallelGroup``: this rank's part of it, on ``tp.device``,
    reading only that part of each tensor from the file).

    ``args.model`` is a ``.gguf`` file (``registry.GGUF_ARCHITECTURES``) or a HF
    directory (config.json + *.safetensors + tokenizer.json; an architecture
    of ``engine.models.registry.HF_ARCHITECTURES``). Sets
    the core's threads (``engine/worker/device.py``). With
    ``args.quantization == "gguf"`` a GGUF's Q4_0/Q4_1 projections stay in 4
    bits (``engine/layers/quant_linear.py``); with ``args.load_format ==
    "dummy"`` a HF directory's weights are not read but drawn at random
    (:func:`init_dummy_weights`).

    Returns:
        (model in eval mode, tokenizer, model config).

    Raises:
        FileNotFoundError: the path or a needed file is missing.
        ValueError: corrupt file, unsupported architecture or tensor type;
            quantization "gguf" with a HF directory or off CPU, a HF
            method with a file; load_format "dummy" with a GGUF file; a checkpoint
            quantization the engine does not implement
            (``engine.quantization.UnsupportedQuantization``).
        MemoryError: the weights do not fit on the device.
    """
    from engine.models.registry import model_class

    configure_core_threads(getattr(args, "num_threads", None))
    path = args.model
    dtype = resolve_dtype(args.dtype)
    device = resolve_device(args.device) if tp is None else tp.device
    t0 = time.perf_counter()
    quantization = getattr(args, "quantization", "none")
    dummy = getattr(args, "load_format", "auto") == "dummy"
    _check_source(path, quantization, dummy, device)
    size_mb = _size_on_disk(path) / 2**20
    logger.info("loading model %s (%.0f MB on disk, %s) on %s in %s", path, size_mb,
                "random weights" if dummy else "gguf" if os.path.isfile(path) else "HF safetensors", device, dtype)
    from kernels import cpu_linear, get_attention_backend

    # quantization "none" from a GGUF, bfloat16 on CPU: the 4-bit projections are also kept in
    # 4 bits for the C kernel's few-row calls (the same bits; engine/models/llama.py, q4_copy)
    q4_copy = quantization == "none" and os.path.isfile(path) and device.type == "cpu" \
        and dtype == torch.bfloat16 and cpu_linear.q4_available()
    config, tokenizer, weights = _read_model(path, dummy, keep_int4=quantization == "gguf" or q4_copy,
                                             quantization=quantization, lazy=tp is not None)
    if args.chat_template_source is not None:
        tokenizer = tokenizer.with_chat_template(args.chat_template_source)
    from engine.distributed.shard_plan import plan_shard

    shard = plan_shard(config, tp.rank, tp.world_size) if tp is not None else plan_shard(config)

    backend = get_attention_backend(getattr(args, "attention_backend", "auto"), device,
                                    batch_invariant=getattr(args, "batch_invariant", True), dtype=dtype,
                                    heads=(shard.num_heads, shard.num_kv_heads, config.head_dim))
    logger.info("attention backend %s%s", backend.name, "" if device.type != "cpu" or dtype != torch.bfloat16 else
                f", linear layers {_linear_path()}")
    with torch.device("meta"):
        model = model_class(config.architecture)(config, backend, tp=tp)
    model = _materialize(model, device, dtype)
    if weights is None:
        init_dummy_weights(model, getattr(args, "seed", 0))
    else:
        model.load_weights(_logged(weights, t0), q4_copy=q4_copy)
        _log_quantized(model, quantization, dtype)
    model.build_rope_cache()
    model.eval()
    model.requires_grad_(False)
    release_freed_memory()
    logger.info("loaded %s (%s, %d layers) on %s in %s in %.1f s%s", config.name, config.architecture,
                config.num_hidden_layers, device, dtype, time.perf_counter() - t0,
                "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.world_size}: {shard.num_heads} "
                f"of {config.num_attention_heads} heads, {shard.num_kv_heads} of {config.num_key_value_heads} KV "
                f"heads, {shard.intermediate.size} of {config.intermediate_size} MLP rows, vocabulary rows "
                f"{shard.vocab.start}-{shard.vocab.stop})")
    return model, tokenizer, config
