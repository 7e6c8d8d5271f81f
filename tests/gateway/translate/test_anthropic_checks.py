"""The shape checks of a ``/v1/messages`` body (``gateway/translate/anthropic_checks.py``): nested objects hold
the keys Anthropic documents (those of its SDK's params, pinned here) and their values the types and values it
takes; each refusal Anthropic's 400 naming the dotted path."""

from __future__ import annotations

import pytest

from gateway.errors import ClientError
from gateway.translate import anthropic_checks
from gateway.translate.anthropic import messages_to_chat

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def refused(body: dict) -> ClientError:
    with pytest.raises(ClientError) as e:
        messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, **body})
    assert e.value.status == 400 and e.value.code == "invalid_request_error", body
    return e.value


def text(**extra) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": "hi", **extra}]}]


@pytest.mark.parametrize("body, param, message", [
    # a new user's trial: each of these was a 200
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name",
     "messages.0.name: Extra inputs are not permitted"),
    ({"messages": text(foo=1)}, "messages.0.content.0.foo", "messages.0.content.0.foo: Extra inputs are not permitted"),
    ({"tools": [{**TOOL, "foo": 1}]}, "tools.0.foo", "tools.0.foo: Extra inputs are not permitted"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "bogus"}}]}, "system.0.cache_control.type",
     "system.0.cache_control.type: Input should be 'ephemeral', got 'bogus'"),
    ({"messages": text(cache_control="yes")}, "messages.0.content.0.cache_control",
     "messages.0.content.0.cache_control: Input should be a valid dictionary, got str"),
    ({"tools": [{**TOOL, "cache_control": {"type": "ephemeral", "ttl": "3d"}}]}, "tools.0.cache_control.ttl",
     "tools.0.cache_control.ttl: Input should be '5m' or '1h', got '3d'"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use",
     "tool_choice.disable_parallel_tool_use: Input should be a valid boolean, got 'yes'"),
    ({"service_tier": "bogus"}, "service_tier", "service_tier: Input should be 'auto' or 'standard_only', got 'bogus'"),
    # the same rules elsewhere
    ({"messages": text(cache_control={"type": "ephemeral", "scope": "x"})}, "messages.0.content.0.cache_control.scope",
     "messages.0.content.0.cache_control.scope: Extra inputs are not permitted"),
    ({"cache_control": {}}, "cache_control.type", "cache_control.type: Field required"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "f", "foo": 1}}, "tool_choice.foo",
     "tool_choice.foo: Extra inputs are not permitted"),
    ({"tools": [TOOL], "tool_choice": {"type": "any", "name": "f"}}, "tool_choice.name",
     "tool_choice.name: Extra inputs are not permitted"),
    ({"tools": [{**TOOL, "strict": "yes"}]}, "tools.0.strict",
     "tools.0.strict: Input should be a valid boolean, got 'yes'"),
    ({"tools": [{**TOOL, "description": 5}]}, "tools.0.description",
     "tools.0.description: Input should be a valid string, got int"),
    ({"tools": ["f"]}, "tools.0", "tools.0: Input should be a valid dictionary, got str"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s",
                                                             "cache_control": {"type": "ephemeral"}}]},
                   {"role": "user", "content": "x"}]}, "messages.1.content.0.cache_control",
     "messages.1.content.0.cache_control: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"},
                                                 "alt": "a cat"}]}]}, "messages.0.content.0.alt",
     "messages.0.content.0.alt: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "text", "text": "ok", "foo": 1}]}]}]}, "messages.0.content.0.content.0.foo",
     "messages.0.content.0.content.0.foo: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content.0",
     "messages.0.content.0: Input should be a valid dictionary, got str"),
    ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages.0.content.0.type",
     "messages.0.content.0.type: Field required (a string)"),
])
def test_nested_objects_hold_anthropics_keys_and_types(body, param, message):
    e = refused(body)
    assert (e.param, e.message) == (param, message)


def test_what_anthropic_documents_passes_and_is_dropped():
    """Every documented key and value passes (the hints dropped: the chat body is what it was without them)."""
    cc = {"type": "ephemeral", "ttl": "1h"}
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}, "cache_control": cc}
    body = {"model": "m", "max_tokens": 9, "service_tier": "standard_only", "cache_control": {"type": "ephemeral"},
            "system": [{"type": "text", "text": "s", "cache_control": cc}],
            "tools": [{**TOOL, "type": "custom", "description": "d", "strict": True, "cache_control": cc,
                       "input_examples": [{"a": 1}]}],
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": False},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": None,
                                                       "citations": None}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                           {"type": "redacted_thinking", "data": "d"}, use]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok",
                                                       "is_error": False, "cache_control": cc}]}]}
    chat = messages_to_chat(body)
    assert chat["messages"][0] == {"role": "system", "content": "s"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                               "description": "d", "strict": True}}]
    assert "cache_control" not in str(chat) and "service_tier" not in chat


@pytest.mark.parametrize("table, params", [
    ("_BLOCK_KEYS", {"text": "TextBlockParam", "image": "ImageBlockParam", "document": "DocumentBlockParam",
                     "tool_use": "ToolUseBlockParam", "tool_result": "ToolResultBlockParam",
                     "thinking": "ThinkingBlockParam", "redacted_thinking": "RedactedThinkingBlockParam"}),
    ("_TOOL_CHOICE_KEYS", {"auto": "ToolChoiceAutoParam", "any": "ToolChoiceAnyParam", "tool": "ToolChoiceToolParam",
                           "none": "ToolChoiceNoneParam"}),
])
def test_every_key_the_anthropic_sdk_sends_is_taken(table, params):
    """The tables against the installed ``anthropic`` SDK's params: a key it documents is never refused."""
    import anthropic.types

    for kind, name in params.items():
        typed = getattr(anthropic.types, name)
        taken = set(getattr(anthropic_checks, table)[kind])
        assert set(typed.__required_keys__ | typed.__optional_keys__) <= taken, name


def test_every_tool_and_cache_control_key_the_anthropic_sdk_sends_is_taken():
    import anthropic.types

    for typed, keys in ((anthropic.types.ToolParam, anthropic_checks._TOOL_KEYS),
                        (anthropic.types.CacheControlEphemeralParam, anthropic_checks._CACHE_CONTROL_KEYS)):
        assert set(typed.__required_keys__ | typed.__optional_keys__) <= set(keys), typed


USE = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}


@pytest.mark.parametrize("body, param, message", [
    # a new user's trial: each of these was a 200
    ({"messages": [{"role": "user", "content": "   "}]}, "messages.0.content",
     "messages.0.content: text content blocks must contain non-whitespace text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "  "}]}]}, "messages.0.content.0.text",
     "messages.0.content.0.text: text content blocks must contain non-whitespace text"),
    ({"tools": [TOOL], "messages": [*USE, {"role": "user", "content": [{"type": "text", "text": "here"}, RESULT]}]},
     "messages.2.content.1", "messages.2: Did not find 1 `tool_result` block(s) at the beginning of this message. "
                             "Messages following `tool_use` blocks must begin with a matching number of `tool_result` "
                             "blocks."),
    ({"messages": [*USE, {"role": "user", "content": [RESULT]}]}, "tools",
     "Requests which include `tool_use` or `tool_result` blocks must define tools."),
    ({"tools": [], "messages": [*USE, {"role": "user", "content": [RESULT]}]}, "tools",
     "Requests which include `tool_use` or `tool_result` blocks must define tools."),
    # the prefill's own rule stays
    ({"messages": [*USER, {"role": "assistant", "content": "ok "}]}, "messages",
     "messages: final assistant content cannot end with trailing whitespace"),
])
def test_anthropics_rules_on_text_and_tool_blocks(body, param, message):
    for count_only in (False, True):       # count_tokens refuses what create refuses
        with pytest.raises(ClientError) as e:
            messages_to_chat({"model": "m", "max_tokens": 9, "messages": USER, **body}, count_only=count_only)
        assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_results_first_then_text_passes():
    chat = messages_to_chat({"model": "m", "max_tokens": 9, "tools": [TOOL], "messages": [
        *USE, {"role": "user", "content": [RESULT, {"type": "text", "text": " thanks "}]}]})
    assert chat["messages"][-2:] == [{"role": "tool", "tool_call_id": "t1", "content": "ok"},
                                     {"role": "user", "content": " thanks "}]


@pytest.mark.parametrize("turns, message", [
    # a new user's trial read "content block type 'document' is not supported in a user message" as a block in the
    # wrong place, and "in a assistant message"
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                    "data": "x"}}]}],
     "messages.0.content.0: 'document' blocks are not supported (a user message takes text, image and tool_result "
     "blocks)"),
    ([*USER, {"role": "assistant", "content": [RESULT]}],
     "messages.1.content.0: 'tool_result' blocks are not supported in an assistant message (it takes text, tool_use, "
     "thinking and redacted_thinking blocks)"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}],
     "messages.0.content.0: 'tool_use' blocks are not supported in a user message (it takes text, image and "
     "tool_result blocks)"),
])
def test_a_block_the_translation_does_not_take_is_said_so(turns, message):
    e = refused({"messages": turns})
    assert (e.param, e.message) == (message.split(":")[0] + ".type", message)
