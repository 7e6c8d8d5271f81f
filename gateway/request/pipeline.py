"""The request path: authenticate -> parse and check -> resolve the model ->
decide (policy) -> forward (attempt loop). HTTP glue lives in
``gateway/http/app.py``; this module knows nothing about Litestar.

Rate limits (RPM/TPM per virtual key and tenant, ``gateway/resilience/layer.py``)
are checked once the model is known, before any backend is called; metrics
and traces wrap ``handle``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.request.auth import authenticate, bearer
from gateway.errors import ClientError
from gateway.backends.dispatch import Call, Outcome, forward
from gateway.request.validate import check_request, estimate_prompt_tokens, parse_json
from policies import Decision, RequestFeatures, decide


@dataclass
class Handled:
    """What the HTTP layer relays: the outcome plus routing facts for headers."""

    outcome: Outcome
    decision: Decision
    tenant: str
    public_model: str


async def handle(gw, endpoint: str, raw: bytes, headers: Mapping[str, str], request_id: str) -> Handled:
    """Serve one chat/completion request on the config generation current at
    its arrival.

    Args:
        gw: the ``gateway.runtime.Gateway``.
        endpoint: "chat/completions" or "completions".
        raw: the request body, bytes.
        headers: lower-case header names -> values.
        request_id: the gateway's id for this request.

    Raises:
        ClientError: 400/401/404, or 429 (503 fail-closed) from the rate
            limits, before any backend is called.
    """
    snap = gw.snapshot
    compiled = snap.compiled
    tenant = authenticate(headers.get("authorization"), compiled.key_hashes)
    body = parse_json(raw)
    p = check_request(body, endpoint, headers.get("x-priority"))
    public = compiled.model_names.get(p.model)
    if public is None:
        raise ClientError(404, f"The model '{p.model}' does not exist; available: "
                          f"{', '.join(compiled.public_models)}", param="model", code="model_not_found")
    prompt_tokens = None
    if snap.needs_prompt_tokens:
        local = snap.local
        if local is not None and local.available:
            prompt_tokens = local.count_prompt_tokens(body)
        if prompt_tokens is None:
            prompt_tokens = estimate_prompt_tokens(body)
    features = RequestFeatures(
        model=public, priority=p.priority, prompt_tokens=prompt_tokens, tenant=tenant, has_tools=p.has_tools,
        has_response_format=p.has_response_format, headers=headers, metadata=p.metadata, user=p.user,
        request_id=request_id, stream=p.stream, max_tokens=p.max_tokens)
    decision = decide(compiled.policy, features, snap.signals())
    if p.local_unsupported and decision.attempts:
        first = snap.backends.get(decision.attempts[0].backend)
        if first is not None and first.kind == "local":
            raise ClientError(400, f"'{p.local_unsupported}' is not supported by the local engine and no routing "
                              f"rule sends such requests to an upstream", param=p.local_unsupported,
                              code="unsupported_parameter")
    res = gw.resilience
    estimated = prompt_tokens if prompt_tokens is not None else estimate_prompt_tokens(body)
    tokens = res.estimate_tokens(estimated, p.max_tokens)
    gw.obs.note(request_id, tenant, public, p, decision, estimated)   # labels and trace facts
    # Rate limits before the budget: a request they reject must not hold a budget reservation.
    admission = await res.admit(tenant, bearer(headers.get("authorization")), tokens, request_id)
    if not admission.allowed:
        err = admission.error_body()["error"]
        raise ClientError(admission.status, err["message"], code=err["code"], headers=admission.headers())
    hook = await gw.obs.admit(request_id, tenant, p, decision, estimated)   # budget (429)
    call = Call(endpoint, body, public, request_id, p.priority, p.stream, p.local_unsupported, estimated, tokens)
    call.attempt_hook = hook
    outcome = await forward(decision.attempts, snap.backends, call, res, admission.reservation)
    outcome.headers.update(admission.headers())
    return Handled(outcome, decision, tenant, public)
