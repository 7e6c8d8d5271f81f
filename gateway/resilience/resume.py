"""Streams that outlive their replica (a route's ``resume: true``, docs/operators/replicas.md).

A committed stream whose engine dies (or stalls) after content ends, in ``streaming.relay``, with one
``stream_interrupted`` event. On a resuming route that event is held back: the gateway sends the request again
to the route's next target it has not tried, with ``resume_token_ids`` (the tokens each choice had streamed),
and relays what follows as the same stream. The engine re-prefills the prompt and those tokens and goes on as
the uninterrupted request would have (its seeded draws are by output position: ``engine/worker/sampler.py``), so the
client receives, bit for bit, the text a replica that never failed would have sent.

What makes that possible is asked for up front (``prepare``): ``return_token_ids`` (each streamed choice
carries its token ids; they are removed again when the client did not ask for them) and, for a sampled request
without a seed, a seed the gateway chooses (``x-tandem-seed``). Only Tandem engines (the co-located one,
``tandem engine serve`` replicas) understand both: a route that resumes lists only them. A stream whose events
carried no token ids (an aggregator answered), one with a finished choice, tools, a response format or
``echo``, and a drain's end are cut as before. So is a continuation whose ``system_fingerprint`` is not the
stream's: a replica of another build (an AVX2 host beside AVX-512 ones, another dtype or version) computes
other bits, and would join two answers (a trial's, on a mixed pool); it is closed before any of its events
is sent, and the next target is asked while attempts are left.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import msgspec

from gateway.resilience.streaming import ended_by_shutdown
from gateway.values import ChatEvent, ChatStream, GatewayRequest

log = logging.getLogger("tandem.gateway.resume")
# Temperatures below this are greedy (the engine's sampler): no seed needed.
_GREEDY_EPS = 1e-5


@dataclass
class ResumePlan:
    """How one stream may be resumed: at most ``attempts`` times; ``client_ids``: the client asked for
    ``return_token_ids`` itself (they stay in its events); ``headers`` for the answer (``x-tandem-seed``)."""

    attempts: int
    client_ids: bool
    choices: int
    headers: dict[str, str] = field(default_factory=dict)


def prepare(req: GatewayRequest, route_cfg) -> tuple[GatewayRequest, ResumePlan | None]:
    """``req`` as a resumable stream on a route (``RouteConfig``) with ``resume: true``, and its plan; the request
    unchanged and None when it cannot be resumed."""
    body = req.body
    if route_cfg is None or not route_cfg.resume or not req.stream or req.endpoint != "chat/completions" \
            or req.has_tools or req.has_response_format or body.get("echo") or "resume_token_ids" in body:
        return req, None
    plan = ResumePlan(route_cfg.resume_attempts, bool(body.get("return_token_ids")), int(body.get("n") or 1))
    updates: dict = {"return_token_ids": True}
    temperature = body.get("temperature")
    if body.get("seed") is None and (temperature is None or temperature >= _GREEDY_EPS):
        updates["seed"] = secrets.randbits(63)        # sampled: the continuation must draw the same
        plan.headers["x-tandem-seed"] = str(updates["seed"])
    return _with(req, updates), plan


def _with(req: GatewayRequest, updates: dict) -> GatewayRequest:
    """``req`` with ``updates`` in its body and in the rendering the local engine runs."""
    rendered = req.rendered
    if rendered is not None:
        rendered = replace(rendered, request=msgspec.structs.replace(rendered.request, **updates))
    return replace(req, body={**req.body, **updates}, rendered=rendered)


async def resumable(stream: ChatStream, backend: str, plan: ResumePlan, req: GatewayRequest,
                    call: Callable[[GatewayRequest, list[str]], Awaitable],
                    on_resumed: Callable[[str, str], None] = lambda failed, backend: None) -> ChatStream:
    """``stream`` (a committed answer from ``backend``) as the client sees it, resumed after an interruption by
    ``call(continuation, backends that failed)`` (the dispatch's ``forward`` on the route's other targets) at most
    ``plan.attempts`` times; ``on_resumed(the backend cut, the one going on)`` is told each time (observability's
    ``resumed``)."""
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    failed, left = [backend], plan.attempts
    fingerprint: str | None = None   # the stream's build, from the first event that names one
    cut = None                       # the interruption a continuation replaces
    announce = None                  # (cut, going on): told on_resumed at the continuation's first event taken
    while True:
        interrupted = foreign = None
        exhausted = False
        try:
            async for batch in stream:
                out = []
                for ev in batch:
                    if fingerprint and ev.system_fingerprint and ev.system_fingerprint != fingerprint:
                        foreign = ev.system_fingerprint   # another build's bits: none of its events is sent
                        break
                    fingerprint = fingerprint or ev.system_fingerprint
                    if announce is not None:
                        on_resumed(*announce)
                        announce = None
                    if left > 0 and _resumable(ev, tokens, finished):
                        interrupted = ev
                        break
                    out.append(_note(ev, tokens, finished, plan.client_ids))
                if out:
                    yield out
                if interrupted is not None or foreign is not None:
                    break
            exhausted = foreign is None
        finally:
            if not exhausted:
                await stream.aclose()
        if foreign is not None:
            log.warning("request %s: stream not resumed on %s: its system_fingerprint %s is not the stream's %s "
                        "(another build computes other bits)", req.request_id, failed[-1], foreign, fingerprint)
            if left <= 0:
                yield [cut]
                return
        elif interrupted is None:
            return
        else:
            cut = interrupted
        left -= 1
        body = {"resume_token_ids": [list(tokens.get(i, ())) for i in range(plan.choices)]}   # copies: they grow on
        answer = await call(_with(req, body), failed)
        if answer.status != 200 or answer.stream is None:
            log.warning("request %s: stream not resumed (%s): %s", req.request_id, answer.status,
                        answer.content[:200])
            yield [cut]
            return
        log.info("request %s: stream resumed on %s after %s tokens (%s failed)", req.request_id, answer.backend,
                 sum(len(t) for t in tokens.values()), ", ".join(failed))
        announce = (failed[-1], answer.backend)
        failed.append(answer.backend)
        stream = answer.stream


def _resumable(ev: ChatEvent, tokens: dict, finished: set) -> bool:
    """True for the ``stream_interrupted`` event of a stream that can go on elsewhere: every choice open, each
    with the token ids it streamed (a drain's end is not a replica's failure)."""
    err = ev.error
    if not isinstance(err, dict) or err.get("code") != "stream_interrupted":
        return False
    return bool(tokens) and not finished and not ended_by_shutdown(err)


def _note(ev: ChatEvent, tokens: dict, finished: set, client_ids: bool) -> ChatEvent:
    """Record an event's token ids and finished choices; the event for the client (ids removed unless asked)."""
    stripped = False
    for c in ev.choices:
        if c.token_ids is not None:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            stripped = not client_ids
        if c.finish_reason:
            finished.add(c.index)
    if not stripped:
        return ev
    return msgspec.structs.replace(ev, choices=tuple(msgspec.structs.replace(c, token_ids=None)
                                                     for c in ev.choices))
