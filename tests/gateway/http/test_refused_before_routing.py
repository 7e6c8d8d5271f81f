"""Values OpenAI refuses are the gateway's 400 in OpenAI's error JSON, naming the parameter, before any routing
(no backend is called), through ``tandem serve`` and the official openai SDK: ``temperature`` above 2 (chat,
completions, Responses; the shared table ``engine/protocol/param_ranges.py``), a malformed ``logit_bias``, a
``tool_choice`` without ``tools`` on the Responses API (chat's rule, ``engine/protocol/tool_choice.py``), and a
Responses ``function_call_output`` whose ``call_id`` no ``function_call`` has."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.support import gateway_on, upstream_config

ROUTES = "  main:\n    targets: [{backend: a}]\n"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    yield from gateway_on(tmp_path_factory, "refused-before-routing", upstream_config({"a": upstream}, ROUTES),
                          env={"TEST_UPSTREAM_KEY": "k"})


def _refused(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    return err.value.body


@pytest.mark.parametrize("value", [5, 2.5, 1e308, 2.0001])
def test_temperature_above_2_is_openais_400_on_chat_completions_and_responses(client, upstream, value):
    calls = [lambda: client.chat.completions.create(model="m1", messages=MESSAGES, temperature=value),
             lambda: client.completions.create(model="m1", prompt="hi", temperature=value),
             lambda: client.responses.create(model="m1", input="hi", temperature=value)]
    for call in calls:
        body = _refused(call, "temperature")
        assert body["code"] == "decimal_above_max_value" and "Expected a value <= 2" in body["message"]
    assert upstream.calls == []
    assert client.chat.completions.create(model="m1", messages=MESSAGES, temperature=2, max_tokens=4)


@pytest.mark.parametrize("bias,code", [({"-5": 1}, "invalid_value"), ({"abc": 1}, "invalid_value"),
                                       ({"50256": 500}, "decimal_above_max_value"), ({"7": "x"}, "invalid_type")])
def test_a_malformed_logit_bias_is_a_400_naming_it(client, upstream, bias, code):
    body = _refused(lambda: client.chat.completions.create(model="m1", messages=MESSAGES, logit_bias=bias),
                    "logit_bias")
    assert body["code"] == code
    body = _refused(lambda: client.completions.create(model="m1", prompt="hi", logit_bias=bias), "logit_bias")
    assert body["code"] == code and upstream.calls == []
    ok = client.chat.completions.create(model="m1", messages=MESSAGES, logit_bias={"50256": -100, "7": 100})
    assert ok.choices and upstream.calls[-1]["body"]["logit_bias"] == {"50256": -100, "7": 100}


def test_responses_tool_choice_without_tools_is_chats_400(client, upstream):
    for choice in ("required", "auto", {"type": "function", "name": "f"}):
        body = _refused(lambda: client.responses.create(model="m1", input="hi", tool_choice=choice), "tool_choice")
        assert body["message"] == "tool_choice: is only allowed when tools are given"
    chat = _refused(lambda: client.chat.completions.create(model="m1", messages=MESSAGES, tool_choice="required"),
                    "tool_choice")
    assert chat["message"] == body["message"] and upstream.calls == []
    assert client.responses.create(model="m1", input="hi", tool_choice="none").status == "completed"
    assert "tool_choice" not in upstream.calls[-1]["body"]


def test_a_function_call_output_without_its_call_is_openais_400(client, upstream):
    body = _refused(lambda: client.responses.create(model="m1", input=[
        {"type": "function_call_output", "call_id": "nope", "output": "x"}]), "input")
    assert body["message"] == "No tool call found for function call output with call_id nope."
    assert upstream.calls == []
    # and the reverse: a call no output answers (a trial's was sent on)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    body = _refused(lambda: client.responses.create(model="m1", input=[
        {"role": "user", "content": "hi"}, call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}]), "input")
    assert body["message"] == "No tool output found for function call c2."
    assert upstream.calls == []
