"""Read a Hugging Face model directory: ``config.json`` + ``*.safetensors``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.model_config import ModelConfig


def hf_model_config(path: str) -> ModelConfig:
    """ModelConfig from ``<path>/config.json``.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: unparseable JSON, unknown architecture, missing keys.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no such file (a HF model directory needs config.json)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: invalid JSON ({e})") from None
    try:
        return ModelConfig.from_hf_config(cfg, name=Path(path).resolve().name)
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None


def hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every ``*.safetensors`` file in ``path``.

    Raises:
        FileNotFoundError: no safetensors file.
        ValueError: an unreadable safetensors file.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors are supported)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except Exception as e:  # safetensors raises SafetensorError, OSError
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
