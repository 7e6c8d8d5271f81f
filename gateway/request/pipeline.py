"""The request path, one way: authenticate -> validate (the one ``GatewayRequest``) -> decide (policy) ->
admit (rate limits, budget) -> forward (attempt loop) -> ``Answer``. HTTP glue lives in ``gateway/http/``; this
module knows nothing about Litestar. Observability is told what happened (``note``, ``admitted``, the attempt
hook) and decides nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from engine.protocol.errors import ENGINE_LOADING_RETRY_AFTER_S
from gateway.backends.dispatch import forward
from gateway.backends.relabel import answer_id
from gateway.billing.local_cost import local_price, running_cost
from gateway.errors import ClientError, error_body, model_not_found
from gateway.offload import off_loop
from gateway.request.admission import admit
from gateway.request.validate import (check_request, counted_exactly, parse_json, prompt_counts,
                                      unknown_parameter_error, with_default_max_tokens)
from gateway.resilience.resume import prepare as prepare_resume
from gateway.resilience.resume import resumable
from gateway.translate.anthropic import messages_to_chat
from gateway.translate.anthropic_render import MessagesRender
from gateway.translate.chat_events import ChatRender
from gateway.translate.responses import to_chat
from gateway.translate.responses_checks import check_body
from gateway.translate.responses_items import input_items
from gateway.values import Answer, GatewayRequest
from policies import RequestFeatures, decide, prefix_text, tenant_label


# How a request's chat body is made to fit a context: (the prompt's token budget, a counter of a chat body's prompt
# tokens, None when it cannot count it, the whole body's count when known) -> a shorter chat body, or None to leave
# the request as it is.
Fit = Callable[[int, Callable[[dict], int | None], int | None], dict | None]


def build_request(snap, endpoint: str, raw: bytes, headers: Mapping[str, str], request_id: str,
                  tenant: str | None = None, body: dict | None = None,
                  source: tuple[str, dict] | None = None) -> GatewayRequest:
    """The request value of ``raw`` on config generation ``snap`` (``gateway.snapshot.Snapshot``): its tenant,
    checked body, public model and prompt length (the local engine's rendering, kept for the engine, when a rule
    reads ``prompt_tokens`` and the engine is up; else the estimate). ``tenant``: already authenticated (the
    HTTP layer's), or given by an operator (``tandem route explain``); None: authenticated from ``headers``. ``body``: ``raw`` already decoded (a request
    translated onto chat, ``gateway/http/responses.py``), not decoded again; ``source``: what it was translated
    from (``GatewayRequest.source``).

    Raises:
        ClientError: 400 (bad body), 401 (bad key), 404 (unknown model).
    """
    compiled = snap.compiled
    if tenant is None:
        tenant = snap.authenticate(headers)
    if body is None:
        body = parse_json(raw)
    if endpoint == "messages":      # Anthropic Messages: served as its chat translation
        source, body, endpoint = ("messages", body), messages_to_chat(body), "chat/completions"
    req = check_request(body, endpoint, headers.get("x-priority"), compiled.local_serves, tenant=tenant,
                        request_id=request_id, headers=headers)
    public = compiled.model_names.get(req.model)
    if public is None:
        raise model_not_found(req.model, compiled.public_models)
    rendered = None
    if snap.needs_prompt_tokens and snap.local is not None and snap.local.available:
        rendered = snap.local.render(endpoint, req.body)
    prompt_tokens, longest = prompt_counts(req.body, rendered, snap.local.max_model_len if snap.local else None)
    return replace(req, priority=tenant_priority(req.priority, tenant, compiled.config.limits),
                   public_model=public, prompt_tokens=prompt_tokens, longest_prompt_tokens=longest,
                   rendered=rendered, source=source,
                   prompt_tokens_exact=rendered is not None or counted_exactly(req.body))


EXPLAINED_ENDPOINTS = ("chat/completions", "completions", "embeddings", "messages", "responses")


def explained_form(body: dict, endpoint: str | None = None) -> tuple[str, dict, tuple[str, dict] | None]:
    """A request to explain (``tandem route explain``, ``POST /admin/explain``) in the form the gateway routes:
    (endpoint, body, what it was translated from). ``endpoint`` None: read off the body (``messages``: chat,
    ``prompt``: completions, ``input``: embeddings); Anthropic Messages and Responses bodies are routed as their
    chat translations (a Responses ``previous_response_id``'s earlier turns are not read), as the gateway serves
    them (a policy trial's Messages body was explained as chat, its ``metadata.user_id`` canary key unread).

    Raises:
        ClientError: 400 for an unknown endpoint or a Responses body the gateway would refuse."""
    endpoint = endpoint or ("chat/completions" if "messages" in body else "completions" if "prompt" in body
                            else "embeddings" if "input" in body else "chat/completions")
    if endpoint not in EXPLAINED_ENDPOINTS:
        raise ClientError(400, f"endpoint: expected one of {', '.join(EXPLAINED_ENDPOINTS)}, got {endpoint!r}",
                          param="endpoint", code="invalid_value")
    if endpoint == "messages":
        return "chat/completions", messages_to_chat(body), ("messages", body)
    if endpoint == "responses":
        check_body(body)
        return "chat/completions", to_chat(body, [], input_items(body, "explain")), ("responses", body)
    return endpoint, body, None


def tenant_priority(priority: int, tenant: str, limits) -> int:
    """``priority`` as ``tenant`` may have it: raised to its ``limits.tenants.<t>.min_priority`` when below (a
    security trial's tenant sent ``x-priority`` -9223372036854775808 and jumped every other tenant's queue on the
    engine's ``scheduling_policy: priority``: its first token 3.7 s instead of 18.1 s)."""
    lim = limits.tenants.get(tenant_label(tenant))
    return priority if lim is None or lim.min_priority is None else max(priority, lim.min_priority)


def features(req: GatewayRequest, prefix: bool = False) -> RequestFeatures:
    """The request as the policy sees it."""
    return RequestFeatures(
        model=req.public_model, priority=req.priority, prompt_tokens=req.prompt_tokens,
        longest_prompt_tokens=req.longest_prompt_tokens, tenant=req.tenant,
        has_tools=req.has_tools, has_response_format=req.has_response_format, headers=req.headers,
        metadata=req.metadata, user=req.user, request_id=req.request_id, stream=req.stream,
        max_tokens=req.max_tokens, local_serves=req.local_unsupported is None,
        prefix_text=prefix_text(req.body) if prefix else "")


def _waits_for_engine(snap, route_name: str) -> bool:
    """True when the local engine, one of the route's targets or fallbacks, is still loading its model."""
    local = snap.local
    route = snap.compiled.policy.routes.get(route_name)
    if local is None or not local.loading or route is None:
        return False
    return any(t.backend == local.name for t in (*route.targets, *route.fallbacks))


def served_by_engine(snap, req: GatewayRequest) -> bool:
    """Whether ``req``'s first attempt would be the local engine's now: the policy's decision on ``snap``'s signals,
    the engine passed over for a feature it does not serve (as ``forward`` passes it over). For an endpoint that
    answers for a request without serving it (``/v1/messages/count_tokens``)."""
    if snap.local is None or req.local_unsupported is not None:
        return False
    attempts = decide(snap.compiled.policy, features(req), snap.signals()).attempts
    return bool(attempts) and attempts[0].backend == snap.local.name


async def _any_reachable(resilience, attempts: list) -> bool:
    """True when one of ``attempts`` (targets) was not found down by its backend's last active probe, or, never
    probed yet (the gateway has just started), by one made now (a backend without a probe counts as reachable).
    While the local engine loads, a route whose other targets are all down (a canary arm not started yet, say)
    answers 503 engine_loading rather than a connect error."""
    for backend in {a.backend for a in attempts}:
        probe = await resilience.health.last_probe(backend)
        ok = probe["ok"] if probe is not None else await resilience.prober.probe(backend)
        if ok is None or ok:
            return True
    return False


async def decide_route(gw, req: GatewayRequest, explain: bool = False):
    """The policy's decision for ``req`` now (live engine signals, unusable backends, replica loads, for SLO
    routes the TTFT predictions of the local engine and of the replicas that make one) and whether a route
    selects by prefix affinity; ``explain``: with the decision's trace (``tandem route explain``)."""
    snap = gw.snapshot
    affinity = gw.replicas.tracked      # some route selects by prefix affinity
    signals = snap.signals()
    if affinity:
        signals.replica_load = gw.replicas.loads()
    if snap.compiled.policy.has_slo():
        asked = await gw.latency.ask_replicas(snap, req, skip=signals.unavailable)
        signals.ttft = gw.latency.estimates(snap, req, asked)
    local = snap.local
    if local is not None and local.cfg.cost is not None and local.engine is not None:
        price = local_price(gw, local, time.monotonic())
        signals.prices[local.name] = (price.input, price.output)
    prefix = affinity or snap.compiled.policy.needs_prefix()
    return decide(snap.compiled.policy, features(req, prefix), signals, explain=explain), affinity


async def handle(gw, endpoint: str, raw: bytes, headers: Mapping[str, str], request_id: str, tenant: str,
                 body: dict | None = None, source: tuple[str, dict] | None = None, fit: Fit | None = None) -> Answer:
    """Serve one request on the config generation current at its arrival.

    Args:
        gw: the ``gateway.runtime.Gateway``.
        endpoint: "chat/completions", "completions", "embeddings" or "messages" (Anthropic's; the answer carries
            the ``render`` that turns the chat answer into Messages JSON or events).
        raw: the request body, bytes.
        headers: lower-case header names -> values.
        request_id: the gateway's id for this request.
        tenant: the request's, authenticated once by the HTTP layer (``serve_observed``) before the body was read.
        body: the chat body already decoded from ``raw`` (the Responses API's translation), or None.
        source: (API, body) the chat body was translated from, for upstreams that speak it natively.
        fit: how to shorten the chat body to fit the targets' context (``_fitted``; the Responses API's
            ``truncation: auto``), or None.

    Raises:
        ClientError: 400/401/404, 503 ``engine_loading`` (nothing else can serve it while the local engine loads),
            or 429 (503 fail-closed) from admission, before any backend is called.
    """
    snap = gw.snapshot
    req = await off_loop(len(raw), build_request, snap, endpoint, raw, headers, request_id, tenant, body, source)
    admitted = time.monotonic()   # a hand-over's checkpoint and deadline count from here
    decision, affinity = await decide_route(gw, req)
    route_cfg = snap.compiled.config.routes.get(decision.route)
    if (error := unknown_parameter_error(req, route_cfg)) is not None:
        raise error
    req = _defaulted(snap, req, route_cfg)
    if fit is not None:
        req = _defaulted(snap, await _fitted(snap, req, decision, fit, headers), route_cfg)
    if affinity:
        gw.replicas.note(decision.route, decision.pick)
    if _waits_for_engine(snap, decision.route) and not await _any_reachable(gw.resilience, decision.attempts):
        raise engine_loading()
    gw.obs.note(req, decision)   # labels and trace facts, before admission may refuse
    if (error := _unreachable(snap, req, decision)) is not None:
        raise error
    # admission first: a request its limits or budget refuse costs no exact cache key (the prompt rendered)
    running = running_cost(gw, snap)
    live = {running[1].name: running[0].price} if running is not None else None   # the budget's estimate
    adm = await admit(req, decision.attempts, gw.resilience, gw.usage, snap.compiled.config, live)
    cache = await gw.cache.plan(snap, req, decision.route, decision.attempts, headers, len(raw))   # None: no cache
    if cache is not None:
        req = cache.req                  # with the seed the gateway chose, if it chose one
    req, resume = prepare_resume(req, snap.compiled.config.routes.get(decision.route))   # None: cut on failure
    hook = gw.obs.admitted(request_id, adm.budget, adm.budget_spec)
    if affinity:
        hook = _then(gw.replicas.track, hook)
    if snap.compiled.policy.has_slo():
        hook = _then(gw.latency.track(request_id), hook)
    hit = None
    if cache is not None:
        hit = await gw.cache.lookup(cache, lambda: forward(req, decision.attempts, snap.backends, gw.resilience))
    if hit is not None:
        answer, usage = hit
        await gw.resilience.settle(adm.rate, usage)
    else:
        gw.shadows.offer(snap, gw.rollouts.active, req, decision)   # background copies; the answer never waits
        handover = (decision.pick.handover, admitted) if decision.pick.handover is not None else None
        answer = await forward(req, decision.attempts, snap.backends, gw.resilience, adm.rate, hook, adm.tokens,
                               handover)
        if answer.status >= 500 and answer.stream is None and _waits_for_engine(snap, decision.route):
            answer = _as_engine_loading(answer)    # the engine's core died under this request: it is loading again
        if resume is not None and answer.stream is not None:
            again = _continuation(snap, gw.resilience, decision.attempts, hook)
            answer.stream = resumable(answer.stream, answer.backend, resume, req, again,
                                      lambda failed, backend: gw.obs.resumed(request_id, failed, backend))
        if cache is not None:
            answer = gw.cache.keep(cache, answer)
    answer.headers = {"x-tandem-route": decision.route, "x-tandem-rule": decision.rule,
                      "x-tandem-backend": answer.backend or "none", "x-tandem-attempts": str(answer.attempts),
                      **answer.headers, **adm.headers,   # x-request-id: gateway/http/app.py request_ids
                      **(cache.headers if cache is not None else {}),
                      **(resume.headers if resume is not None else {})}
    answer.render = client_codec(req)
    if decision.pick.reason.startswith("SLO"):   # the numbers the SLO decision was made on
        answer.headers["x-tandem-slo"] = decision.pick.reason
    return answer


def _defaulted(snap, req: GatewayRequest, route_cfg) -> GatewayRequest:
    """``req`` with its route's or model's ``default_max_tokens`` when it sets no ``max_tokens``."""
    if req.max_tokens is not None:
        return req
    return with_default_max_tokens(req, route_cfg, next(
        (m for m in snap.compiled.config.models if m.name == req.public_model), None))


async def _fitted(snap, req: GatewayRequest, decision, fit: Fit, headers: Mapping[str, str]) -> GatewayRequest:
    """``req`` rebuilt on ``fit``'s shorter chat body when its prompt exceeds the smallest context window the
    decision's targets declare (``max_model_len``, less the ``max_tokens`` the answer may take), counted by the
    local engine's tokenizer (in a worker thread: one rendering per try; none when routing's rendering of the whole
    body already fits). Unchanged when no target declares a window, the local engine is not loaded (nothing counts
    exactly), or ``fit`` leaves it."""
    windows = [w for a in decision.attempts if (w := getattr(snap.backends.get(a.backend), "max_model_len", None))]
    local = snap.local
    if not windows or local is None or not local.available:
        return req

    def count(body: dict) -> int | None:
        rendered = local.render(req.endpoint, body)
        return None if rendered is None else rendered.prompt_tokens

    budget, whole = min(windows) - (req.max_tokens or 1), req.prompt_tokens if req.rendered is not None else None
    if whole is not None and whole <= budget:
        return req
    body = await asyncio.to_thread(fit, budget, count, whole)
    if body is None:
        return req
    return build_request(snap, req.endpoint, b"", headers, req.request_id, req.tenant, body, req.source)


def client_codec(req: GatewayRequest):
    """The codec of the client API ``req`` came on, which renders its answer (``Answer.render``): Anthropic's
    Messages (``MessagesRender``) or OpenAI's chat/completions and completions (``ChatRender``, under the gateway's
    answer id and the public model). The Responses API's handler renders its own (``gateway/http/responses.py``)."""
    if req.anthropic_body is not None:
        return MessagesRender.of(req)
    return ChatRender(answer_id(req.endpoint, req.request_id), req.public_model, req.endpoint == "chat/completions")


def engine_loading() -> ClientError:
    """The 503 ``engine_loading`` of a request only the local engine, still loading its model, can serve (with a
    ``Retry-After``: an SDK's retries are how a client waits for it)."""
    return ClientError(503, "The local engine is still loading its model; retry in a few seconds.",
                       code="engine_loading", headers={"retry-after": str(ENGINE_LOADING_RETRY_AFTER_S)})


def _as_engine_loading(answer: Answer) -> Answer:
    """``answer``, every attempt's failure, as ``engine_loading``'s 503 (``Retry-After``, no ``x-should-retry:
    false``): the local engine of the route is loading again after its core died, and a retry in a few seconds is
    served (an SRE trial's clients got a 502 and then 503s telling the SDKs not to retry, for the ~10 s of the
    restart)."""
    e = engine_loading()
    headers = {k: v for k, v in answer.headers.items() if k not in ("x-should-retry", "retry-after")}
    return replace(answer, status=e.status, content=error_body(e.status, e.message, code=e.code),
                   headers={**headers, **e.headers})


def _unreachable(snap, req: GatewayRequest, decision) -> ClientError | None:
    """The refusal of a request no target of ``decision`` can take (``endpoint_error``, ``upstream_only_error``),
    or None."""
    if (error := endpoint_error(req, decision, snap.backends)) is not None or not req.local_unsupported:
        return error
    upstreams = {name: b.unavailable_reason for name, b in snap.backends.items() if b.serves(req)}
    keyless = {name for name in upstreams if snap.backends[name].key_missing}
    return upstream_only_error(req.local_unsupported, decision, snap.compiled.policy.routes.get(decision.route),
                               upstreams, keyless)


def _uncalled(decision) -> dict[str, str]:
    """The ``x-tandem-*`` headers of a refusal after routing, before any backend was called."""
    return {"x-tandem-route": decision.route, "x-tandem-rule": decision.rule, "x-tandem-backend": "none",
            "x-tandem-attempts": "0"}


def endpoint_error(req: GatewayRequest, decision, backends: Mapping) -> ClientError | None:
    """The refusal of a request every target ``decision`` left is a backend that cannot take (``refusal``): a
    ``type: anthropic`` backend takes chat completions (translated) and ``/v1/messages``, so a ``/v1/completions``
    request is OpenAI's 404 for a model its endpoint cannot reach (a trial's requests for such a model got a bare
    503 "No backend of this route is available", the reason in the log), and a chat request asking for what
    Anthropic's API cannot give (``n`` > 1, ``logprobs``...) a 400 naming that field. None when a target can."""
    if not decision.attempts:
        return None
    names = list(dict.fromkeys(a.backend for a in decision.attempts))
    refusals = [r for n in names if (b := backends.get(n)) is not None and (r := b.refusal(req)) is not None]
    if len(refusals) < len(names):
        return None
    param, reason = refusals[0]
    message = f"model '{req.public_model or req.model}' is served on route '{decision.route}' only by " \
              f"{', '.join(names)}: {reason}"
    if req.endpoint not in backends[names[0]].endpoints:      # the reason names the endpoints they take
        return ClientError(404, message, param="model", code="model_not_found", headers=_uncalled(decision))
    return ClientError(400, message, param=param, code="unsupported_parameter", headers=_uncalled(decision))


def upstream_only_error(field: str, decision, route, upstreams: Mapping[str, str],
                        keyless: Collection[str] = ()) -> ClientError | None:
    """The refusal of a request carrying ``field``, which only an upstream serves
    (``GatewayRequest.local_unsupported``), when every target ``decision`` left is the local engine (the attempt
    loop would skip them all); None when an upstream can take it. 400 ``unsupported_parameter`` when the route
    (``policies.Route`` or None) names no upstream, or names only upstreams without an API key (no retry serves
    it until the config gives one: two trials' ``dimensions`` on the shipped config read a 503 as "retry"); 503
    ``no_backend_available`` naming the route, the rule and each upstream's reason when it names some but none is
    available now (with ``x-should-retry: false``, which the openai SDKs obey). Shared by the gateway and
    ``tandem route explain``.

    Args:
        upstreams: every configured upstream (non-local) backend's name -> why it is unavailable ("" if it is not).
        keyless: those of them whose API key variable is unset.
    """
    if not decision.attempts or any(a.backend in upstreams for a in decision.attempts):
        return None
    headers = _uncalled(decision)
    named = [] if route is None else list(dict.fromkeys(
        t.backend for t in (*route.targets, *route.fallbacks) if t.backend in upstreams))
    if not named:
        return ClientError(400, f"'{field}' is not supported by the local engine and route '{decision.route}' "
                           f"(rule '{decision.rule}') sends the request to no upstream; add a rule that routes such "
                           f"requests upstream (e.g. match local.serves: false)", param=field,
                           code="unsupported_parameter", headers=headers)
    reasons = "; ".join(f"{b}: {upstreams[b] or 'unavailable'}" for b in named)
    if all(b in keyless for b in named):
        return ClientError(400, f"'{field}' is not supported by the local engine, and no upstream of route "
                           f"'{decision.route}' (rule '{decision.rule}') that could serve it has an API key "
                           f"({reasons})", param=field, code="unsupported_parameter", headers=headers)
    return ClientError(503, f"'{field}' is not supported by the local engine, and no upstream of route "
                       f"'{decision.route}' (rule '{decision.rule}') is available ({reasons})", param=field,
                       code="no_backend_available", headers={**headers, "x-should-retry": "false"})


def _continuation(snap, resilience, attempts: list, hook):
    """How a resumed stream calls again (``gateway/resilience/resume.py``): ``forward`` on the route's targets
    whose backends have not failed it, each call seen by observability's attempt hook (the request log)."""

    async def call(req: GatewayRequest, failed: list[str]) -> Answer:
        rest = [t for t in attempts if t.backend not in failed]
        return await forward(req, rest, snap.backends, resilience, hook=hook)

    return call


def _then(inner, outer):
    """An attempt hook that applies ``inner`` then ``outer`` (None: ``inner`` alone)."""
    return inner if outer is None else (lambda attempt: outer(inner(attempt)))
