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


class SafetensorsSlice:
    """One tensor of an open safetensors file, not read yet: ``narrow`` reads only a part of it (a
    tensor-parallel rank's rows or columns). Valid while its file is open (the iterator's next step closes it).
    """

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (1) ``[start, start + length)``, read from the file."""
        part = slice(start, start + length)
        return self._slice[part] if dim == 0 else self._slice[:, part]


def _check_index(path: Path) -> None:
    """Refuse a sharded checkpoint whose index (``model.safetensors.index.json``: tensor name -> shard file)
    names a shard that is not in ``path``: the missing tensors would otherwise be reported by name alone."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e}") from None
    missing = sorted(s for s in shards if not (path / s).is_file())
    if missing:
        raise FileNotFoundError(f"{path}: {', '.join(missing)} listed in {index.name} "
                                f"{'is' if len(missing) == 1 else 'are'} missing")


def hf_weights(path: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | SafetensorsSlice]]:
    """Yield (name, tensor) from every ``*.safetensors`` file in ``path``; with ``lazy``, (name,
    ``SafetensorsSlice``) to be read in part before the next one is asked for.

    Raises:
        FileNotFoundError: no safetensors file, or a shard ``model.safetensors.index.json`` lists is absent.
        ValueError: an unreadable safetensors file or index.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors are supported)")
    _check_index(Path(path))
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, SafetensorsSlice(st, name) if lazy else st.get_tensor(name)
        except Exception as e:  # safetensors raises SafetensorError, OSError
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
