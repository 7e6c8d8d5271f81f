"""Parity of Tandem engines (issue 31, item 2): the engine is reproducible, so a shadow between two replicas of one
model (``tandem engine serve``), and between the gateway's in-process engine and such a replica, is 100 % exact in
token ids (kind ``exact``: both return ``token_ids``), with no logprob delta. Real parts: the tiny byte-level Llama
served by real engines, the gateway in this process, the official openai SDK."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.gateway.rollouts.conftest import ADMIN_TOKEN, gateway
from tests.gateway.support import engine_replicas

pytestmark = pytest.mark.slow   # a large workload: tests/conftest.py runs these files first

PROMPTS = ["Hello there", "Count: 1 2 3", "abc"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    yield from engine_replicas(tmp_path_factory, ["e1", "e2"])


def config(replicas, local_dtype: str = "float32") -> str:
    cmd = replicas["e1"].cmd
    model = cmd[cmd.index("--model") + 1]      # the same model, in the gateway's own engine
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: {s.base_url}/v1\n    models: {{tiny: bench}}\n"
                       for n, s in replicas.items())
    local = (f"  local:\n    type: local\n    engine: {{model: '{model}', served_model_name: bench, dtype: {local_dtype}, "
             "kv_cache_memory: 32MiB, max_model_len: 4096, num_threads: 1}\n")
    return ("reload: {watch: false}\nobservability:\n  logs: {requests: false}\nresilience:\n  health: {interval_s: 0}\n"
            f"models:\n  - name: tiny\n  - name: tiny-local\nbackends:\n{backends}{local}"
            "routes:\n  served:\n    targets: [{backend: e1}]\n    shadow: {target: e2}\n"
            "  inproc:\n    targets: [{backend: local}]\n    shadow: {target: e1, model: bench}\n"
            "policy:\n  default_route: served\n  rules:\n"
            "    - {name: local, match: {model: tiny-local}, route: inproc}\n")


async def reports_of(text: str, routes: list[str]) -> dict:
    """The parity reports of ``routes`` after each model got ``PROMPTS`` (greedy, 12 tokens) on a gateway."""
    async with gateway(text, start_engine=True) as (gw, url, c):
        while gw.snapshot.local is not None and gw.snapshot.local.loading:
            await asyncio.sleep(0.1)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for model in ["tiny", "tiny-local"]:
            for p in PROMPTS:
                await client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                     max_tokens=12, temperature=0)
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while loop.time() < end:
            reports = (await c.get("/admin/parity")).json()["reports"]
            if all(reports.get(r, {}).get("requests", 0) >= len(PROMPTS) for r in routes):
                break
            await asyncio.sleep(0.1)
    return reports


async def test_identical_engines_are_100_percent_exact(replicas, monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
    routes = ["shadow/served", "shadow/inproc"]
    reports = await reports_of(config(replicas), routes)
    for r in routes:
        p = reports[r]
        assert p["kind"] == "exact" and p["compared"] == len(PROMPTS), (r, p)
        assert p["exact_share"] == 1.0 and p["first_divergence"]["p50"] is None and p["mean_kl"] == 0
        assert p["primary"]["error_rate"] == 0 and p["candidate"]["ttft_p50_ms"] is not None


async def test_an_engine_in_another_dtype_is_detected(replicas, monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
    p = (await reports_of(config(replicas, "bfloat16"), ["shadow/served", "shadow/inproc"]))["shadow/inproc"]
    assert p["kind"] == "exact" and p["compared"] == len(PROMPTS)
    assert p["exact_share"] < 1.0 and p["logprob_delta_p50"] > 0 and p["mean_kl"] > 0
