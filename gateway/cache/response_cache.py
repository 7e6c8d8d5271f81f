"""The response cache of the request pipeline (a route's ``cache:``): decides whether a request may be served
from it (``plan``), serves a hit (``lookup``), keeps a miss's answer (``keep``) and spot-checks hits in the
background (a mismatch switches the key space off, raises ``tandem_cache_mismatches_total`` and logs both
answers). Entries live in ``gateway/cache/store.py`` (Redis when ``state.redis_url`` is set, else in process).

A hit is an ``Answer`` from backend ``cache`` (the ledger charges the route's ``cache.prices``, default 0), its
``id`` and ``model`` those of the request it answers; a stream is replayed event by event as it was recorded
(the usage chunk included: observability drops it when the client did not ask for it).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

import msgspec

from gateway.values import Answer
from gateway.backends.relabel import answer_id, relabel_json, relabel_stream
from gateway.cache.key import cache_config, cache_key, exact_space, is_sampled, tokens_of
from gateway.cache.store import Bounds, CacheStore
from gateway.config.schema import CacheConfig
from gateway.values import GatewayRequest
from gateway.sse import EventReader, event
from gateway.state import now_ms

log = logging.getLogger("tandem.gateway.cache")

CACHE_BACKEND = "cache"          # the backend a hit is reported and billed as
_decode = msgspec.json.decode
_encode = msgspec.json.encode


@dataclass
class CachePlan:
    """One request's dealings with its route's cache: ``req`` (with the seed the gateway chose, if any),
    ``space`` and ``key`` (empty: bypassed), whether to look up and to store, ``local``: the local backend whose
    answers an exact entry may hold ("" in best-effort mode), and the ``headers`` to add to the answer."""

    route: str
    cfg: CacheConfig
    req: GatewayRequest
    space: str = ""
    key: str = ""
    lookup: bool = False
    store: bool = False
    local: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class ResponseCache:
    """The gateway's response cache over ``store``; ``metrics``: ``GatewayMetrics`` (or None)."""

    def __init__(self, store: CacheStore, metrics=None):
        self.store = store
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    def plan(self, snap, req: GatewayRequest, route: str, attempts: list,
             headers: Mapping[str, str]) -> CachePlan | None:
        """How ``req``, routed to ``route`` whose first target is ``attempts[0]``, uses the route's cache; None
        when the route does not cache. Exact mode needs the co-located engine as the first target and a greedy or
        seeded request (or ``assign_seed``: the gateway then chooses the seed, a hash of the request, and says it
        in ``x-tandem-seed``)."""
        cfg = cache_config(snap.compiled.config, route, req.public_model)
        if cfg is None:
            return None
        p = CachePlan(route, cfg, req, headers={"x-tandem-cache": "bypass"})
        control = (headers.get("cache-control") or "").lower()
        if "no-store" in control or req.endpoint not in ("chat/completions", "completions"):
            return p
        tenant = None if cfg.scope == "route" else req.tenant
        if cfg.mode == "best_effort":
            p.space = f"{route}:best_effort"
            p.key = cache_key(req.endpoint, req.public_model, req.stream, req.body, None, req.source, tenant)
            p.headers["x-tandem-cache-mode"] = "best_effort"
        else:
            local = snap.local
            if local is None or not local.available or not attempts or attempts[0].backend != local.name:
                return p
            rendered = req.rendered if req.rendered is not None else local.render(req.endpoint, req.body)
            if rendered is None:
                return p
            body = req.body
            if is_sampled(rendered.request.temperature) and rendered.request.seed is None:
                if not cfg.assign_seed:
                    return p
                # derived from the request, not drawn: the same unseeded request gets the same seed, so it hits
                seed = int(cache_key(req.endpoint, req.public_model, req.stream, body, None)[:15], 16)
                body = {**body, "seed": seed}
                rendered = replace(rendered, request=msgspec.structs.replace(rendered.request, seed=seed))
                p.headers["x-tandem-seed"] = str(seed)
            p.req = req = replace(req, body=body, rendered=rendered)
            p.space = exact_space(route, local.engine.system_fingerprint)
            p.key = cache_key(req.endpoint, req.public_model, req.stream, body, [ids for _, ids in rendered.prompts],
                              req.source, tenant)
            p.local = local.name
        p.lookup, p.store = "no-cache" not in control, True
        return p

    async def lookup(self, p: CachePlan, recompute: Callable[[], Awaitable[Answer]]) -> tuple[Answer, dict] | None:
        """The cached answer of ``p`` and its usage, or None (a miss, or bypassed); sets ``p.headers``. A hit is
        spot-checked with probability ``verify_fraction`` by ``recompute`` (the request sent to its route)."""
        outcome = "bypass"
        if p.lookup:
            status, value = await self.store.get(p.space, p.key, now_ms())
            if status == "off":
                p.store = False
            else:
                outcome = status
        self._count(p.route, outcome)
        p.headers["x-tandem-cache"] = outcome
        if outcome != "hit":
            return None
        entry = _decode(value)
        if p.cfg.verify_fraction and random.random() < p.cfg.verify_fraction:
            self._spawn(self._verify(p, entry, recompute))
        return _replay(entry, p.req), entry.get("usage") or {}

    def keep(self, p: CachePlan, answer: Answer) -> Answer:
        """``answer`` to a miss, stored once complete when it may be (a 200 from the local engine in exact
        mode, from any backend in best-effort mode; a stream only when it ended normally)."""
        if not p.store or answer.status != 200 or (p.local and answer.backend != p.local):
            return answer
        if answer.stream is None:
            self._spawn(self._put(p, _json_entry(answer.content)))
        else:
            answer.stream = self._recording(p, answer.stream)
        return answer

    async def drain(self) -> None:
        """Wait for the stores and spot-checks in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- internals ---------------------------------------------------------------------------------------------
    def _count(self, route: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.child(self.metrics.cache_lookups, route, outcome).inc()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, p: CachePlan, entry: dict | None) -> None:
        if entry is None:
            return
        bounds = Bounds(int(p.cfg.ttl_s * 1000), p.cfg.max_entries, p.cfg.max_bytes)
        try:
            await self.store.put(p.space, p.key, _encode(entry).decode(), now_ms(), bounds)
        except Exception as e:  # noqa: BLE001 -- a cache that cannot store costs a recomputation, never an answer
            log.warning("cache store on route %s failed: %s", p.route, e)

    async def _recording(self, p: CachePlan, it: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        reader, events, exhausted = EventReader(), [], False
        try:
            async for chunk in it:
                reader.feed(chunk)
                while (item := reader.pop()) is not None:
                    events.append(item[1])
                yield chunk
            exhausted = True
        finally:
            aclose = None if exhausted else getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
        if events and events[-1] == b"[DONE]" and not any(_is_error(e) for e in events):
            self._spawn(self._put(p, _sse_entry(events)))

    async def _verify(self, p: CachePlan, entry: dict, recompute: Callable[[], Awaitable[Answer]]) -> None:
        try:
            answer = await recompute()
            content = answer.content
            if answer.stream is not None:
                content = b"".join([chunk async for chunk in answer.stream])
        except Exception as e:  # noqa: BLE001 -- a failed recomputation proves nothing either way
            log.info("cache spot-check on route %s not made: %s", p.route, e)
            return
        if answer.status != 200:
            return
        fresh = _json_entry(content) if answer.stream is None else _sse_entry(_payloads(content))
        if fresh is None or _tokens(fresh) == _tokens(entry):
            return
        await self.store.switch_off(p.space)
        if self.metrics is not None:
            self.metrics.child(self.metrics.cache_mismatches, p.route).inc()
        log.error("cache spot-check mismatch on route %s (key space %s switched off), request %s:\ncached: %s\n"
                  "recomputed: %s", p.route, p.space, p.req.request_id, _text(entry), _text(fresh))


def _json_entry(content: bytes) -> dict | None:
    try:
        body = _decode(content)
    except msgspec.DecodeError:
        return None
    return {"kind": "json", "body": content.decode(), "usage": body.get("usage") if isinstance(body, dict) else None}


def _sse_entry(events: list[bytes]) -> dict:
    usage = None
    for e in events:
        if e.startswith(b"{") and b'"usage"' in e:
            usage = _decode(e).get("usage") or usage
    return {"kind": "sse", "events": [e.decode() for e in events], "usage": usage}


def _payloads(stream: bytes) -> list[bytes]:
    reader = EventReader()
    reader.feed(stream)
    out = []
    while (item := reader.pop()) is not None:
        out.append(item[1])
    if (item := reader.tail()) is not None:
        out.append(item[1])
    return out


def _is_error(payload: bytes) -> bool:
    if not payload.startswith(b"{") or b'"error"' not in payload:
        return False
    try:
        return "error" in _decode(payload)
    except msgspec.DecodeError:
        return True


def _text(entry: dict) -> str:
    """An entry's answer as it was sent: the JSON body, or the stream's event payloads one per line."""
    return entry["body"] if entry["kind"] == "json" else "\n".join(entry["events"])


def _tokens(entry: dict) -> dict:
    if entry["kind"] == "json":
        return tokens_of([_decode(entry["body"])])
    return tokens_of([_decode(e) for e in entry["events"] if e != "[DONE]"])


def _replay(entry: dict, req: GatewayRequest) -> Answer:
    id_ = answer_id(req.endpoint, req.request_id)
    if entry["kind"] == "json":
        content = relabel_json(entry["body"].encode(), id_, req.public_model)
        return Answer(200, content, backend=CACHE_BACKEND)

    async def events():
        for payload in entry["events"]:
            yield event(payload.encode())

    return Answer(200, stream=relabel_stream(events(), id_, req.public_model), content_type="text/event-stream",
                  backend=CACHE_BACKEND)
