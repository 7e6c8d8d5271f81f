"""``select: prefix_affinity``: choose among engine replicas by prefix-cache affinity and load.

Affinity by consistent hashing with bounded load, not by a per-gateway index of who served which prefix: every
gateway replica computes the same ranking from the request alone, so replicas sharing nothing (not even Redis)
send a conversation to the same engine replica, and a gateway restart loses nothing. An index would need
sharing (one Redis round trip per request) to agree, and would only know what this gateway routed.

- Key: a hash of the prompt's leading text blocks (``prefix_key``). The gateway has no tokenizer of remote
  replicas, so the blocks are text chunks of ``block_chars`` characters (64 ~ 16 tokens, an engine block), not
  token blocks. A chat prompt's hashed prefix ends with its first user message: the system prompt and the first
  question, which every later turn of the conversation repeats, so all turns get the same key (and the same
  replica, whose prefix cache holds the earlier turns' prompt blocks).
- Ranking: weighted rendezvous hashing (Thaler & Ravishankar 1998; weighted form as in ``policies/routes.py``):
  score_i = w_i / -ln(u_i), u_i = sha256(key, replica id) in (0, 1); the highest score is the key's home.
- Bounded load (Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018): a
  replica accepts a request while load_i + 1 <= ceil(load_factor * (L + 1) * w_i / W), L the total load of the
  live replicas and W their total weight, and its KV cache is below ``max_kv_usage``. The request goes to the
  first replica in score order that accepts (over the bound: spill to the next best); none accepts: the home.
  Loads (running + waiting requests, KV usage) come from the replicas' ``vllm:*`` metrics, polled by the gateway
  and updated with its own in-flight counts between polls (``gateway/backends/replicas.py``).
- A replica whose metrics cannot be read (dead) is ranked after the live ones; open breakers are skipped by the
  attempt loop, which tries the ranked replicas in order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Affinity:
    """Settings of a ``prefix_affinity`` route.

    prefix_blocks: text blocks hashed at most. block_chars: characters per block. load_factor: c >= 1 of the
    load bound. max_kv_usage: a replica at or above this KV-cache usage (0..1) takes no new prefix.
    """

    prefix_blocks: int = 8
    block_chars: int = 64
    load_factor: float = 1.25
    max_kv_usage: float = 0.95

    def __post_init__(self) -> None:
        if self.prefix_blocks < 1 or self.block_chars < 1:
            raise ValueError("prefix_blocks and block_chars must be >= 1")
        if self.load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as the gateway sees it: ``running`` + ``waiting`` requests (the last ``/metrics`` read
    plus this gateway's in-flight change since), ``kv_usage`` 0..1, ``alive`` (its metrics answered)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    alive: bool = True

    @property
    def load(self) -> float:
        return self.running + self.waiting


def prefix_text(body: dict) -> str:
    """The leading text a request's prefix key hashes: a chat's messages up to and including the first user
    message (role and content), or a completion's prompt ("" when neither)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                break
            content = m.get("content")
            if isinstance(content, list):   # content parts: their text
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role')}\x1f{content or ''}\x1e")
            if m.get("role") == "user":
                break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else ""
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt or []))


def prefix_key(text: str, a: Affinity) -> str:
    """sha256 hex (16 digits) of the first ``prefix_blocks`` blocks of ``text`` (the last one may be short)."""
    return hashlib.sha256(text[:a.prefix_blocks * a.block_chars].encode()).hexdigest()[:16]


def _unit(key: str, target_id: str) -> float:
    digest = hashlib.sha256(f"{key}\x00{target_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11 | 1) / float(1 << 53)


@dataclass
class AffinityChoice:
    """``ranked``: targets in the order to try them (the choice first). ``home``: the top-scoring target.
    ``scores``: rendezvous score per target id. ``spilled``: target id -> why it lost its affinity."""

    ranked: list
    home: object
    scores: dict[str, float]
    spilled: dict[str, str]
    bound: dict[str, float]


def choose(targets: list, key: str, loads: dict[str, ReplicaLoad], a: Affinity) -> AffinityChoice:
    """Rank ``targets`` (``policies.Target``, weight > 0) for prefix key ``key`` (see the module docstring).

    loads: target id -> its load (absent: idle and alive)."""
    scores = {t.id: t.weight / -math.log(_unit(key, t.id)) for t in targets}
    by_score = sorted(targets, key=lambda t: -scores[t.id])
    load = {t.id: loads.get(t.id, ReplicaLoad()) for t in targets}
    live = [t for t in by_score if load[t.id].alive]
    total = sum(load[t.id].load for t in live)
    weight = sum(t.weight for t in live) or 1.0
    bound = {t.id: max(1.0, math.ceil(a.load_factor * (total + 1) * t.weight / weight)) for t in live}
    spilled: dict[str, str] = {}
    fits, full = [], []
    for t in live:
        lt = load[t.id]
        if lt.load + 1 > bound[t.id]:
            spilled[t.id] = f"load {lt.load:g} + 1 > bound {bound[t.id]:g}"
        elif lt.kv_usage >= a.max_kv_usage:
            spilled[t.id] = f"KV cache {100 * lt.kv_usage:.0f} % >= {100 * a.max_kv_usage:.0f} %"
        (full if t.id in spilled else fits).append(t)
    dead = [t for t in by_score if not load[t.id].alive]
    for t in dead:
        spilled[t.id] = "metrics unreachable (dead?)"
    return AffinityChoice(fits + full + dead, by_score[0], scores, spilled, bound)
