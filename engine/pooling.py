"""Pooling: embeddings from a decoder's final hidden states, as vLLM's pooling runner makes them.

A prompt's hidden states are the model's own forward (``LlamaForCausalLM.forward``: final-normed, the states
``compute_logits`` reads). A pooling request is scheduled as a prompt like any other (``Request.pooling_params``):
prefilled in chunks under the step's token budget, in steps shared with decoding rows, so that a long input never
holds the running streams for its whole forward pass. The model runner hands back the rows of each chunk that
pooling reads (``rows_needed``); the engine core pools them when the last chunk has run. The engine's kernels are
batch- and chunk-invariant (a row's hidden state does not depend on the other rows of its step nor on where the
prompt was cut), so the vector equals the prompt's unchunked one bit for bit. Pooling reduces the states to one
vector:

- ``LAST``: the last token's state (vLLM's default for ``*ForCausalLM`` models run as embedders),
- ``MEAN``: the mean over the prompt's tokens,
- ``CLS``: the first token's state,

in float32, then L2-normalized when ``normalize`` (vLLM's default). The model's own pooling config, when it has
one (sentence-transformers' ``modules.json`` naming a ``Pooling`` module and whether a ``Normalize`` follows),
sets both, as vLLM reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config keys -> our pooling types, in vLLM's order of precedence
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's hidden states become its embedding (vLLM's ``PoolingParams``, as ``LLM.embed`` and
    ``LLM.encode`` take it): ``pooling_type`` (``POOLING_TYPES``) and ``normalize`` (L2, to unit length), each None
    for the model's own (``model_pooling_params``; what the engine pools with is always resolved); vLLM's
    ``dimensions`` (a matryoshka model's shorter vector: refused by ``engine.input_checks.dimensions_problem``,
    no model here is one).

    Raises:
        ValueError: an unknown ``pooling_type``."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


# the default of a model without a pooling config: vLLM's for a *ForCausalLM model run as an embedder
_DEFAULT = PoolingParams("LAST", True)


def model_pooling_params(model_dir: str | None) -> PoolingParams:
    """The model's own pooling config (sentence-transformers ``modules.json`` -> ``<Pooling path>/config.json``
    and a ``Normalize`` module), else the default (``LAST``, normalized). ``model_dir``: an HF directory (a
    ``.gguf`` file or None has no such config). Both fields are set."""
    if not model_dir or not Path(model_dir).is_dir():
        return _DEFAULT
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return _DEFAULT
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith("Normalize") for t in types)
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
            try:
                cfg = json.loads((root / m.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                break
            for key, kind in _ST_MODES:
                if cfg.get(key):
                    return PoolingParams(kind, normalize)
            break
    return PoolingParams("LAST", normalize) if normalize else _DEFAULT


def rows_needed(params: PoolingParams, start: int, end: int, num_tokens: int) -> tuple[int, int]:
    """The positions ``[lo, hi)`` of a chunk ``[start, end)`` of a ``num_tokens`` prompt whose hidden states
    ``pool`` reads (empty when ``lo == hi``): every one for ``MEAN``, the first for ``CLS``, the last for
    ``LAST``. A prompt run in chunks keeps only these, and pools their concatenation as the whole prompt's."""
    if params.pooling_type == "MEAN":
        return start, end
    pos = 0 if params.pooling_type == "CLS" else num_tokens - 1
    return (pos, pos + 1) if start <= pos < end else (start, start)


def pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """One prompt's embedding.

    Args:
        hidden: [num_tokens, hidden_size] final hidden states, any float dtype.
        params: pooling type and normalization.

    Returns:
        [hidden_size] float32.
    """
    h = hidden.float()
    if params.pooling_type == "LAST":
        out = h[-1]
    elif params.pooling_type == "MEAN":
        out = h.mean(dim=0)
    else:
        out = h[0]
    if params.normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=0)
    return out
