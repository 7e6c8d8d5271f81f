"""Pooling: embeddings from a decoder's final hidden states, as vLLM's pooling runner makes them.

A prompt's hidden states are the model's own forward (``LlamaForCausalLM.forward``: final-normed, the states
``compute_logits`` reads), run by ``ModelRunner.embed`` over that prompt alone, with a KV cache of its own: the
scheduler's pool, block tables and batches are never touched, and a prompt's vector does not depend on what else
runs (batch-invariant by construction). Pooling reduces the states to one vector:

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
    """How a prompt's hidden states become its embedding: ``pooling_type`` (``POOLING_TYPES``) and ``normalize``
    (L2, to unit length)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")


def model_pooling_params(model_dir: str | None) -> PoolingParams:
    """The model's own pooling config (sentence-transformers ``modules.json`` -> ``<Pooling path>/config.json``
    and a ``Normalize`` module), else the default (``LAST``, normalized). ``model_dir``: an HF directory (a
    ``.gguf`` file or None has no such config)."""
    if not model_dir or not Path(model_dir).is_dir():
        return PoolingParams()
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return PoolingParams()
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
    return PoolingParams(normalize=normalize) if normalize else PoolingParams()


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
