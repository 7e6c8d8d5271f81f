"""The response cache of the request pipeline (a route's ``cache:``): decides whether a request may be served
from it (``plan``), serves a hit (``lookup``), keeps a miss's answer (``keep``) and spot-checks hits in the
background (a mismatch switches the key space off, raises ``tandem_cache_mismatches_total`` and logs both
answers). Entries live in ``gateway/cache/store.py`` (Redis when ``state.redis_url`` is set, else in process).

A hit is an ``Answer`` from backend ``cache`` (the ledger charges the route's ``cache.prices``, default 0), its
``id``, ``model`` and tool call ids those of the request it answers; a stream is replayed event by event as it was recorded (its
``ChatEvent`` values, stored as they were read: the usage event included, which observability drops when the client
did not ask for it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

import msgspec

from gateway.backends.relabel import answer_id, relabel_json
from gateway.cache.key import cache_config, cache_key, exact_space, is_sampled, tokens_of
from gateway.cache.store import Bounds, CacheStore
from gateway.config.schema import CacheConfig
from gateway.offload import off_loop
from gateway.state import now_ms
from gateway.translate.chat_events import chunk_object
from gateway.values import Answer, ChatEvent, ChatStream, GatewayRequest

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

    async def plan(self, snap, req: GatewayRequest, route: str, attempts: list, headers: Mapping[str, str],
                   size: int = 0) -> CachePlan | None:
        """How ``req``, routed to ``route`` whose first target is ``attempts[0]``, uses the route's cache; None
        when the route does not cache. Exact mode needs the co-located engine as the first target and a greedy or
        seeded request (or ``assign_seed``: the gateway then chooses the seed, a hash of the request, and says it
        in ``x-tandem-seed``); its key is of the engine's rendering of the prompt, made off the event loop for a
        body of ``size`` bytes from ``gateway.offload.OFFLOAD_BYTES`` on (a security trial's 4 MB bodies held
        the loop 2.5 s each)."""
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
            rendered = req.rendered
            if rendered is None:
                rendered = await off_loop(size, local.render, req.endpoint, req.body)
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
        outcome, entry = "bypass", None
        if p.lookup:
            status, value = await self.store.get(p.space, p.key, now_ms())
            if status == "off":
                p.store = False
            else:
                outcome = status
            if status == "hit":
                try:
                    entry = _decode_entry(value)
                except (msgspec.DecodeError, msgspec.ValidationError):   # an entry of another format: recomputed
                    outcome = "miss"
        self._count(p.route, outcome)
        p.headers["x-tandem-cache"] = outcome
        if entry is None:
            return None
        if p.cfg.verify_fraction and random.random() < p.cfg.verify_fraction:
            self._spawn(self._verify(p, entry, recompute))
        return _replay(entry, p.req), entry.usage or {}

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

    async def _put(self, p: CachePlan, entry: "Entry | None") -> None:
        if entry is None:
            return
        bounds = Bounds(int(p.cfg.ttl_s * 1000), p.cfg.max_entries, p.cfg.max_bytes)
        try:
            await self.store.put(p.space, p.key, _encode(entry).decode(), now_ms(), bounds)
        except Exception as e:  # noqa: BLE001 -- a cache that cannot store costs a recomputation, never an answer
            log.warning("cache store on route %s failed: %s", p.route, e)

    async def _recording(self, p: CachePlan, it: ChatStream) -> ChatStream:
        events: list[ChatEvent] = []
        exhausted = False
        try:
            async for batch in it:
                events += batch
                yield batch
            exhausted = True
        finally:
            aclose = None if exhausted else getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
        if events and events[-1].done and not any(e.error for e in events):
            self._spawn(self._put(p, _stream_entry(events)))

    async def _verify(self, p: CachePlan, entry: Entry, recompute: Callable[[], Awaitable[Answer]]) -> None:
        try:
            answer = await recompute()
            events = None
            if answer.stream is not None:
                events = [ev async for batch in answer.stream for ev in batch]
        except Exception as e:  # noqa: BLE001 -- a failed recomputation proves nothing either way
            log.info("cache spot-check on route %s not made: %s", p.route, e)
            return
        if answer.status != 200:
            return
        fresh = _json_entry(answer.content) if events is None else _stream_entry(events)
        if fresh is None or _tokens(fresh) == _tokens(entry):
            return
        await self.store.switch_off(p.space)
        if self.metrics is not None:
            self.metrics.child(self.metrics.cache_mismatches, p.route).inc()
        log.error("cache spot-check mismatch on route %s (key space %s switched off), request %s:\ncached: %s\n"
                  "recomputed: %s", p.route, p.space, p.req.request_id, _text(entry), _text(fresh))


class Entry(msgspec.Struct):
    """A stored answer: ``kind`` ``json`` (``body``: the JSON answer as its backend returned it) or ``events``
    (a stream's ``ChatEvent``s, ``[DONE]`` last), and its ``usage``."""

    kind: str
    body: str = ""
    events: list[ChatEvent] = []
    usage: dict | None = None


_decode_entry = msgspec.json.Decoder(Entry).decode


def _json_entry(content: bytes) -> Entry | None:
    try:
        body = _decode(content)
    except msgspec.DecodeError:
        return None
    return Entry("json", body=content.decode(), usage=body.get("usage") if isinstance(body, dict) else None)


def _stream_entry(events: list[ChatEvent]) -> Entry:
    usage = None
    for e in events:
        usage = e.usage or usage
    return Entry("events", events=events, usage=usage)


def _text(entry: Entry) -> str:
    """An entry's answer as it was sent: the JSON body, or the stream's events one per line."""
    return entry.body if entry.kind == "json" else "\n".join(_encode(e).decode() for e in entry.events)


def _tokens(entry: Entry) -> dict:
    if entry.kind == "json":
        return tokens_of([_decode(entry.body)])
    return tokens_of([chunk_object(e) for e in entry.events if not e.done])


def fresh_call_id(request_id: str, call_id: str) -> str:
    """A cached answer's tool call id as the id of request ``request_id``'s own call: OpenAI's call ids are unique
    per call (an ops trial's hits replayed the first answer's), and every piece of one call keeps one id."""
    return "call_" + hashlib.sha256(f"{request_id}:{call_id}".encode()).hexdigest()[:24]


def _fresh_ids(ev: ChatEvent, request_id: str) -> ChatEvent:
    """``ev`` with its tool calls' ids made ``request_id``'s (``fresh_call_id``); unchanged without one."""
    if not any(t.id for c in ev.choices for t in c.tool_calls):
        return ev
    put = msgspec.structs.replace
    return put(ev, choices=tuple(put(c, tool_calls=tuple(put(t, id=fresh_call_id(request_id, t.id)) if t.id else t
                                                         for t in c.tool_calls)) for c in ev.choices))


def _replay(entry: Entry, req: GatewayRequest) -> Answer:
    if entry.kind == "json":
        content = relabel_json(entry.body.encode(), answer_id(req.endpoint, req.request_id), req.public_model)
        if b'"tool_calls"' in content:
            body = _decode(content)
            for choice in body.get("choices") or ():
                for call in (choice.get("message") or {}).get("tool_calls") or ():
                    if call.get("id"):
                        call["id"] = fresh_call_id(req.request_id, call["id"])
            content = _encode(body)
        return Answer(200, content, backend=CACHE_BACKEND)

    async def events():
        for ev in entry.events:
            yield [_fresh_ids(ev, req.request_id)]

    return Answer(200, stream=events(), content_type="text/event-stream", backend=CACHE_BACKEND)
