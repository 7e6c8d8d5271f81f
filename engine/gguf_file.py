"""Open a GGUF file (llama.cpp's format) with the ``gguf`` package's reader, over a plain array.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. ``gguf.GGUFReader`` slices its
``np.memmap`` once or twice per metadata element, and each slice of a ``memmap`` subclass pays
``memmap.__array_finalize__``: for SmolLM2's 98,369 vocabulary and merge strings that was 2.2 s of a 6.4 s
engine start (cProfile: 990,000 ``__array_finalize__`` calls). :class:`_PlainArrayReader` keeps the same
mapping as a plain ``np.ndarray`` view (the mapping stays open through the view's ``base``), so the reader
parses the same bytes into the same fields and tensors in 0.67 s.
"""

from __future__ import annotations

import os

import gguf
import numpy as np


class _PlainArrayReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` whose ``data`` (the file's bytes, uint8, memory-mapped read-only) is a plain
    ndarray view of the reader's ``np.memmap``; fields and tensors are the package's own."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def open_gguf(path: str) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` for ``path`` (its ``fields`` and ``tensors`` as the package reads them).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable GGUF file (bad magic, truncated...).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _PlainArrayReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct/numpy errors
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
