"""The ``dtype`` values vLLM takes, as this engine names them: read by ``EngineArgs`` (``LLM(dtype=...)``) and the
``--dtype`` flag, so the aliases are one rule (as ``engine/quantization_names.py`` is for ``--quantization``)."""

from __future__ import annotations

# vLLM's other spellings of --dtype
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_name(value) -> str:
    """A ``dtype`` as vLLM takes it, as this engine's name: "half" is "float16", "float" "float32" (the CLI's and
    ``LLM(dtype=...)``'s aliases), a ``torch.dtype`` (``torch.bfloat16``) its name; other values as given (then
    checked by ``EngineArgs``). Reads a torch dtype without importing torch."""
    text = str(value)
    if text.startswith("torch."):   # torch.bfloat16, torch.float16 (torch.half), torch.float32 (torch.float)
        text = text.removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)
