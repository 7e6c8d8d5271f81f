"""A model's recommended sampling defaults: its ``generation_config.json`` read as vLLM reads it (``--generation-config
auto``, vLLM's default; ``ModelConfig.get_diff_sampling_param``), so a checkpoint samples here as under ``vllm
serve``. A request's own value always wins, except ``max_tokens``, which the model's ``max_new_tokens`` caps
(vLLM's ``get_max_tokens``: the smallest of the request's, the context left and the model's)."""

from __future__ import annotations

import json
import os

from engine.protocol.param_ranges import check_param

# The generation-config keys vLLM takes as sampling defaults (``max_new_tokens`` is its ``max_tokens``).
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# transformers' ``GenerationConfig()`` defaults: a key equal to one is not a recommendation (vLLM reads the
# file's ``to_diff_dict()``, which leaves them out).
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


def default_sampling_params(model: str, generation_config: str = "auto",
                            override: dict | None = None) -> dict:
    """The sampling defaults (``SamplingParams`` field -> value) of ``model`` (a HF directory or a ``.gguf``
    file) under ``generation_config``: "auto" (the model directory's ``generation_config.json``; a GGUF has
    none), "vllm" (none: vLLM's own defaults) or a directory holding a ``generation_config.json``; then
    ``override`` (vLLM's ``--override-generation-config``, generation-config keys) on top.

    Raises:
        FileNotFoundError: ``generation_config`` names a directory without ``generation_config.json``.
        ValueError: the file is not a JSON object, a key of ``override`` is not one of ``SAMPLING_KEYS``, or a
            value is not a number or outside the range a request's own value must be in (``param_ranges``: a
            default every request would be refused for, blaming its client, is refused at start instead).
    """
    config: dict = {}
    if generation_config == "auto":
        if os.path.isdir(model):
            config = _read(os.path.join(model, "generation_config.json"), missing_ok=True)
    elif generation_config != "vllm":
        config = _read(os.path.join(generation_config, "generation_config.json"), missing_ok=False)
    config = {k: v for k, v in config.items() if HF_DEFAULTS.get(k, object()) != v}
    for key, value in (override or {}).items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"override_generation_config: {key!r} is not one of {', '.join(SAMPLING_KEYS)}")
        config[key] = value
    out = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation config: {key} must be a number, got {value!r}")
        name = "max_tokens" if key == "max_new_tokens" else key
        if (bad := check_param(name, value)) is not None:
            source = "override_generation_config" if key in (override or {}) else "generation config"
            raise ValueError(f"{source}: {bad.message.replace(repr(name), repr(key))}")
        out[name] = value
    return out


def _read(path: str, missing_ok: bool) -> dict:
    if not os.path.exists(path):
        if missing_ok:
            return {}
        raise FileNotFoundError(f"generation_config: {path} does not exist")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return data
