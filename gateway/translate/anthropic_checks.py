"""The checks of a ``/v1/messages`` body Anthropic makes and chat validation would not (or would name in chat's
paths): its sampling ranges, the pairing of ``tool_use`` and ``tool_result`` blocks (and unique ``tool_use`` ids),
an enabled ``thinking`` budget, ``output_config`` (its format's shape; not with a prefill), the tools' ``input_schema``
type. Each refusal is Anthropic's 400, naming the field by its dotted path; read by
``gateway/translate/anthropic.py``'s ``messages_to_chat``."""

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
    shown a result of a call it never made, or a call without its result)."""
    asked: dict = {}         # the tool_use ids of the message before -> its index
    for i, m in enumerate(msgs):
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        answered = set()
        if m.get("role") == "user":
            for j, b in enumerate(blocks):
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    if b.get("tool_use_id") not in asked:
                        raise bad_request(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                                          f"blocks: {b.get('tool_use_id')}. Each `tool_result` block must have a "
                                          "corresponding `tool_use` block in the previous message.",
                                          f"messages.{i}.content.{j}.tool_use_id")
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
        raise bad_request(f"metadata: Input should be a valid dictionary, got {type(meta).__name__}", "metadata")
    if meta.get("user_id") is not None and not isinstance(meta["user_id"], str):
        raise bad_request(f"metadata.user_id: Input should be a valid string, got {type(meta['user_id']).__name__}",
                          "metadata.user_id")
    if extra := sorted(set(meta) - {"user_id"}):   # Anthropic's schema has user_id alone (a trial's {"a": 1} passed)
        raise bad_request(f"metadata.{extra[0]}: Extra inputs are not permitted", f"metadata.{extra[0]}")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


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
        raise bad_request(f"output_config: Input should be a valid dictionary, got {_type_name(oc)}", "output_config")
    _no_extra(oc, ("format", "effort"), "output_config")
    if oc.get("effort") is not None and oc["effort"] not in _EFFORTS:
        raise bad_request("output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max', "
                          f"got {oc['effort']!r}", "output_config.effort")
    fmt = oc.get("format")
    if fmt is None:
        return None
    path = "output_config.format"
    if not isinstance(fmt, dict):
        raise bad_request(f"{path}: Input should be a valid dictionary, got {_type_name(fmt)}", path)
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
