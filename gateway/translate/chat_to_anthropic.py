"""Chat completions -> Anthropic's Messages API: a chat request (or a Responses one, which the gateway translates
onto chat) sent to a ``type: anthropic`` backend, as LiteLLM translates one for Claude
(https://docs.litellm.ai/docs/providers/anthropic). The answer comes back through the backend's own reading of
Anthropic's answers (``anthropic_answer.py``), as for a ``/v1/messages`` request.

- ``system`` and ``developer`` messages -> ``system`` (their texts joined by a blank line, wherever they stand);
  ``user`` text and ``image_url`` parts -> text and image blocks (a ``data:`` URL as a base64 source, another as
  a ``url`` source); an assistant's text and ``tool_calls`` -> text and ``tool_use`` blocks (the arguments parsed
  into ``input``); ``tool`` messages -> one user turn of ``tool_result`` blocks; turns of one role in a row are
  joined into one, as Anthropic's turns alternate; a conversation opening with the assistant gets a placeholder
  user turn first (``PLACEHOLDER_TEXT``), and a final assistant text (a prefill) loses its trailing whitespace
  (Anthropic refuses both as they are).
- ``tools`` -> ``{name, description, input_schema, strict}``; ``tool_choice`` auto / none / required / a named function
  -> ``auto`` / ``none`` / ``any`` / ``tool``; ``parallel_tool_calls: false`` -> ``disable_parallel_tool_use``.
- ``max_completion_tokens`` or ``max_tokens`` -> ``max_tokens`` (Anthropic requires one: ``DEFAULT_MAX_TOKENS``
  when the request and its route set none); ``stop`` -> ``stop_sequences`` (those of whitespace alone left out:
  Anthropic refuses them, LiteLLM drops them); ``user`` -> ``metadata.user_id``;
  ``temperature``, ``top_p``, ``top_k`` and ``stream`` as they are; a ``json_schema`` ``response_format`` ->
  ``output_config.format``.
- OpenAI-platform hints that change nothing the upstream answers (``metadata``, ``store``, ``service_tier``,
  ``stream_options``: Anthropic's stream always counts) are dropped, and so is a field at its "not asked" value
  (``n: 1``, ``logprobs: false``, ``top_logprobs: 0``, a penalty of 0, ``logit_bias: {}``, ``modalities:
  ["text"]``). Anything else (``n`` > 1, ``logprobs``, ``seed``, penalties, ``logit_bias``, ``reasoning_effort``,
  audio, a ``json_object`` format, a part other than text or an image, the legacy ``functions``, a
  ``temperature`` above Anthropic's 1, a conversation with no user or assistant content) is ``untranslatable``:
  the backend is skipped for that request, and a route with no other target answers 400 naming the field.
"""

from __future__ import annotations

import json

import msgspec

from gateway.errors import error_body
from gateway.values import GATEWAY_ONLY_FIELDS

# Anthropic requires max_tokens; a chat request may set none (LiteLLM's default for Anthropic models).
DEFAULT_MAX_TOKENS = 4096

_MAPPED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                     "stop", "stream", "tools", "tool_choice", "parallel_tool_calls", "user", "response_format"})
_DROPPED = frozenset({"metadata", "store", "service_tier", "stream_options", "prompt_cache_key",
                      "safety_identifier", *GATEWAY_ONLY_FIELDS})
_NOT_ASKED = {"n": (1,), "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0, 0.0),
              "frequency_penalty": (0, 0.0), "logit_bias": ({},), "modalities": (["text"],)}
# a conversation that opens with the assistant (a greeting shown before the user spoke) gets a user turn of this
# text first: Anthropic's turns begin with the user's (LiteLLM's modify_params placeholder)
PLACEHOLDER_TEXT = "."
_CHOICE = {"auto": {"type": "auto"}, "none": {"type": "none"}, "required": {"type": "any"}}


def untranslatable(body: dict) -> tuple[str, str] | None:
    """The first thing of a chat ``body`` (parsed, validated) that Anthropic's Messages API cannot take, as
    ``(param, reason)``; None when the whole body translates."""
    for k, v in body.items():
        if k not in _MAPPED and k not in _DROPPED and v not in _NOT_ASKED.get(k, ()):
            return k, f"Anthropic's Messages API has no counterpart of {k!r}"
    if isinstance(t := body.get("temperature"), (int, float)) and t > 1:
        return "temperature", f"Anthropic's temperature is at most 1, got {t}"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in ("text", "json_schema"):
        return "response_format", f"Anthropic's Messages API takes a json_schema format, not {rf.get('type')!r}"
    for i, m in enumerate(body.get("messages") or ()):
        if m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{i}].role", f"Anthropic's Messages API has no {m.get('role')!r} messages"
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if part.get("type") not in ("text", "refusal", "image_url"):
                    return (f"messages[{i}].content[{j}].type",
                            f"Anthropic's Messages API takes text and image parts, not {part.get('type')!r}")
        for j, call in enumerate(m.get("tool_calls") or () if m.get("role") == "assistant" else ()):
            if _input((call.get("function") or {}).get("arguments")) is None:   # an agents trial's became {}
                return (f"messages[{i}].tool_calls[{j}].function.arguments",
                        "Anthropic's tool_use input is a JSON object; these arguments are not one")
    for i, t in enumerate(body.get("tools") or ()):
        if t.get("type") != "function":
            return f"tools[{i}].type", f"Anthropic's Messages API takes function tools, not {t.get('type')!r}"
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") != "function":
        return "tool_choice", f"Anthropic's Messages API has no tool_choice of type {tc.get('type')!r}"
    if not any(_turn_blocks(m) for m in body.get("messages") or ()):   # every other message is system text
        return "messages", "Anthropic's Messages API needs a user or assistant message with content"
    return None


def _text(content) -> str:
    """The text of a message's ``content`` (a string, or its text parts joined by a newline, as the engine's chat
    rendering and vLLM's join them)."""
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text") or p.get("refusal") or "" for p in content or () if p.get("type") != "image_url")


def _image(url: str) -> dict:
    """An ``image_url`` part's URL -> Anthropic's image block: a ``data:`` URL's base64 data (``image/jpg``, which
    browsers write, as Anthropic's ``image/jpeg``), else the URL."""
    if url.startswith("data:") and "," in url:
        head, data = url[5:].split(",", 1)
        media = head.split(";")[0]
        return {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg" if media == "image/jpg"
                                            else media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content) -> list[dict]:
    """A user or assistant message's ``content`` -> Anthropic's content blocks (empty text left out: Anthropic
    refuses it)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out = []
    for p in content or ():
        if p.get("type") == "image_url":
            out.append(_image((p.get("image_url") or {}).get("url") or ""))
        elif text := p.get("text") or p.get("refusal"):
            out.append({"type": "text", "text": text})
    return out


def _input(arguments) -> dict | None:
    """A tool call's ``arguments`` (a JSON string) -> the ``tool_use`` block's ``input`` object: {} for none (""),
    None when they are not a JSON object (``untranslatable`` refuses those: Anthropic requires an object)."""
    if arguments is None or arguments == "":
        return {}
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _turn_blocks(m: dict) -> list[dict]:
    """A user, assistant or tool message's Anthropic content blocks ([] for a system one or an empty one): a tool
    result, or its text and images and an assistant's ``tool_use`` calls."""
    role = m.get("role")
    if role == "tool":
        return [{"type": "tool_result", "tool_use_id": m.get("tool_call_id"), "content": _text(m.get("content"))}]
    if role not in ("user", "assistant"):
        return []
    blocks = _blocks(m.get("content"))
    for call in m.get("tool_calls") or () if role == "assistant" else ():
        fn = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                       "input": _input(fn.get("arguments"))})
    return blocks


def _turns(messages: list[dict]) -> tuple[list[str], list[dict]]:
    """Chat messages -> (system texts, Anthropic turns: user and assistant alternating)."""
    system: list[str] = []
    turns: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            if text := _text(m.get("content")):
                system.append(text)
            continue
        blocks = _turn_blocks(m)
        role = "user" if role == "tool" else role
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    if turns and turns[0]["role"] == "assistant":
        turns.insert(0, {"role": "user", "content": [{"type": "text", "text": PLACEHOLDER_TEXT}]})
    if turns and turns[-1]["role"] == "assistant" and turns[-1]["content"][-1]["type"] == "text":
        last = turns[-1]["content"][-1]      # a prefill: Anthropic refuses one ending in whitespace
        last["text"] = last["text"].rstrip()
        if not last["text"]:
            turns[-1]["content"].pop()
            if not turns[-1]["content"]:
                turns.pop()
    return system, turns


def _tool_choice(body: dict) -> dict | None:
    tc, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if isinstance(tc, dict):
        out = {"type": "tool", "name": (tc.get("function") or {}).get("name")}
    elif isinstance(tc, str):
        out = dict(_CHOICE[tc])
    elif parallel is False and body.get("tools"):
        out = {"type": "auto"}
    else:
        return None
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def chat_to_messages(body: dict, model: str) -> dict:
    """A chat completions body (parsed, validated, ``untranslatable`` None) -> the Messages body for ``model`` (the
    upstream's name), as the module's docstring maps it."""
    system, turns = _turns(body["messages"])
    out: dict = {"model": model, "messages": turns,
                 "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS}
    if system:
        out["system"] = "\n\n".join(system)
    for k in ("temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            out[k] = body[k]
    # Anthropic refuses a stop sequence of whitespace alone ("\n", common with OpenAI's): left out, as LiteLLM does
    if stops := [s for s in ([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or ())
                 if s.strip()]:
        out["stop_sequences"] = stops
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if body.get("tools"):
        out["tools"] = [{"name": fn.get("name"), "input_schema": {"type": "object", **(fn.get("parameters") or {})},
                         **({"description": fn["description"]} if fn.get("description") else {}),
                         **({"strict": fn["strict"]} if isinstance(fn.get("strict"), bool) else {})}
                        for fn in (t.get("function") or {} for t in body["tools"])]
    if (tc := _tool_choice(body)) is not None:
        out["tool_choice"] = tc
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        out["output_config"] = {"format": {"type": "json_schema",
                                           "schema": (rf.get("json_schema") or {}).get("schema") or {}}}
    return out


def openai_error(status: int, content: bytes) -> bytes:
    """An Anthropic upstream's error body (``{"type": "error", "error": {"type", "message"}}``) as OpenAI's error
    JSON for a chat client (its message kept, its type as OpenAI names the status's); another body as it is."""
    try:
        obj = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return content
    err = obj.get("error") if isinstance(obj, dict) and obj.get("type") == "error" else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return content
    return error_body(status, err["message"], code=err.get("type") if isinstance(err.get("type"), str) else None)
