"""vLLM's ``cache_salt`` end to end, on a tiny random Llama: requests share prefix-cache blocks only when their
salts are equal, and the outputs stay bitwise the same whether a prompt came from the cache or not; offline
(``LLM.generate``) and through the engine's own OpenAI server (its core in a process of its own, so the salt
crosses the core's pipe)."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.entrypoints.test_serving import start_server
from tests.tiny_models import save_byte_level_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPT = list(range(40, 40 + 100))   # 100 tokens: 6 full blocks of 16 that the cache can serve


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-salt"), printable_only=True)


def run(llm: LLM, salt: str | None):
    out = llm.generate(PROMPT, GREEDY, cache_salt=salt)[0]
    c = out.outputs[0]
    return out.num_cached_tokens, (list(c.token_ids), [{k: v.logprob for k, v in lp.items()} for lp in c.logprobs])


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_a_salt_reads_only_its_own_blocks_and_outputs_do_not_change(tiny_model, batch_invariant):
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="8MiB", block_size=16,
              batch_invariant=batch_invariant)
    cached_a, first = run(llm, "tenant-a")
    cached_b, other_salt = run(llm, "tenant-b")
    cached_none, unsalted = run(llm, None)
    cached_again, same_salt = run(llm, "tenant-a")
    assert (cached_a, cached_b, cached_none) == (0, 0, 0)   # a different salt (or none) shares nothing
    assert cached_again == 96                               # the same salt reads its 6 full blocks
    if batch_invariant:   # the default: token ids and logprobs bit for bit, cached or not
        assert first == other_salt == unsalted == same_salt
    else:                 # a cached prefix is another kernel split: the same greedy tokens
        assert first[0] == other_salt[0] == unsalted[0] == same_salt[0]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = start_server(model=tiny_model, dtype="float32", kv_cache_memory="8MiB", block_size=16)
    yield s
    s.stop()


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def test_the_servers_chat_and_completions_take_cache_salt(server):
    msgs = [{"role": "user", "content": "a unique prompt of more than two blocks of sixteen tokens " * 2}]
    chat = lambda salt: server.client.chat.completions.create(  # noqa: E731
        model=server.model, messages=msgs, max_tokens=4, temperature=0, extra_body={"cache_salt": salt})
    a, b, a2 = chat("tenant-a"), chat("tenant-b"), chat("tenant-a")
    assert (cached(a), cached(b)) == (0, 0) and cached(a2) >= 96
    assert a.choices[0].message.content == b.choices[0].message.content == a2.choices[0].message.content
    prompt = "another unique prompt, for the legacy completions endpoint " * 2
    done = lambda salt: server.client.completions.create(  # noqa: E731
        model=server.model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"cache_salt": salt})
    first, other, again = done("x"), done("y"), done("x")
    assert (cached(first), cached(other)) == (0, 0) and cached(again) >= 96
    # POST /v1/ttft counts what the prefix cache holds for the body's own salt
    ttft = lambda salt: httpx.post(f"{server.base_url}/v1/ttft", json={  # noqa: E731
        "model": server.model, "prompt": prompt, "max_tokens": 4, "cache_salt": salt}).json()
    assert ttft("y")["uncached_tokens"] < ttft("z")["uncached_tokens"] == ttft("z")["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:   # vLLM refuses an empty salt too
        chat("")
    assert e.value.body["param"] == "cache_salt"
