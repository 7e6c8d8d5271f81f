"""The checks of a ``/v1/messages`` body Anthropic makes and chat validation would not (or would name in chat's
paths): its sampling ranges, the shape of each message, content block, tool, ``tool_choice`` and ``cache_control``
(the keys Anthropic documents, and their types), the pairing of ``tool_use`` and ``tool_result`` blocks (unique
``tool_use`` ids, results first in their message, tools defined), an enabled ``thinking`` budget, ``output_config``
(its format's shape; not with a prefill), the tools' ``input_schema`` type, the service hints' values. Each refusal is
Anthropic's 400, naming the field by its dotted path; read by ``gateway/translate/anthropic.py``'s
``messages_to_chat``."""

from __future__ import annotations

from gateway.errors import ClientError


def missing_or_wrong(body: dict, name: str, wanted: str, path: str | None = None) -> str:
    """The message for a field of ``body`` that is absent or of the wrong type (Anthropic's wording), named by
    its ``path`` in the request (default: ``name``, a top-level field)."""
    path = path or name
    if name not in body:
        return f"{path}: Field required ({wanted})"
    value = body[name]
    got = f"an empty {type(value).__name__}" if isinstance(value, (list, str, dict)) and not value \
        else type(value).__name__
    return f"{path}: Input should be {wanted}, got {got}"


def bad_request(message: str, param: str) -> ClientError:
    """Anthropic's 400 (``invalid_request_error``) with ``message``; ``param``: the field's dotted path in the
    Messages body (``native``: the chat translation's paths are not rewritten in it)."""
    return ClientError(400, message, param=param, code="invalid_request_error", native=True)


def check_thread(body: dict) -> None:
    """Refuses Anthropic's Threads (``thread``: server-held conversation state, the ``message-threads`` beta) with
    the error the SDK recovers from: ``error.details.error_code`` ``thread_unsupported_request``, on which its
    thread helpers and ``tool_runner`` (threaded by default) send the whole conversation again without ``thread``.
    The gateway holds no Messages conversation (its message ids are its own, and a conversation's turns may go to
    different backends), so it takes none, whatever the route (an agents trial's ``tool_runner`` got an "Extra
    inputs" 400 that the SDK cannot recover from)."""
    if "thread" in body:
        raise ClientError(400, "thread: this gateway holds no conversation state (Threads are not supported); send "
                               "the whole conversation in `messages` without `thread`", param="thread",
                          code="invalid_request_error", native=True,
                          details={"error_code": "thread_unsupported_request"})


def check_sampling(body: dict) -> None:
    """Anthropic's own ranges, narrower than chat's (which the translation's chat checks apply after), in its
    words: ``max_tokens`` >= 1 (when given: count_tokens has none), ``temperature`` and ``top_p`` in [0, 1],
    ``top_k`` an integer >= 0."""
    mt = body.get("max_tokens")
    if isinstance(mt, int) and not isinstance(mt, bool) and mt < 1:
        raise bad_request(f"max_tokens: Input should be greater than or equal to 1, got {mt!r}", "max_tokens")
    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise bad_request(f"{name}: Input should be a number between 0 and 1, got {v!r}", name)
    k = body.get("top_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise bad_request(f"top_k: Input should be an integer greater than or equal to 0, got {k!r}", "top_k")


def check_tool_results(msgs: list) -> None:
    """Anthropic's pairing rules: each ``tool_result`` answers a ``tool_use`` of the message just before it, and
    each ``tool_use`` is answered by a ``tool_result`` in the message just after it (else the backend would be
    shown a result of a call it never made, or a call without its result); the results come first in their
    message (a trial's text before its result was a 200: the translation had moved the result first)."""
    asked: dict = {}         # the tool_use ids of the message before -> its index
    for i, m in enumerate(msgs):
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        answered = set()
        other = False        # a block other than a tool_result came before
        for j, b in enumerate(blocks if m.get("role") == "user" else ()):
            if not isinstance(b, dict) or b.get("type") != "tool_result":
                other = True
                continue
            if b.get("tool_use_id") not in asked:
                raise bad_request(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                                  f"blocks: {b.get('tool_use_id')}. Each `tool_result` block must have a "
                                  "corresponding `tool_use` block in the previous message.",
                                  f"messages.{i}.content.{j}.tool_use_id")
            if other:
                raise bad_request(f"messages.{i}: Did not find {len(asked)} `tool_result` block(s) at the beginning of "
                                  "this message. Messages following `tool_use` blocks must begin with a matching "
                                  "number of `tool_result` blocks.", f"messages.{i}.content.{j}")
            answered.add(b["tool_use_id"])
        _no_use_unanswered(asked, answered)
        asked = {}
        for j, b in enumerate(blocks):
            if isinstance(b, dict) and b.get("type") == "tool_use":
                if b.get("id") in asked:
                    raise bad_request(f"messages.{i}.content.{j}: `tool_use` ids must be unique; {b.get('id')} is "
                                      "used twice in this message", f"messages.{i}.content.{j}.id")
                asked[b.get("id")] = i
    _no_use_unanswered(asked, set())


def check_tools_defined(body: dict) -> None:
    """Anthropic's rule: a conversation with ``tool_use`` or ``tool_result`` blocks defines ``tools`` (a trial's
    history of calls without them was a 200)."""
    if body.get("tools"):
        return
    for m in body["messages"]:
        for b in m["content"] if isinstance(m.get("content"), list) else ():
            if isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result"):
                raise bad_request("Requests which include `tool_use` or `tool_result` blocks must define tools.",
                                  "tools")


def _no_use_unanswered(asked: dict, answered: set) -> None:
    if missing := [k for k in asked if k not in answered]:
        i = asked[missing[0]]
        raise bad_request(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                          f"{', '.join(map(str, missing))}. Each `tool_use` block must have a corresponding "
                          "`tool_result` block in the next message.", f"messages.{i}.content")


def check_thinking(body: dict) -> None:
    """Anthropic's bounds on an enabled ``thinking`` budget (the hint itself is dropped on translated backends):
    an integer of at least 1024 tokens, below ``max_tokens``."""
    th = body.get("thinking")
    if th is None:
        return
    if not isinstance(th, dict):       # a trial's thinking: 5 was taken
        raise bad_request(missing_or_wrong(body, "thinking", "a valid dictionary"), "thinking")
    if th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"thinking.type: Input tag {th.get('type')!r} found using 'type' does not match any of the "
                          "expected tags: 'enabled', 'disabled', 'adaptive'", "thinking.type")
    if th["type"] != "enabled":
        return
    n = th.get("budget_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1024:
        raise bad_request(f"thinking.enabled.budget_tokens: Input should be an integer greater than or equal to 1024, "
                          f"got {n!r}", "thinking.budget_tokens")
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] <= n:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`", "max_tokens")


def check_metadata(body: dict) -> None:
    """Anthropic's ``metadata``: an object of ``user_id`` alone (the gateway's canary key), a string."""
    meta = body.get("metadata")
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise _wrong_type("metadata", "a valid dictionary", meta)
    if meta.get("user_id") is not None and not isinstance(meta["user_id"], str):
        raise _wrong_type("metadata.user_id", "a valid string", meta["user_id"])
    _no_extra(meta, ("user_id",), "metadata")   # Anthropic's schema has user_id alone (a trial's {"a": 1} passed)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _wrong_type(path: str, wanted: str, value: object) -> ClientError:
    """Anthropic's 400 for a field at ``path`` whose ``value`` is not ``wanted`` (its type named)."""
    return bad_request(f"{path}: Input should be {wanted}, got {_type_name(value)}", path)


def _check_bool(obj: dict, key: str, path: str) -> None:
    """``obj[key]`` (``obj`` at ``path``), when given, a boolean; the refusal names the value (a trial's
    ``"yes"``)."""
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{path}.{key}: Input should be a valid boolean, got {value!r}", f"{path}.{key}")


def check_tool_schema(tool: dict, i: int) -> None:
    """Anthropic's ``tools[i].input_schema``: an object schema, ``type`` ``"object"`` (a tool's input is an object;
    an array schema's arguments would come back as something the tool's own schema refuses)."""
    schema, path = tool.get("input_schema"), f"tools.{i}.input_schema"
    if not isinstance(schema, dict):
        raise bad_request(missing_or_wrong(tool, "input_schema", "a valid dictionary", path), path)
    if "type" not in schema:
        raise bad_request(f"{path}.type: Field required", f"{path}.type")
    if schema["type"] != "object":
        raise bad_request(f"{path}.type: Input should be 'object', got {schema['type']!r}", f"{path}.type")


_EFFORTS = ("low", "medium", "high", "xhigh", "max")


def check_output_config(body: dict) -> dict | None:
    """Anthropic's ``output_config``: an object of ``format`` and ``effort`` (both may be null; any other key is
    refused). ``effort`` is a service hint: its value is checked, then it is dropped. ``format`` is
    ``{"type": "json_schema", "schema": {...}}`` exactly: a schema under another key would otherwise go
    unenforced. A format with a prefill (the last message's role ``assistant``) is refused, as Anthropic documents
    prefilling as incompatible with structured outputs (the grammar would start over after the prefill).

    Returns:
        The format's JSON schema; None when there is no format.
    """
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise _wrong_type("output_config", "a valid dictionary", oc)
    _no_extra(oc, ("format", "effort"), "output_config")
    if oc.get("effort") is not None and oc["effort"] not in _EFFORTS:
        raise bad_request("output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max', "
                          f"got {oc['effort']!r}", "output_config.effort")
    fmt = oc.get("format")
    if fmt is None:
        return None
    path = "output_config.format"
    if not isinstance(fmt, dict):
        raise _wrong_type(path, "a valid dictionary", fmt)
    errors = [] if fmt.get("type") == "json_schema" else [
        (f"{path}.type", "Field required" if "type" not in fmt else
         f"Input should be 'json_schema', got {fmt['type']!r}")]
    if not isinstance(fmt.get("schema"), dict):
        errors.append((f"{path}.schema", "Field required" if "schema" not in fmt else
                       f"Input should be a valid dictionary, got {_type_name(fmt['schema'])}"))
    errors += [(f"{path}.{k}", "Extra inputs are not permitted") for k in fmt if k not in ("type", "schema")]
    if errors:       # all of the format's errors: a schema under another key is told both what is missing and why
        raise bad_request("; ".join(f"{p}: {why}" for p, why in errors), errors[0][0])
    msgs = body.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
        raise bad_request(f"{path}: prefilling the assistant message cannot be combined with structured outputs "
                          f"(the last message, messages.{len(msgs) - 1}, has role 'assistant')", path)
    return fmt["schema"]


def _no_extra(obj: dict, allowed: tuple, path: str) -> None:
    for k in obj:
        if k not in allowed:
            raise bad_request(f"{path}.{k}: Extra inputs are not permitted", f"{path}.{k}")


# The keys Anthropic documents (its SDK's params: tests/gateway/translate/test_anthropic_checks.py) for each content
# block type a Messages body may carry; any other is its "Extra inputs are not permitted" (a trial's text block with
# "foo": 1 was a 200). Those the translation has no use for are dropped.
_BLOCK_KEYS = {"text": ("type", "text", "cache_control", "citations"),
               "image": ("type", "source", "cache_control", "transformations"),
               "document": ("type", "source", "title", "context", "citations", "cache_control"),
               "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
               "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
               "thinking": ("type", "thinking", "signature"),
               "redacted_thinking": ("type", "data")}
# The block types the translation takes in each role's message (``document`` and server tools' blocks have no chat
# counterpart; a tool's result is the user's, its call the assistant's).
_ROLE_BLOCKS = {"user": ("text", "image", "tool_result"),
                "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
_CACHE_CONTROL_KEYS = ("type", "ttl")
_TTLS = ("5m", "1h")


def check_cache_control(obj: dict, path: str) -> None:
    """Anthropic's ``cache_control`` of ``obj`` (at ``path``; "" for the body itself), when present and not null:
    ``{"type": "ephemeral"}`` with an optional ``ttl`` of ``"5m"`` or ``"1h"``. A hint the translation drops,
    checked as Anthropic checks it (a trial's ``"yes"`` and ``{"type": "bogus"}`` were 200s)."""
    cc = obj.get("cache_control")
    if cc is None:
        return
    path = f"{path}.cache_control" if path else "cache_control"
    if not isinstance(cc, dict):
        raise _wrong_type(path, "a valid dictionary", cc)
    if cc.get("type") != "ephemeral":
        raise bad_request(f"{path}.type: Field required" if "type" not in cc else
                          f"{path}.type: Input should be 'ephemeral', got {cc['type']!r}", f"{path}.type")
    _no_extra(cc, _CACHE_CONTROL_KEYS, path)
    if cc.get("ttl") is not None and cc["ttl"] not in _TTLS:
        raise bad_request(f"{path}.ttl: Input should be '5m' or '1h', got {cc['ttl']!r}", f"{path}.ttl")


def check_keys(block: dict, kind: str, path: str) -> None:
    """A ``kind`` block's keys are those Anthropic documents for it, and its ``cache_control`` (where it may have
    one) is well formed."""
    _no_extra(block, _BLOCK_KEYS[kind], path)
    check_cache_control(block, path)


def check_message(m: object, i: int) -> None:
    """Messages turn ``i``: an object of ``role`` (``user`` or ``assistant``) and ``content`` alone (a trial's
    ``"name": "bob"`` was a 200)."""
    p = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in _ROLE_BLOCKS:
        raise bad_request(f"{p}.role: Input should be 'user' or 'assistant'", f"{p}.role")
    _no_extra(m, ("role", "content"), p)


def _some(names: tuple) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1]


def check_block(b: object, path: str, role: str) -> str:
    """Content block ``b`` at ``path`` of a ``role`` message: its type one the translation takes there, its keys
    Anthropic's, its fields of their types (text: ``check_text``; tool_use: an id, a name, an
    input object; tool_result: the id it answers, a boolean ``is_error``). Returns its type."""
    if not isinstance(b, dict):
        raise _wrong_type(path, "a valid dictionary", b)
    if not isinstance(b.get("type"), str):
        raise bad_request(missing_or_wrong(b, "type", "a string", f"{path}.type"), f"{path}.type")
    kind, allowed = b["type"], _ROLE_BLOCKS[role]
    if kind not in allowed:      # said as such: a trial read "type 'document' ... in a user message" as misplaced
        message = ("an " if role == "assistant" else "a ") + f"{role} message"
        if any(kind in kinds for kinds in _ROLE_BLOCKS.values()):     # taken, in the other role's message
            why = f"in {message} (it takes {_some(allowed)} blocks)"
        else:
            why = f"({message} takes {_some(allowed)} blocks)"
        raise bad_request(f"{path}: {kind!r} blocks are not supported {why}", f"{path}.type")
    check_keys(b, kind, path)
    if kind == "text":
        if not isinstance(b.get("text"), str):
            raise bad_request(missing_or_wrong(b, "text", "a valid string", f"{path}.text"), f"{path}.text")
        check_text(b["text"], f"{path}.text")
    elif kind == "tool_use":
        for field, wanted in (("id", "a string"), ("name", "a string")):
            if not isinstance(b.get(field), str) or not b[field]:
                raise bad_request(missing_or_wrong(b, field, wanted, f"{path}.{field}"), f"{path}.{field}")
        if not isinstance(b.get("input"), dict):
            raise bad_request(missing_or_wrong(b, "input", "an object", f"{path}.input"), f"{path}.input")
    elif kind == "tool_result":
        if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
            raise bad_request(missing_or_wrong(b, "tool_use_id", "a string", f"{path}.tool_use_id"),
                              f"{path}.tool_use_id")
        _check_bool(b, "is_error", path)
    return kind


def check_text(text: str, path: str) -> None:
    """Anthropic's rule for a text block's text (or a turn's string content) at ``path``: not empty, and not
    whitespace alone (a trial's ``"   "`` was a 200)."""
    if not text:
        raise bad_request(f"{path}: text content blocks must be non-empty", path)
    if not text.strip():
        raise bad_request(f"{path}: text content blocks must contain non-whitespace text", path)


_TOOL_KEYS = ("name", "description", "input_schema", "cache_control", "type", "strict", "input_examples",
              "allowed_callers", "defer_loading", "eager_input_streaming")
_TOOL_FIELDS = (("description", str, "a valid string"), ("input_examples", list, "a valid list"))


def check_tool(t: object, i: int) -> None:
    """``tools[i]``: a client tool (``type`` absent or ``"custom"``; a server tool has no chat counterpart) of the
    keys Anthropic documents, a string ``name``, its optional fields of their types, an object ``input_schema``."""
    path = f"tools.{i}"
    if not isinstance(t, dict):
        raise _wrong_type(path, "a valid dictionary", t)
    if t.get("type") not in (None, "custom"):
        raise bad_request(f"{path}: server tool {t.get('type')!r} is not supported; only client tools with an "
                          "input_schema", f"{path}.type")
    if not isinstance(t.get("name"), str):
        raise bad_request(missing_or_wrong(t, "name", "a valid string", f"{path}.name"), f"{path}.name")
    _no_extra(t, _TOOL_KEYS, path)
    for field, kind, wanted in _TOOL_FIELDS:
        if t.get(field) is not None and not isinstance(t[field], kind):
            raise _wrong_type(f"{path}.{field}", wanted, t[field])
    _check_bool(t, "strict", path)
    check_cache_control(t, path)
    check_tool_schema(t, i)


# Each tool_choice type's keys (``disable_parallel_tool_use`` taken with ``none`` too: it asks nothing there).
_TOOL_CHOICE_KEYS = {"auto": ("type", "disable_parallel_tool_use"), "any": ("type", "disable_parallel_tool_use"),
                     "tool": ("type", "name", "disable_parallel_tool_use"),
                     "none": ("type", "disable_parallel_tool_use")}


def check_tool_choice(tc: object) -> None:
    """``tool_choice``: a known type, its keys alone, the forced tool's ``name`` (type ``tool``), a boolean
    ``disable_parallel_tool_use`` (a trial's ``"yes"`` was a 200)."""
    if not isinstance(tc, dict) or tc.get("type") not in _TOOL_CHOICE_KEYS:
        raise bad_request("tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'", "tool_choice")
    _no_extra(tc, _TOOL_CHOICE_KEYS[tc["type"]], "tool_choice")
    if tc["type"] == "tool" and (not isinstance(tc.get("name"), str) or not tc["name"]):
        raise bad_request(missing_or_wrong(tc, "name", "a string", "tool_choice.name"), "tool_choice.name")
    _check_bool(tc, "disable_parallel_tool_use", "tool_choice")


_SERVICE_TIERS = ("auto", "standard_only")


def check_hints(body: dict) -> None:
    """The service hints the translation drops, checked first as Anthropic checks them: ``service_tier`` one of
    its tiers, the body's own ``cache_control`` (automatic caching) well formed."""
    tier = body.get("service_tier")
    if tier is not None and tier not in _SERVICE_TIERS:
        raise bad_request(f"service_tier: Input should be 'auto' or 'standard_only', got {tier!r}", "service_tier")
    check_cache_control(body, "")
