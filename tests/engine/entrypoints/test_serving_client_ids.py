"""Every id a client can send is checked before the 200, and assistant ``tool_calls`` entries are checked as
OpenAI checks them (issue #49 items 5 and 6), on a live ``tandem engine serve`` (SmolLM2, real HTTP).

A negative ``resume_token_ids`` entry was ``internal engine error (OverflowError)`` inside a 200 stream,
an id past the vocabulary failed only after the 200 too; ``allowed_token_ids`` was ignored (then refused; now
served, its ids checked); an assistant
message ``tool_calls: [{"id": "a", "type": "function"}]`` (no ``function``) was accepted.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
def server(float32_server):
    return float32_server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": server.model, "max_tokens": 4, **body}, timeout=60)


def assert_400(r: httpx.Response, param: str, needle: str) -> None:
    """A 400 in OpenAI's shape whose ``param`` is (or starts with: ``stop_token_ids[0]``) ``param``."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and needle in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("tokens, needle", [([[-1]], "resume_token_ids[0][0]: -1 is not a token id"),
                                            ([[5, 10 ** 9]], "resume_token_ids[0][1]: 1000000000 is not a token id"),
                                            ([[5, 2 ** 63 - 1]], "is not a token id")])
def test_a_resume_token_outside_the_vocabulary_is_a_400_before_the_stream(server, tokens, needle):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "stream": True, "resume_token_ids": tokens})
    assert_400(r, "resume_token_ids", needle)


def test_a_completions_prompt_list_of_strings_and_token_lists_together_is_a_400(server):
    """OpenAI's and vLLM's schemas take a list of strings or a list of token-id lists, not both (a trial's
    ``[[1, 2], "a"]`` got two choices); each kind alone is served."""
    assert_400(post(server, "/v1/completions", {"prompt": [[1, 2], "a"], "max_tokens": 1}), "prompt",
               "only strings or only token-id lists")
    r = post(server, "/v1/completions", {"prompt": [[1, "a"]], "max_tokens": 1})   # a new user's trial: code null
    assert_400(r, "prompt", "a list of token-id lists")
    assert r.json()["error"]["code"] == "invalid_type"
    for prompt in (["a", "b"], [[1, 2], [3]]):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_every_other_client_id_is_checked_before_the_200(server):
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "allowed_token_ids": [1, 10 ** 9]}),
               "allowed_token_ids", "allowed_token_ids[1]: 1000000000 is not a token id of this model")
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "allowed_token_ids": [-1]}),
               "allowed_token_ids", "allowed_token_ids[0]")      # the shared range table's
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "allowed_token_ids": []}),
               "allowed_token_ids", "non-empty list")
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "logit_bias": {"-1": 5}}),
               "logit_bias", "Invalid key in 'logit_bias': '-1'")      # the shared range table's, as the gateway's
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "logit_bias": {"99999999": 5}}),
               "logit_bias", "is not a token id of this model")   # vLLM refuses an id past the vocabulary
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "use_beam_search": True}),
               "use_beam_search", "beam search is not supported")
    # what refuses nothing: an empty logit_bias (OpenAI clients send {}), use_beam_search false
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "logit_bias": {},
                                              "use_beam_search": False})
    assert r.status_code == 200, r.text
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "stream": True, "stop_token_ids": [-1]}),
               "stop_token_ids", "stop_token_ids[0]")
    assert_400(post(server, "/v1/chat/completions", {"messages": ASK, "stream": True, "stop_token_ids": [10 ** 9]}),
               "stop_token_ids", "is not a token id")
    for prompt in ([-1], [5, 10 ** 9], [[5], [-3]]):
        assert_400(post(server, "/v1/completions", {"prompt": prompt, "stream": True}), "prompt", "token ids")


@pytest.mark.parametrize("call, param", [
    ({"id": "a", "type": "function"}, "messages[1].tool_calls[0].function"),
    ({"type": "function", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].id"),
    ({"id": "a", "type": "tool", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].type"),
    ({"id": "a", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({"id": "a", "type": "function", "function": {"name": "f"}}, "messages[1].tool_calls[0].function.arguments"),
    ({"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
     "messages[1].tool_calls[0].function.arguments"),
    ("call", "messages[1].tool_calls[0]"),
])
def test_a_malformed_assistant_tool_call_is_a_400_naming_its_part(server, call, param):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "a", "content": "x"}]
    r = post(server, "/v1/chat/completions", {"messages": messages})
    assert_400(r, param, param)
    good = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = post(server, "/v1/chat/completions", {"messages": [*ASK, {**messages[1], "tool_calls": [good]},
                                                            messages[2]]})
    assert ok.status_code == 200, ok.text
