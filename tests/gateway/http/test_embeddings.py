"""``POST /v1/embeddings`` routed to an upstream (issue 28, item 3) with the official ``openai`` SDK: float and
base64, token-id inputs, ``dimensions`` passed on, validation 400s naming the parameter, limits and one ledger record
billed for the input tokens; and ``GET /v1/models`` naming the endpoints each model serves."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.http.test_messages import KEY, config, gateway, records


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


async def test_embeddings_routed_limited_and_billed(up):
    async with gateway(config(up, rpm=4)) as (gw, _, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = await client.embeddings.create(model="m1", input=["a", "b"], encoding_format="float")
        assert [d.embedding for d in r.data] == [[0.0, 0.5, -1.0, 2.0], [1.0, 0.5, -1.0, 2.0]]
        assert r.model == "m1" and r.usage.prompt_tokens == 2
        path, _, body = up.requests[-1]
        assert path == "/v1/embeddings" and body["model"] == "up-model" and body["input"] == ["a", "b"]
        r = await client.embeddings.create(model="m1", input=[1, 2, 3], dimensions=2)   # SDK default: base64
        assert [d.embedding for d in r.data] == [[0.0, 0.5]]      # decoded by the SDK from base64
        assert up.requests[-1][2]["encoding_format"] == "base64" and up.requests[-1][2]["dimensions"] == 2
        recs = await records(gw, 2)
        assert sorted((x.prompt_tokens, x.completion_tokens, x.nusd) for x in recs.values()) == \
            [(1, 0, 1000), (2, 0, 2000)]                        # the input alone, USD 1 per million
        assert gw.obs.registry.get_sample_value("tandem_input_tokens_total", {"backend": "up", "tenant": "t1"}) == 3
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="m1", input=[])
        assert e.value.body["param"] == "input"
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="m1", input="x", encoding_format="hex")  # type: ignore[arg-type]
        assert e.value.body["param"] == "encoding_format"
        await client.embeddings.create(model="m1", input="x")
        up.push({"status": 503})
        with pytest.raises(openai.APIStatusError):
            await client.embeddings.create(model="m1", input="x")
        with pytest.raises(openai.RateLimitError):              # rpm 4, as chat
            await client.embeddings.create(model="m1", input="x")
        await client.close()
        async with httpx.AsyncClient() as h:
            models = (await h.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"})).json()
        assert models["data"][0]["endpoints"] == ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                                   "/v1/messages", "/v1/embeddings"]


async def test_an_unknown_embeddings_parameter_is_refused_as_on_chat(up):
    """An unknown field is OpenAI's 400 ``unknown_parameter`` naming it, as on chat and Responses; OpenAI's own
    fields, the gateway's ``priority`` and ``metadata`` and vLLM's extras go on."""
    async with gateway(config(up)) as (_, _, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="m1", input="x", extra_body={"foo": 1})
        assert e.value.body == {"message": "Unrecognized request argument supplied: foo",
                                "type": "invalid_request_error", "param": "foo", "code": "unknown_parameter"}
        with pytest.raises(openai.BadRequestError) as e:   # a chat parameter out of chat's range: still unknown here
            await client.embeddings.create(model="m1", input="x", extra_body={"temperature": 5})
        assert e.value.body["param"] == "temperature" and e.value.body["code"] == "unknown_parameter", e.value.body
        assert up.requests == []
        with pytest.raises(openai.BadRequestError) as e:   # vLLM's extras are typed and range-checked here too
            await client.embeddings.create(model="m1", input="x", extra_body={"truncate_prompt_tokens": -2})
        assert e.value.body["param"] == "truncate_prompt_tokens", e.value.body
        assert up.requests == []
        vllms = {"normalize": False, "add_special_tokens": True, "truncate_prompt_tokens": 8}
        await client.embeddings.create(model="m1", input="x", encoding_format="float", dimensions=2, user="u",
                                       extra_body={"priority": "high", "metadata": {"team": "a"}, **vllms})
        await client.close()
    assert up.requests[-1][2]["user"] == "u" and up.requests[-1][2]["dimensions"] == 2
    assert {k: up.requests[-1][2][k] for k in vllms} == vllms


async def test_one_input_of_many_token_ids_is_one_input_and_many_inputs_are_bounded(up):
    """OpenAI bounds the inputs of one request at 2048; a flat array of token ids is one input, bounded by the
    model's context (a RAG trial's 3,000 ids were refused as "3000 items", while ``[ids]`` was served)."""
    async with gateway(config(up)) as (_, _, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        await client.embeddings.create(model="m1", input=list(range(3000)), encoding_format="float")
        assert up.requests[-1][2]["input"] == list(range(3000))
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="m1", input=["x"] * 2049)
        assert e.value.body["param"] == "input" and "2049 items; at most 2048" in e.value.body["message"]
        await client.close()


async def test_a_bad_item_of_input_is_named(up):
    """A list with one bad item names that item (an embeddings trial's ``["a", ""]`` was refused naming only
    ``input``), through the SDK; the upstream is never asked."""
    async with gateway(config(up)) as (_, _, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await client.embeddings.create(model="m1", input=["a", ""])
        assert e.value.body["param"] == "input[1]" and "an empty string" in e.value.body["message"], e.value.body
        await client.close()
    assert up.requests == []


@pytest.mark.parametrize("value, param, got", [
    (["a", "b", 3], "input[2]", "got 3"), ([[1, 2], []], "input[1]", "an empty array"),
    ([[1], [2, -1]], "input[1]", "[2, -1]"), ([1, 2, "x"], "input[2]", "'x'"), ([None, "a"], "input[0]", "None"),
    ([{"text": "a"}], "input[0]", "{'text': 'a'}")])
def test_the_first_bad_item_is_named(value, param, got):
    from gateway.errors import ClientError
    from gateway.request.embeddings import check_embeddings
    with pytest.raises(ClientError) as e:
        check_embeddings({"input": value})
    assert e.value.param == param and got in e.value.message, e.value.message
