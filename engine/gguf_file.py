"""Open a GGUF file (llama.cpp's format) with the ``gguf`` package's reader, over a plain array.

Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. ``gguf.GGUFReader`` slices its
``np.memmap`` once or twice per metadata element, and each slice of a ``memmap`` subclass pays
``memmap.__array_finalize__``: for SmolLM2's 98,369 vocabulary and merge strings that was 2.2 s of a 6.4 s
engine start (cProfile: 990,000 ``__array_finalize__`` calls). :class:`_PlainArrayReader` keeps the same
mapping as a plain ``np.ndarray`` view (the mapping stays open through the view's ``base``), so the reader
parses the same bytes into the same fields and tensors in 0.67 s; it reads arrays of strings and numbers
per array, not per element (``_PlainArrayReader._get_field_parts``).
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

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        """The package's parts of one value, read per array rather than per element for an array of
        strings (the vocabulary, the merges: each string's length and bytes as ``memoryview`` slices of the
        file, not two numpy views) or of numbers (the token types: one view, sliced per element); what the
        package's ``ReaderField.contents`` and size sums read of the parts (``tobytes()``, ``tolist()``,
        ``nbytes``) is the same. 1.08 -> ~0.3 s for SmolLM2's file (98,369 strings, 49,152 numbers)."""
        value_type = gguf.GGUFValueType
        if raw_type != value_type.ARRAY or self.byte_order == "S":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        n, offs = int(count[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(int(item_type[0]))
        parts: list = [item_type, count]
        if n and nptype is not None:
            values = self._get(offs, nptype, n)
            if len(values) < n:
                raise ValueError(f"an array at byte {orig_offs} runs past the end of the file")
            parts += (values[i:i + 1] for i in range(n))
            return offs + int(values.nbytes) - orig_offs, parts, list(range(2, 2 + n)), [
                value_type.ARRAY, value_type(int(item_type[0]))]
        if not n or item_type[0] != value_type.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf = memoryview(self._data)
        for _ in range(n):
            size = int.from_bytes(buf[offs:offs + 8], "little")
            if offs + 8 + size > len(buf):
                raise ValueError(f"a string at byte {offs} runs past the end of the file")
            parts += (buf[offs:offs + 8], buf[offs + 8:offs + 8 + size])
            offs += 8 + size
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), [value_type.ARRAY, value_type.STRING]


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
