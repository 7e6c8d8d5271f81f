"""What a cached answer is keyed by, and what "the same answer" means when a spot-check compares one.

Exact mode (the local engine): the engine's ``system_fingerprint`` (``engine/fingerprint.py``: the model's files,
the engine's build, device, dtype, quantization, attention backend, batch invariance, torch) names the key space;
the key hashes the endpoint, the public model, ``stream``, the rendered prompt's token ids and the body (every
sampling parameter, the seed, tools, response format), less the fields that do not change the tokens
(``VOLATILE_FIELDS``). Greedy and seeded answers are a pure function of that (docs/app-teams/reproducibility.md),
so a hit is the answer the engine would give.

Every key also hashes what a native backend would receive beyond the chat translation (the client's own Responses
or Messages body: ``thinking``, ``reasoning``, ``include``, ``truncation``, ...), and the tenant unless the route
shares its cache across tenants (``cache.scope: route``): a hit tells whoever gets it that someone sent the same
request, so by default only the tenant that sent it can learn that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Body fields that change neither the tokens nor their logprobs: left out of the key. ``stream_options`` only
# says whether the client sees the usage chunk, which the gateway always asks for (and observability drops).
VOLATILE_FIELDS = frozenset({"stream_options", "user", "metadata", "priority", "store", "service_tier", "model"})
# Temperatures below this are greedy (the engine's ``engine/worker/sampler.py`` _SAMPLING_EPS).
GREEDY_EPS = 1e-5


def cache_key(endpoint: str, public_model: str, stream: bool, body: dict, token_ids: list[list[int]] | None,
              source: tuple[str, dict] | None = None, tenant: str | None = None) -> str:
    """The key (sha256 hex) of a request.

    Args:
        body: the chat (or completions) body every backend is sent, translated or not.
        token_ids: per prompt of its rendering (None in best-effort mode).
        source: (API, the client's body) of a request translated onto chat (``GatewayRequest.source``), whose
            native fields a backend that speaks that API receives; None for a chat or completion request.
        tenant: the tenant whose answers the key may find; None when the route shares its cache across tenants
            (``cache.scope: route``).
    """
    native = None if source is None else [source[0], _native(*source)]
    text = json.dumps([endpoint, public_model, bool(stream), token_ids, _kept(body), native, tenant],
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _kept(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}


def _native(api: str, body: dict) -> dict:
    """``body`` of client API ``api`` as keyed: a Responses conversation's items less their ``id`` (the gateway
    names each stored item after the request that sent it; ``call_id`` stays)."""
    kept = _kept(body)
    if api == "responses" and isinstance(kept.get("input"), list):
        kept["input"] = [{k: v for k, v in item.items() if k != "id"} if isinstance(item, dict) else item
                         for item in kept["input"]]
    return kept


def cache_config(config, route: str, model: str):
    """The ``CacheConfig`` that applies to ``model`` on ``route`` (``config``: the ``GatewayConfig``): the
    route's when it caches, else the model's; None when neither does."""
    rcfg = config.routes.get(route)
    if rcfg is not None and rcfg.cache.mode != "off":
        return rcfg.cache
    mcfg = next((m.cache for m in config.models if m.name == model), None)
    return mcfg if mcfg is not None and mcfg.mode != "off" else None


def exact_space(route: str, fingerprint: str) -> str:
    """The key space of a route's exact answers from an engine of ``fingerprint``."""
    return f"{route}:{fingerprint}"


def is_sampled(temperature: float | None) -> bool:
    """True when a request with ``temperature`` (None: the engine's default, 1.0) samples."""
    return temperature is None or temperature >= GREEDY_EPS


def tokens_of(events: list[dict]) -> dict[int, dict[str, Any]]:
    """What a spot-check compares, per choice index, from the decoded JSON answer (one element) or the decoded
    events of a stream: the text, each tool call's name and arguments (by its index), finish reason, the
    per-token logprobs and the usage counts. A stream's chunking and the ids (a tool call's is drawn anew for
    each answer) and timestamps are left out."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if ev.get("usage"):
            u = ev["usage"]
            usage = (u.get("prompt_tokens"), u.get("completion_tokens"))
        for c in ev.get("choices") or []:
            ch = out.setdefault(c.get("index", 0), {"text": "", "tools": {}, "finish": None, "logprobs": []})
            part = c.get("message") or c.get("delta") or {}
            ch["text"] += part.get("content") or c.get("text") or ""
            for pos, call in enumerate(part.get("tool_calls") or []):   # a stream's pieces carry their index
                fn, at = call.get("function") or {}, call.get("index", pos)
                name, args = ch["tools"].get(at, ("", ""))
                ch["tools"][at] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
            ch["finish"] = c.get("finish_reason") or ch["finish"]
            lp = c.get("logprobs") or {}
            if isinstance(lp, dict):
                ch["logprobs"] += lp.get("content") or list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))
    out[-1] = {"usage": usage}
    return out
