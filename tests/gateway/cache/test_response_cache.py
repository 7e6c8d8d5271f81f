"""The response cache through the gateway, with a co-located engine (a tiny random Llama, float32) and the official
``openai`` SDK: a hit equals the recomputation (tokens, logprobs, text, usage), streamed and not, ``n = 2``,
greedy and seeded; unseeded sampled requests bypass it unless the route assigns seeds; ``Cache-Control``
bypasses it; a hit is billed at the route's cache price; a corrupted entry found by a spot-check switches the key
space off. Stores' bounds and the Redis/in-process twins: ``test_store.py``."""

from __future__ import annotations

import logging

import msgspec
import openai
import pytest

from gateway.cache.key import exact_space, tokens_of
from gateway.sse import EventReader
from tests.gateway.backends.test_local import tiny_model  # noqa: F401 -- the module-scoped fixture
from tests.gateway.support import serve_app, serve_ready

pytestmark = pytest.mark.slow


def config(model: str, redis_url: str | None = None) -> str:
    state = f"state: {{redis_url: '{redis_url}'}}\n" if redis_url else ""
    return (state + "reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            "models:\n  - name: tiny\n  - name: tiny-seeded\n  - {name: tiny-m, cache: {mode: exact}}\n"
            "backends:\n  local:\n    type: local\n    prices: {input: 1, output: 2}\n"
            f"    engine: {{model: '{model}', served_model_name: tiny, dtype: float32, device: cpu,"
            " kv_cache_memory: 32MiB, max_model_len: 512, num_threads: 1}\n"
            "routes:\n"
            "  main:\n    targets: [{backend: local}]\n"
            "    cache: {mode: exact, verify_fraction: 1.0, prices: {input: 0.5, output: 0.5}}\n"
            "  seeded:\n    targets: [{backend: local}]\n    cache: {mode: exact, assign_seed: true}\n"
            "  plain:\n    targets: [{backend: local}]\n"
            "policy:\n  default_route: main\n"
            "  rules: [{name: seeded, match: {model: tiny-seeded}, route: seeded},\n"
            "          {name: plain, match: {model: tiny-m}, route: plain}]\n")


async def started(model: str, redis_url: str | None = None):
    from gateway.config.compile import load_config_text
    from gateway.runtime import Gateway

    gw = Gateway(None, load_config_text(config(model, redis_url)), start_engine=True)
    server, task, url = await serve_ready(gw)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return gw, server, task, client


async def ask(client, gw, body: dict, headers: dict | None = None):
    """(x-tandem-cache, the answer's tokens, the raw HTTP response) of one chat completion."""
    raw = await client.chat.completions.with_raw_response.create(**body, extra_headers=headers or {})
    if body.get("stream"):
        reader, events = EventReader(), []
        reader.feed(b"".join([c async for c in raw.http_response.aiter_bytes()]))
        while (item := reader.pop()) is not None:
            if item[1] != b"[DONE]":
                events.append(msgspec.json.decode(item[1]))
    else:
        events = [msgspec.json.decode(raw.http_response.content)]
    await gw.cache.drain()
    return raw.headers.get("x-tandem-cache"), tokens_of(events), raw, events


MSGS = [{"role": "user", "content": "hello there"}]
CASES = {
    "greedy": dict(temperature=0, max_tokens=12, logprobs=True, top_logprobs=2),
    "seeded_n2": dict(temperature=1.0, seed=7, n=2, max_tokens=12, logprobs=True, top_logprobs=2),
}


async def test_hit_equals_recompute_streamed_and_not(tiny_model, caplog):  # noqa: F811
    gw, server, task, client = await started(tiny_model)
    try:
        by_model = dict(model="tiny-m", messages=MSGS, max_tokens=3, temperature=0)   # a model's cache: on a
        assert [(await ask(client, gw, by_model))[0] for _ in range(2)] == ["miss", "hit"]   # route without one
        for stream in (False, True):
            for name, params in CASES.items():
                body = dict(model="tiny", messages=MSGS, stream=stream, **params)
                if stream:
                    body["stream_options"] = {"include_usage": True}
                first, t1, _, _ = await ask(client, gw, body)
                hit, t2, raw, events = await ask(client, gw, body)
                fresh, t3, _, _ = await ask(client, gw, body, {"cache-control": "no-cache"})
                assert (first, hit, fresh) == ("miss", "hit", "bypass"), (name, stream)
                assert t1 == t2 == t3, (name, stream)
                assert len(t2) == 1 + (2 if "n" in params else 1) and t2[0]["logprobs"] and t2[-1]["usage"][1]
                assert raw.headers["x-tandem-backend"] == "cache" and raw.headers["x-tandem-attempts"] == "0"
                assert {e["id"] for e in events} == {"chatcmpl-" + raw.headers["x-request-id"]}
                assert {e["model"] for e in events} == {"tiny"}
        # unseeded sampled: not cached; no-store: neither read nor written
        sampled = dict(model="tiny", messages=MSGS, max_tokens=4)
        assert [(await ask(client, gw, sampled))[0] for _ in range(2)] == ["bypass", "bypass"]
        store = dict(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
        assert (await ask(client, gw, store, {"cache-control": "no-store"}))[0] == "bypass"
        assert (await ask(client, gw, store))[0] == "miss"
        # the ledger: a hit is billed at the route's cache price (0.5 $/M in and out), not the backend's
        _, _, raw, _ = await ask(client, gw, store)
        rec = (await gw.usage.records("anonymous"))[raw.headers["x-request-id"]]
        assert rec.backend == "cache" and rec.completion_tokens == 5
        assert rec.nusd == (rec.prompt_tokens + rec.completion_tokens) * 500
        # a corrupted entry: served once, then the spot-check (verify_fraction 1) switches the key space off
        space = gw.cache.store._space(exact_space("main", gw.snapshot.local.engine.system_fingerprint))
        key, (expires, value) = next(reversed(space.entries.items()))
        entry = msgspec.json.decode(value)
        entry["body"] = entry["body"].replace('"content":"', '"content":"X', 1)
        space.entries[key] = (expires, msgspec.json.encode(entry).decode())
        with caplog.at_level(logging.ERROR, logger="tandem.gateway.cache"):
            assert (await ask(client, gw, store))[0] == "hit"
        assert "spot-check mismatch" in caplog.text and '"content":"X' in caplog.text
        assert (await ask(client, gw, store))[0] == "bypass"
        assert gw.obs.registry.get_sample_value("tandem_cache_mismatches_total", {"route": "main"}) == 1
        assert gw.obs.registry.get_sample_value("tandem_cache_lookups_total", {"route": "main", "outcome": "hit"}) > 4
    finally:
        server.should_exit = True
        await task


async def test_assigned_seed_and_redis_store(tiny_model, redis_url):  # noqa: F811
    """``assign_seed``: an unseeded sampled request gets a seed derived from itself (``x-tandem-seed``), so it is
    cached and its hit equals the same request sent with that seed explicitly; entries shared through Redis
    survive a second gateway."""
    gw, server, task, client = await started(tiny_model, redis_url)
    body = dict(model="tiny-seeded", messages=[{"role": "user", "content": "redis"}], max_tokens=8, logprobs=True)
    try:
        first, t1, raw1, _ = await ask(client, gw, body)
        seed = int(raw1.headers["x-tandem-seed"])
        explicit = (await ask(client, gw, {**body, "seed": seed}, {"cache-control": "no-store"}))[1]
    finally:
        server.should_exit = True
        await task
    gw2, server, task, client = await started(tiny_model, redis_url)
    try:
        hit, t2, raw2, _ = await ask(client, gw2, body)
    finally:
        server.should_exit = True
        await task
    assert (first, hit) == ("miss", "hit") and raw2.headers["x-tandem-seed"] == str(seed)
    assert t1 == t2 == explicit


async def test_a_big_bodys_exact_key_is_rendered_off_the_event_loop(tiny_model):  # noqa: F811
    """An exact key is of the engine's rendering of the prompt; with no rule reading ``prompt_tokens`` the request
    was not rendered for routing, and the cache rendered it on the event loop (a security trial's 4 MB bodies held
    it 2.5 s each, every tenant waiting). A body from ``OFFLOAD_BYTES`` on is rendered in a worker thread, after
    admission; the answer is the same miss, then hit."""
    import threading

    import httpx

    from gateway.offload import OFFLOAD_BYTES

    gw, server, task, client = await started(tiny_model)
    local = gw.snapshot.local
    threads: list[int] = []
    render = local.render

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        return render(*args, **kwargs)

    local.render = recorded
    body = msgspec.json.encode(dict(model="tiny", messages=MSGS, max_tokens=3, temperature=0))
    raw = body[:-1] + b" " * OFFLOAD_BYTES + b"}"           # big in bytes, short in tokens
    try:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as c:
            got = [await c.post("chat/completions", content=raw, headers={"content-type": "application/json"})
                   for _ in range(2)]
            await gw.cache.drain()
    finally:
        server.should_exit = True
        await task
    assert [r.headers.get("x-tandem-cache") for r in got] == ["miss", "hit"], [r.text for r in got]
    assert len(threads) == 2 and threading.get_ident() not in threads


async def test_best_effort_caches_an_upstream_answer_labelled():
    """``mode: best_effort``: an upstream's answer is cached (keyed by the body), labelled as such; ``exact``
    never caches an upstream's, and a route that has no local target is warned of."""
    from gateway.config.compile import load_config_text
    from gateway.http.app import create_app
    from gateway.runtime import Gateway
    from tests.gateway.support import FaultInjectorUpstream

    up = FaultInjectorUpstream().start()
    cfg = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
           f"models:\n  - name: m\n  - name: e\nbackends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n"
           "routes:\n  be:\n    targets: [{backend: up}]\n    cache: {mode: best_effort}\n"
           "  ex:\n    targets: [{backend: up}]\n    cache: {mode: exact}\n"
           "policy:\n  default_route: be\n  rules: [{name: ex, match: {model: e}, route: ex}]\n")
    compiled = load_config_text(cfg)
    # an ops trial: exact on a route with no local target was accepted silently, every request a bypass
    assert compiled.warnings == ["routes.ex.cache: the route has no local target: exact mode caches only the local "
                                 "engine's answers; every request bypasses the cache (mode: best_effort caches any "
                                 "backend's)"]
    gw = Gateway(None, compiled, start_engine=False)
    server, task, url = await serve_app(create_app(gw))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        body = dict(model="m", messages=MSGS, max_tokens=5)
        got = [await ask(client, gw, body) for _ in range(2)]
        exact = [(await ask(client, gw, {**body, "model": "e", "temperature": 0}))[0] for _ in range(2)]
    finally:
        server.should_exit = True
        await task
        up.stop()
    assert [g[0] for g in got] == ["miss", "hit"] and got[0][1] == got[1][1]
    assert got[1][2].headers["x-tandem-cache-mode"] == "best_effort" and len(up.calls) == 3
    assert exact == ["bypass", "bypass"]              # exact mode: the local engine's answers only
    # a hit called no backend: attempt "none" (an SRE's trial read a hit as an "initial" attempt)
    hit = {"model": "m", "route": "be", "backend": "cache", "status": "200", "tenant": "anonymous"}
    assert gw.obs.registry.get_sample_value("tandem_requests_total", {**hit, "attempt": "none"}) == 1
    assert gw.obs.registry.get_sample_value("tandem_requests_total", {**hit, "attempt": "initial"}) is None


async def test_a_hit_has_tool_call_ids_of_its_own():
    """OpenAI's tool call ids are unique per call: an ops trial's cache hits replayed the first answer's ``call_…``
    ids (and, translated, its ``toolu_…`` ids). A hit's calls are the recorded ones under ids of its own request,
    each call's one id on every streamed piece."""
    from gateway.config.compile import load_config_text
    from gateway.http.app import create_app
    from gateway.runtime import Gateway
    from tests.gateway.fault_upstream import FaultUpstream

    with FaultUpstream("up") as up:
        up.set_default({"tool_call": True})
        cfg = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: "
               f"false}}\nmodels:\n  - name: m\nbackends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n"
               "routes:\n  be:\n    targets: [{backend: up}]\n    cache: {mode: best_effort}\npolicy:\n"
               "  default_route: be\n")
        gw = Gateway(None, load_config_text(cfg), start_engine=False)
        server, task, url = await serve_app(create_app(gw))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        try:
            runs = {stream: [await ask(client, gw, dict(model="m", messages=MSGS, max_tokens=5, stream=stream))
                             for _ in range(2)] for stream in (False, True)}
        finally:
            server.should_exit = True
            await task
    for stream, (first, hit) in runs.items():
        assert (first[0], hit[0]) == ("miss", "hit"), stream

        def calls(events):
            return [(c.get("id"), c["function"]) for e in events for ch in e["choices"]
                    for c in (ch.get("delta") or ch.get("message") or {}).get("tool_calls") or ()]

        was, now = calls(first[3]), calls(hit[3])
        assert [f for _, f in was] == [f for _, f in now] and was, stream        # the same calls
        ids = {i for i, _ in now if i}
        assert len(ids) == 1 and ids.isdisjoint({i for i, _ in was}), (stream, was, now)   # one id, a new one
