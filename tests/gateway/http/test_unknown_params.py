"""Chat and completions refuse a top-level parameter that is neither OpenAI's nor a vendor extension the gateway
forwards, as OpenAI's chat endpoint does (400 naming it; ``code: unknown_parameter``, the Responses endpoint's
code), unless the route says ``extra_params: pass``; and a route or model's ``default_max_tokens`` bounds a chat
request that sets none. Through ``tandem serve`` and the official openai SDK (its ``extra_body``)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.support import gateway_on, upstream_config

ROUTES = """  main:
    targets: [{backend: a}]
  provider-own:
    extra_params: pass
    default_max_tokens: 7
    targets: [{backend: a}]
"""
RULES = """    - {name: own, match: {header.x-own: "1"}, route: provider-own}
    - {name: default, match: {}, route: main}
"""
ENV = {"TEST_UPSTREAM_KEY": "k"}


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    text = upstream_config({"a": upstream}, ROUTES, rules_yaml=RULES).replace(
        "  - name: m1\n    aliases: [alias1]\n", "  - name: m1\n    aliases: [alias1]\n    default_max_tokens: 9\n")
    yield from gateway_on(tmp_path_factory, "unknown-params", text, env=ENV)


MESSAGES = [{"role": "user", "content": "hi"}]


def test_an_unknown_chat_parameter_is_openais_400_naming_it(client, upstream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m1", messages=MESSAGES, max_tokens=5, extra_body={"foo": 1})
    assert err.value.status_code == 400
    assert err.value.body == {"message": "Unrecognized request argument supplied: foo",
                              "type": "invalid_request_error", "param": "foo", "code": "unknown_parameter"}
    assert upstream.calls == []                     # refused before any backend call


def test_an_unknown_completions_parameter_is_refused_too(client, upstream):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m1", prompt="hi", max_tokens=5, extra_body={"frobnicate": True})
    assert err.value.code == "unknown_parameter" and err.value.param == "frobnicate"
    assert upstream.calls == []


def test_vllms_older_guided_fields_are_refused_naming_the_structured_outputs_key(client, upstream):
    # vLLM's guided_* were replaced by structured_outputs' keys; the refusal says which one to send, the same
    # sentence as the engine's own server (engine.protocol.guided)
    for name, value, key in (("guided_choice", ["yes", "no"], "choice"), ("guided_json", {"type": "object"}, "json")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m1", messages=MESSAGES, max_tokens=5, extra_body={name: value})
        assert err.value.code == "unknown_parameter" and err.value.param == name
        assert err.value.body["message"].startswith(f"Unrecognized request argument supplied: {name}; ")
        assert f'"structured_outputs": {{"{key}": ...}}' in err.value.body["message"]
    assert upstream.calls == []


def test_vendor_extensions_and_openais_own_parameters_are_forwarded(client, upstream):
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": False, "min_tokens": 1,
              "skip_special_tokens": True, "chat_template_kwargs": {"enable_thinking": False},
              # vLLM's that a trial found refused as unknown
              "bad_words": ["x"], "allowed_token_ids": [1, 2], "truncate_prompt_tokens": 8,
              "return_tokens_as_token_ids": True, "length_penalty": 1.0, "vllm_xargs": {"a": 1},
              "mm_processor_kwargs": {}}
    reply = client.chat.completions.create(model="m1", messages=MESSAGES, max_tokens=5, service_tier="auto",
                                           reasoning_effort="low", extra_body=extras)
    assert reply.choices[0].message.content == "hello from a"
    sent = upstream.calls[-1]["body"]
    assert {k: sent[k] for k in extras} == extras and sent["reasoning_effort"] == "low"


def test_a_route_that_passes_extra_parameters_forwards_them(client, upstream):
    reply = client.chat.completions.create(model="m1", messages=MESSAGES, max_tokens=5,
                                           extra_body={"foo": 1, "thinking": {"type": "disabled"}},
                                           extra_headers={"x-own": "1"})
    assert reply.choices[0].message.content == "hello from a"
    sent = upstream.calls[-1]["body"]
    assert sent["foo"] == 1 and sent["thinking"] == {"type": "disabled"}


def test_default_max_tokens_of_the_route_then_the_model_bound_a_request_without_one(client, upstream):
    client.chat.completions.create(model="m1", messages=MESSAGES, extra_headers={"x-own": "1"})
    assert upstream.calls[-1]["body"]["max_tokens"] == 7           # the route's
    client.chat.completions.create(model="m1", messages=MESSAGES)
    assert upstream.calls[-1]["body"]["max_tokens"] == 9           # the model's, on a route without its own
    client.chat.completions.create(model="m1", messages=MESSAGES, max_tokens=3)
    assert upstream.calls[-1]["body"]["max_tokens"] == 3           # the request's own wins
    client.chat.completions.create(model="m1", messages=MESSAGES, max_completion_tokens=4)
    sent = upstream.calls[-1]["body"]
    assert sent["max_completion_tokens"] == 4 and sent.get("max_tokens") is None   # OpenAI's newer name counts too
