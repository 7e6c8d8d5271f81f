"""Small pure pieces of the gateway: request checks, estimates, auth, the
failure summary of the attempt loop."""

from __future__ import annotations

import hashlib

import pytest

from gateway.request.auth import authenticate, bearer, check_admin, is_loopback
from gateway.errors import ClientError
from gateway.request.param_objects import CHAT_VALUES
from gateway.request.validate import check_request, estimate_prompt_tokens, parse_json


TOOL = {"type": "function", "function": {"name": "f"}}


def test_local_unsupported_fields_are_named():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert check_request(dict(base), "chat/completions", None).local_unsupported is None
    assert check_request({**base, "response_format": {"type": "text"}}, "chat/completions", None) \
        .local_unsupported is None
    # OpenAI's default modalities, text only, is what the engine gives (a trial's ["text"] got 503 no backend)
    assert check_request({**base, "modalities": ["text"]}, "chat/completions", None).local_unsupported is None
    assert check_request({**base, "modalities": ["text", "audio"]}, "chat/completions", None) \
        .local_unsupported == "modalities"
    p = check_request({**base, "response_format": {"type": "json_object"}}, "chat/completions", None)
    assert p.local_unsupported == "response_format" and p.has_response_format and not p.has_tools
    p = check_request({**base, "tools": [TOOL]}, "chat/completions", None)
    assert p.local_unsupported == "tools" and p.has_tools
    assert check_request({**base, "prediction": {"type": "content", "content": "x"}}, "chat/completions",
                         None).local_unsupported == "prediction"
    assert check_request({**base, "logit_bias": {"1": 2}}, "chat/completions", None).local_unsupported is None
    assert check_request({**base, "tools": []}, "chat/completions", None).local_unsupported is None
    # A local backend configured to serve structured outputs takes them off the list, one by one.
    tools = {**base, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert check_request(tools, "chat/completions", None, frozenset({"tools"})).local_unsupported == "response_format"
    assert check_request(tools, "chat/completions", None, frozenset({"response_format"})).local_unsupported == "tools"
    p = check_request(tools, "chat/completions", None, frozenset({"tools", "response_format"}))
    assert p.local_unsupported is None and p.has_tools and p.has_response_format



@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"), ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "bogus"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOL, TOOL]}, "tools"), ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"response_format": "json"}, "response_format"), ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
])
def test_malformed_tools_and_formats_are_refused_before_routing(extra, param):
    """A LiteLLM user's trial: these chat bodies went to the upstream (a permissive one answered 200), while the
    Responses and Messages paths refused the same mistakes. The engine's shapes (``engine.protocol.chat_shapes``)
    now refuse them at the edge, naming the path, whichever backend would get them."""
    with pytest.raises(ClientError) as e:
        check_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}, "chat/completions", None)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, str(e.value))


def test_openais_newer_tool_kinds_are_left_to_the_upstream():
    """Custom tools and an allowed-tools choice (OpenAI's newer chat forms) pass to a backend that takes them."""
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    check_request({**base, "tools": [{"type": "custom", "custom": {"name": "c"}}], "tool_choice": "required"},
                  "chat/completions", None)
    check_request({**base, "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}}, "chat/completions", None)
    assert check_request({**base, "functions": [{}]}, "chat/completions", None,
                         frozenset({"tools"})).local_unsupported == "functions"  # legacy functions: never local


def test_priority_from_body_then_header():
    base = {"model": "m", "prompt": "x"}
    assert check_request({**base, "priority": "high"}, "completions", "low").priority == -1
    assert check_request(dict(base), "completions", "low").priority == 1
    assert check_request(dict(base), "completions", None).priority == 0
    with pytest.raises(ClientError) as e:
        check_request(dict(base), "completions", "soon")
    assert e.value.param == "priority"


def test_null_optional_fields_are_allowed():
    check_request({"model": "m", "prompt": "x", "max_tokens": None, "stop": None, "user": None}, "completions", None)


def test_parse_json_errors():
    for raw in (b"", b"{", b"1", b'"x"'):
        with pytest.raises(ClientError) as e:
            parse_json(raw)
        assert e.value.status == 400
    # a lone surrogate escape (msgspec: "Input data was truncated", which a trial read on /v1/messages) is named
    for raw, at in ((b'{"a": "x\\ud800y"}', 8), (b'{"messages": [{"content": "\\ud800"}]}', 27)):
        with pytest.raises(ClientError) as e:
            parse_json(raw)
        assert f"a lone UTF-16 surrogate escape \\ud800 at byte {at}" in e.value.message, e.value.message
    with pytest.raises(ClientError, match="truncated"):          # a truncated body is still called one
        parse_json(b'{"a": "x')
    assert parse_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}     # a pair is a character


def test_estimate_prompt_tokens():
    assert estimate_prompt_tokens({"prompt": "abcdefgh"}) == 2
    # a character outside ASCII is a token (1,000 Chinese characters were 254 tokens: SmolLM2 counts 2,280)
    assert estimate_prompt_tokens({"prompt": "东京" * 500}) == 1000 == estimate_prompt_tokens({"input": "🙂" * 1000})
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "ab东京"}]}) == 3 + 4
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "a" * 40}]}) == 10 + 4
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}) \
        == 1 + 4


def test_authenticate_and_admin():
    h = {hashlib.sha256(b"k1").hexdigest(): "alpha"}
    assert authenticate(None, {}) == ""
    assert authenticate("Bearer k1", h) == "alpha"
    for header in (None, "Bearer nope", "Basic k1", "Bearer "):
        with pytest.raises(ClientError) as e:
            authenticate(header, h)
        assert e.value.status == 401
    assert bearer("bearer  tok ") == "tok"
    check_admin("Bearer s3", "s3", "ENV")
    with pytest.raises(ClientError, match="ENV is unset"):
        check_admin("Bearer s3", None, "ENV")
    with pytest.raises(ClientError, match="^invalid admin token$"):
        check_admin("Bearer s4", "s3", "ENV")
    with pytest.raises(ClientError, match="missing admin token: send Authorization: Bearer <the value of ENV>"):
        check_admin(None, "s3", "ENV")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    # a token from a secret file (Kubernetes --from-file, echo > file) ends in a newline: it was never usable
    check_admin("Bearer s3", "s3\n", "ENV")
    with pytest.raises(ClientError, match="ENV is unset"):
        check_admin("Bearer s3", " \n", "ENV")


def test_a_virtual_key_reads_as_its_secret_file_and_names_one_tenant():
    """A key's variable is read without its blanks (a file's newline disabled the key silently); one key under two
    tenants is refused naming both entries (it was given to the last, moving the first's traffic and budget)."""
    from gateway.config.compile import load_config_text
    from gateway.config.schema import ConfigError

    text = ("{{reload: {{watch: false}}, models: [{{name: m}}], policy: {{default_route: r}}, "
            "backends: {{a: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}}}, "
            "routes: {{r: {{targets: [{{backend: a}}]}}}}, auth: {{keys: [{keys}]}}}}")
    one = text.format(keys="{tenant: alpha, env: K1}, {tenant: alpha, sha256: %s}" % hashlib.sha256(b"k").hexdigest())
    compiled = load_config_text(one, environ={"K1": "sk-alpha\n"})
    assert authenticate("Bearer sk-alpha", compiled.key_hashes) == "alpha" == authenticate("Bearer k", compiled.key_hashes)
    two = text.format(keys="{tenant: alpha, env: K1}, {tenant: beta, env: K2}")
    with pytest.raises(ConfigError) as e:
        load_config_text(two, environ={"K1": "sk-same", "K2": " sk-same "})
    assert e.value.errors == [("auth.keys[1]", "the same key as auth.keys[0], of tenant 'alpha': a key names one tenant")]


def test_money_is_formatted_as_money():
    from gateway.billing.prices import format_usd
    assert [format_usd(x) for x in (0, 1e-06, 0.000022, 0.05, 0.042901, 0.0435, 0.5, 50, 1234.5)] == [
        "$0.00", "$0.000001", "$0.000022", "$0.05", "$0.0429", "$0.0435", "$0.50", "$50.00", "$1,234.50"]


def test_ctl_version_summary_says_why_a_version_is_not_shared():
    """Without Redis configured the summary must not blame an unreachable Redis
    (a fresh-user trial saw "(Redis unreachable)" with redis_url: null)."""
    from gateway.commands import _version_summary

    base = {"version": 3, "source": "weights", "routes": {}, "warnings": []}
    assert "no Redis configured" in _version_summary({**base, "propagated": None})
    assert "Redis" not in _version_summary({**base, "propagated": True})


@pytest.mark.parametrize("field, value, code", [
    ("top_p", 7, "decimal_above_max_value"),     # the parameter's type, not the value's (OpenAI)
    ("top_p", 1.5, "decimal_above_max_value"),
    ("top_p", -0.1, "decimal_below_min_value"),   # 0 is taken, as OpenAI takes it (a trial)
    ("temperature", -0.5, "decimal_below_min_value"),
    ("max_tokens", -1, "integer_below_min_value"),
    ("max_completion_tokens", 0, "integer_below_min_value"),
    ("presence_penalty", 2.5, "decimal_above_max_value"),
    ("n", 0, "integer_below_min_value"),
    ("top_logprobs", 21, "integer_above_max_value"),
])
def test_out_of_range_values_get_openai_codes_before_routing(field, value, code):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ClientError) as e:
        check_request(body, "chat/completions", None)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, code)
    assert str(value) in e.value.message


@pytest.mark.parametrize("value, code", [(50, "integer_above_max_value"), (-1, "integer_below_min_value")])
def test_completions_logprobs_out_of_range_gets_openai_code(value, code):
    with pytest.raises(ClientError) as e:
        check_request({"model": "m", "prompt": "hi", "logprobs": value}, "completions", None)
    assert (e.value.status, e.value.param, e.value.code) == (400, "logprobs", code)
    assert check_request({"model": "m", "prompt": "hi", "logprobs": 20}, "completions", None)
    assert check_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
                         "chat/completions", None)


@pytest.mark.parametrize("field", ["service_tier", "reasoning_effort", "verbosity", "prompt_cache_retention"])
def test_chat_string_parameters_take_openais_values_alone(field):
    """A trial's ``service_tier: "bogus"`` was a 200; OpenAI answers 400 ``invalid_value``. Each value the SDK
    types list passes."""
    import typing

    from openai.types.chat import completion_create_params

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: "bogus"}
    with pytest.raises(ClientError) as e:
        check_request(body, "chat/completions", None)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "invalid_value")
    assert "'bogus'" in e.value.message
    hint = typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)[field]
    sdk = next(typing.get_args(a) for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal)
    assert CHAT_VALUES[field] == sdk
    for value in sdk:
        assert check_request({**body, field: value}, "chat/completions", None).body[field] == value


def test_in_range_edges_pass_and_empty_messages_is_empty_array():
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1, "temperature": 2,
          "presence_penalty": -2, "max_tokens": 1, "n": 1, "top_logprobs": 0}
    assert check_request(ok, "chat/completions", None).max_tokens == 1
    with pytest.raises(ClientError) as e:
        check_request({"model": "m", "messages": []}, "chat/completions", None)
    assert (e.value.param, e.value.code) == ("messages", "empty_array")


def test_what_a_route_gets_now_names_its_fallbacks_when_no_target_serves():
    """``ctl status`` / ``ctl weights``' ``now:`` line: the weighted targets that are out and what serves
    instead; with no target left, the route's fallbacks by name (a new-user trial read "no target serves: the
    fallbacks, then 503" on a route whose fallback ``local`` answered every request)."""
    from gateway.commands import _traffic_now

    route = {"targets": [{"id": "cheap", "weight": 100, "out": "backend unavailable: no key", "effective_pct": 0.0}],
             "fallbacks": ["local"]}
    assert _traffic_now(route) == ("cheap out (backend unavailable: no key); "
                                   "no target serves: its fallbacks (local) in order, then 503")
    assert _traffic_now({**route, "fallbacks": []}).endswith("; no target serves: 503")
    route["targets"].append({"id": "spare", "weight": 0, "out": "", "effective_pct": 100.0})
    assert _traffic_now(route) == "cheap out (backend unavailable: no key); spare 100 %"
    assert _traffic_now({"targets": [{"id": "a", "weight": 1, "out": "", "effective_pct": 100.0}]}) == ""


def test_ctl_prints_shares_only_where_weights_set_them():
    # an ops trial read "a=1 (50 %), b=1 (50 %)" on a select: cheapest route whose cheaper target took everything
    from gateway.commands import _version_summary

    targets = [{"id": "a", "weight": 1.0, "share_pct": 50.0}, {"id": "b", "weight": 0.0, "share_pct": 0.0}]
    data = {"version": 3, "source": "weights", "routes": {
        "cheap": {"select": "cheapest", "weights_steer": False, "fallbacks": [], "targets": targets},
        "main": {"select": "weighted", "weights_steer": True, "fallbacks": [], "targets": targets}}}
    text = _version_summary(data)
    assert "route cheap [cheapest]: a=1 (choice), b=0 (spare)" in text
    assert "route main [weighted]: a=1 (50 %), b=0 (0 %)" in text


def test_a_field_only_upstreams_serve_is_a_400_without_a_key_and_a_503_while_one_is_down():
    """``upstream_only_error``: every upstream of the route keyless (its variable unset: no retry can help) is the
    client's 400 ``unsupported_parameter``; one with a key that is down now (breakers, probe) is the 503."""
    from types import SimpleNamespace as NS

    from gateway.request.pipeline import upstream_only_error

    decision = NS(attempts=[NS(backend="local")], route="r", rule="default")
    route = NS(targets=[NS(backend="local")], fallbacks=[NS(backend="a"), NS(backend="b")])
    reasons = {"a": "environment variable A_KEY is unset", "b": "breaker open"}
    keyless = upstream_only_error("dimensions", decision, route, reasons, keyless={"a", "b"})
    assert (keyless.status, keyless.code, keyless.param) == (400, "unsupported_parameter", "dimensions")
    assert "a: environment variable A_KEY is unset" in keyless.message
    down = upstream_only_error("dimensions", decision, route, reasons, keyless={"a"})
    assert (down.status, down.code) == (503, "no_backend_available") and down.headers["x-should-retry"] == "false"
    assert upstream_only_error("dimensions", NS(attempts=[NS(backend="a")], route="r", rule="x"), route,
                               reasons) is None   # an upstream is among the targets: the attempt loop decides
