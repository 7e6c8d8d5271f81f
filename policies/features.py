"""What a policy decides on: a request's features and the live signals.

Both are plain frozen-ish dataclasses built by the gateway per request; the
policy code only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Priority names -> integers, vLLM's convention: a smaller value is served
# first, 0 is the default.
PRIORITY_NAMES = {"high": -1, "normal": 0, "low": 1}


def tenant_label(tenant: str) -> str:
    """The tenant as rules match it and limits, budgets, the ledger and the logs name it: "anonymous" for a
    request without a key (``tenant`` "")."""
    return tenant or "anonymous"


def parse_priority(value: object) -> int:
    """Map a priority (``"high"``/``"normal"``/``"low"``, an int, or an int in
    a string) to an int (vLLM's convention: smaller = more urgent).

    Raises:
        ValueError: anything else; the message names ``priority``.
    """
    if isinstance(value, bool):
        raise ValueError(f"priority must be high, normal, low or an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name in PRIORITY_NAMES:
            return PRIORITY_NAMES[name]
        try:
            return int(name)
        except ValueError:
            pass
    raise ValueError(f"priority must be high, normal, low or an integer, got {value!r}")


@dataclass
class RequestFeatures:
    """One request as a policy sees it.

    Attributes:
        model: the canonical public model name (aliases already resolved).
        priority: int, smaller = more urgent (see ``PRIORITY_NAMES``).
        prompt_tokens: estimated prompt length, tokens, all prompts of a
            batch together (what an SLO prices; None when no rule needs it
            and the gateway did not compute it).
        longest_prompt_tokens: the longest prompt of a batch (each is a
            sequence of its own: a completions prompt list, an embeddings
            input list); the prompt's length otherwise. The rules'
            ``prompt_tokens`` field reads it (None: ``prompt_tokens``).
        tenant: the virtual key's tenant ("" when anonymous).
        has_tools: the body carries ``tools``/``functions``/``tool_choice``.
        has_response_format: the body carries ``response_format``.
        headers: request headers, lower-case names.
        metadata: the body's ``metadata`` object (str -> str).
        user: the body's ``user`` field ("" when absent).
        request_id: the gateway's request id (canary key of last resort).
        stream: the client asked for SSE.
        max_tokens: requested completion limit, tokens (None = unset).
        local_serves: the local engine serves every field of the request
            (False e.g. for ``tools`` when the local backend's
            ``structured_outputs`` leaves them out).
        prefix_text: the prompt's leading text for ``prefix_affinity``
            routes (``policies.affinity.prefix_text``; "" when no route
            needs it).
    """

    model: str
    priority: int = 0
    prompt_tokens: int | None = None
    longest_prompt_tokens: int | None = None
    tenant: str = ""
    has_tools: bool = False
    has_response_format: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, object] = field(default_factory=dict)
    user: str = ""
    request_id: str = ""
    stream: bool = False
    max_tokens: int | None = None
    local_serves: bool = True
    prefix_text: str = ""


@dataclass
class Signals:
    """Live state the policy may react to.

    Attributes:
        local_waiting: requests waiting in the local engine's queue.
        local_running: requests running in the local engine.
        local_kv_usage: local KV-cache usage, percent (0..100).
        unavailable: backend names that must not be chosen (unset API key,
            open circuit breaker, engine not loaded, ...), with the reason.
        replica_load: target id -> ``policies.affinity.ReplicaLoad`` of the
            engine replicas of ``prefix_affinity`` routes.
        ttft: backend name -> ``policies.slo.TTFTEstimate`` of this request
            (only when a rule or route has an ``slo``).
        prices: backend name -> (input, output) USD per million tokens now,
            replacing its configured prices (the local engine's from its cost).
    """

    local_waiting: int = 0
    local_running: int = 0
    local_kv_usage: float = 0.0
    unavailable: dict[str, str] = field(default_factory=dict)
    replica_load: dict = field(default_factory=dict)
    ttft: dict = field(default_factory=dict)
    prices: dict = field(default_factory=dict)
