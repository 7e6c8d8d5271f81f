"""The local engine's prefix cache is per tenant (``LocalBackend`` salts each request with
``tenant_cache_salt``): a trial's tenant B got ``cached_tokens: 144`` for tenant A's 160-token prompt, which
told B, 16 tokens at a time, what A had sent. Through HTTP with the openai SDK, two tenants' keys and a tiny
random Llama in the gateway's process: B reads none of A's blocks, A reads its own, a client's ``cache_salt``
splits its own tenant's cache further and never reaches another's; without keys every client is one tenant
and shares the cache, as before."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.backends.test_local_endpoints import until_ready
from tests.gateway.http.test_messages import gateway
from tests.gateway.support import sha
from tests.tiny_models import save_byte_level_llama

KEY_A, KEY_B = "sk-tandem-salt-tenant-a-0123456789", "sk-tandem-salt-tenant-b-0123456789"
# 160 characters, one token each: the trial's unique prompt
PROMPT = ("Tenant A's unique question about the quarterly numbers of project nightingale, "
          "which nobody else should learn anything about, not even a single block.")[:160].ljust(160, ".")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-salt-gw"), printable_only=True)


def config(model: str, keys: bool = True, rendered: bool = False) -> str:
    """Two tenants' keys (or none: anonymous); ``rendered``: a rule reads ``prompt_tokens``, so routing renders
    the prompt and the engine gets that rendering instead of parsing the body."""
    auth = (f"auth:\n  keys:\n    - {{tenant: ta, sha256: {sha(KEY_A)}}}\n"
            f"    - {{tenant: tb, sha256: {sha(KEY_B)}}}\n") if keys else ""
    rules = "  rules:\n    - {name: long, match: {prompt_tokens: {gt: 100000}}, route: r1}\n" if rendered else ""
    return (f"reload: {{watch: false}}\n{auth}"
            "resilience:\n  health: {interval_s: 0}\nobservability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            "backends:\n  local:\n    type: local\n"
            f"    engine: {{model: '{model}', served_model_name: tiny, dtype: float32, kv_cache_memory: 16MiB,\n"
            "             block_size: 16, engine_core_process: false}\n"
            f"routes:\n  r1:\n    targets: [{{backend: local}}]\npolicy:\n  default_route: r1\n{rules}")


async def cached(client: openai.AsyncOpenAI, max_tokens: int, stream: bool = False, **extra) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a chat request for ``PROMPT`` (``max_tokens`` makes
    each body differ, so no response cache could answer it)."""
    kw = dict(model="m1", messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0,
              extra_body=extra or None)
    if not stream:
        return (await client.chat.completions.create(**kw)).usage.prompt_tokens_details.cached_tokens
    chunks = [c async for c in await client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True})]
    return chunks[-1].usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("rendered", [False, True], ids=["body", "rendered"])
async def test_tenants_never_read_each_others_prefix_cache(tiny_model, rendered):
    async with gateway(config(tiny_model, rendered=rendered), start_engine=True) as (gw, _, url):
        await until_ready(gw)
        assert gw.snapshot.needs_prompt_tokens == rendered
        a = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        b = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
        assert await cached(a, 3) == 0
        assert await cached(b, 4) == 0                     # A's prompt: nothing of it for B (the trial got 144)
        assert await cached(b, 5, stream=True) > 0         # B's own blocks now, streamed too
        assert await cached(a, 6, stream=True) > 0         # A's repeat reads A's blocks
        assert await cached(a, 7) >= 144
        # a client's own salt splits its tenant's cache further, and names no other tenant's
        assert await cached(b, 8, cache_salt="shared-secret") == 0
        assert await cached(a, 9, cache_salt="shared-secret") == 0
        assert await cached(a, 10, cache_salt="shared-secret") > 0
        await a.close()
        await b.close()


async def test_without_keys_every_client_is_one_tenant_and_shares(tiny_model):
    async with gateway(config(tiny_model, keys=False), start_engine=True) as (gw, _, url):
        await until_ready(gw)
        one = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        other = openai.AsyncOpenAI(base_url=url + "/v1", api_key="other", max_retries=0, timeout=60)
        assert await cached(one, 3) == 0
        assert await cached(other, 4) >= 144
        await one.close()
        await other.close()
