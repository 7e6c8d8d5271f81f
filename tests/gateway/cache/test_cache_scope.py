"""Who a cached answer is served to, and what it is keyed by (issue 48, 1-3), through the gateway with real HTTP,
the official ``openai`` and ``anthropic`` SDKs and fault-injecting upstreams: a tenant never hits another tenant's
entry unless the route shares its cache (``cache.scope: route``); a request that came on the Responses or Messages
API is keyed by its native fields too; a hit is never shadowed."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.support import FaultInjectorUpstream, serve_app, sha

KEYS = {"acme": "sk-acme-0123456789", "beta": "sk-beta-0123456789"}
BASE = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n  retry: {max_attempts: 1}\n"
        "observability:\n  logs: {requests: false}\n"
        "auth:\n  keys:\n" + "".join(f"    - {{tenant: {t}, sha256: {sha(k)}}}\n" for t, k in KEYS.items()))
MSGS = [{"role": "user", "content": "what is the capital of France?"}]


class Served:
    """A gateway on ``cfg`` (the upstreams' URLs filled in) with an openai and an anthropic client per tenant."""

    def __init__(self, cfg: str, *upstreams: FaultInjectorUpstream):
        self.cfg, self.upstreams = cfg, upstreams

    async def __aenter__(self):
        self.gw = Gateway(None, load_config_text(self.cfg), start_engine=False)
        self.server, self.task, url = await serve_app(create_app(self.gw))
        self.openai = {t: openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0) for t, k in KEYS.items()}
        self.anthropic = {t: anthropic.AsyncAnthropic(base_url=url, api_key=k, max_retries=0)
                          for t, k in KEYS.items()}
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await self.task
        for up in self.upstreams:
            up.stop()

    async def chat(self, tenant: str, **extra) -> str:
        raw = await self.openai[tenant].chat.completions.with_raw_response.create(
            model="m", messages=MSGS, max_tokens=5, **extra)
        await self.gw.cache.drain()
        return raw.headers["x-tandem-cache"]


def one_route(up: FaultInjectorUpstream, cache: str, extra: str = "") -> str:
    return (BASE + f"models:\n  - name: m\nbackends:\n  up:\n    type: openai\n    base_url: {up.base_url}\n{extra}"
            f"routes:\n  r:\n    targets: [{{backend: up}}]\n    cache: {cache}\npolicy:\n  default_route: r\n")


@pytest.mark.parametrize("scope", [None, "tenant", "route"])
async def test_a_tenant_hits_only_its_own_entries_unless_the_route_shares_them(scope):
    """By default (``scope`` not given: ``tenant``) tenant beta's request for acme's prompt is a miss."""
    up = FaultInjectorUpstream().start()
    cache = "{mode: best_effort}" if scope is None else f"{{mode: best_effort, scope: {scope}}}"
    async with Served(one_route(up, cache), up) as s:
        got = [await s.chat("acme"), await s.chat("beta"), await s.chat("acme"), await s.chat("beta")]
    if scope != "route":
        assert got == ["miss", "miss", "hit", "hit"] and len(up.calls) == 2
    else:      # shared on purpose: beta's first request finds acme's answer
        assert got == ["miss", "hit", "hit", "hit"] and len(up.calls) == 1


async def test_responses_native_fields_are_part_of_the_key():
    """Fields of a Responses request that its chat translation may not carry (a native backend receives them)
    each make a different key; the same request again is a hit."""
    up = FaultInjectorUpstream().start()
    variants = [{}, {"reasoning": {"effort": "high"}}, {"include": ["reasoning.encrypted_content"]},
                {"truncation": "auto"}, {"prompt_cache_key": "conversation-7"}]
    async with Served(one_route(up, "{mode: best_effort}"), up) as s:
        outcomes = []
        for extra in [*variants, variants[1]]:
            raw = await s.openai["acme"].responses.with_raw_response.create(
                model="m", input="what is the capital of France?", max_output_tokens=16, store=False, **extra)
            await s.gw.cache.drain()
            outcomes.append(raw.headers.get("x-tandem-cache"))
    assert outcomes == ["miss"] * len(variants) + ["hit"]


async def test_messages_native_fields_are_part_of_the_key():
    up = FaultInjectorUpstream().start()
    async with Served(one_route(up, "{mode: best_effort}"), up) as s:
        outcomes = []
        for extra in [{}, {"thinking": {"type": "enabled", "budget_tokens": 1024}}, {}]:
            raw = await s.anthropic["acme"].messages.with_raw_response.create(
                model="m", max_tokens=2000, messages=MSGS, **extra)   # above the thinking budget (Anthropic's rule)
            await s.gw.cache.drain()
            outcomes.append(raw.headers.get("x-tandem-cache"))
    assert outcomes == ["miss", "miss", "hit"]


async def test_a_hit_is_never_shadowed():
    """A cache hit calls no upstream: neither the primary it spared nor the shadow candidate."""
    up, cand = FaultInjectorUpstream("up").start(), FaultInjectorUpstream("cand").start()
    extra = f"  cand:\n    type: openai\n    base_url: {cand.base_url}\n"
    cfg = one_route(up, "{mode: best_effort}\n    shadow: {target: cand, percent: 100}", extra)
    async with Served(cfg, up, cand) as s:
        got = [await s.chat("acme", temperature=0), await s.chat("acme", temperature=0)]
        await s.gw.shadows.stop()
    assert got == ["miss", "hit"]
    assert len(cand.calls) == 1      # the miss's shadow only
