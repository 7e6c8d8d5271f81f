"""Refusals of the chat translation of a ``POST /v1/responses`` body named as the Responses parameters the client
wrote, as pure functions: the chat pipeline (validation, ranges, a backend's 400, the engine's schema check) names
the chat body's paths (``max_tokens``, ``response_format.json_schema.schema...``, ``messages[k]...``), which the
client never sent.
"""

from __future__ import annotations

import re

from gateway.errors import ClientError

# Paths of the chat body a 400 of the chat pipeline names (validation, ranges, the engine's schema check) -> the
# Responses paths they came from, most specific first. A path is renamed only where it starts (after a quote,
# a space or the message's start; not in a URL path such as ``/v1/messages``): a schema property called
# ``messages`` is the client's own name. A message
# index of the chat body is not the client's (instructions and history come first): ``input`` alone.
_CHAT_PATHS = (
    (re.compile(r"(?<![\w.\]/])response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"(?<![\w.\]/])response_format(\.json_schema)?\b"), "text.format"),
    (re.compile(r"(?<![\w.\]/])max_tokens\b"), "max_output_tokens"),
    (re.compile(r"(?<![\w.\]/])tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"(?<![\w.\]/])tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"(?<![\w.\]/])messages(\[\d+\](\.\w+)*)?"), "input"),
)


# A backend's refusal of an image part of the chat translation (the local engine takes text only)
_IMAGE_PART = re.compile(r"messages\[\d+\]\.content\[\d+\]: part type 'image_url' is not supported")


def _image_part(body: dict | None) -> str | None:
    """The path of the first ``input_image`` part of the client's Responses ``body`` (``input[i].content[j]``, or
    ``input[i].output[j]`` of a ``function_call_output``), or None."""
    items = body.get("input") if isinstance(body, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else ()):
        for key in ("content", "output"):
            parts = item.get(key) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    return f"input[{i}].{key}[{j}]"
    return None


def responses_path(text: str) -> str:
    """``text`` (a ``param`` or an error message) with each chat path named as the Responses parameter it came
    from (``max_tokens`` -> ``max_output_tokens``, ``response_format.json_schema.schema.x`` ->
    ``text.format.schema.x``, ``tools[0].function.parameters`` -> ``tools[0].parameters``)."""
    for pattern, new in _CHAT_PATHS:
        text = pattern.sub(new, text)
    return text


def responses_error_object(error: dict, body: dict | None = None) -> dict:
    """An OpenAI error object answered for the translated chat body (a backend's 400, a stream's error event),
    its ``message`` and ``param`` naming the Responses parameters the client wrote; with the client's Responses
    ``body`` at hand, a refused ``image_url`` part is named as the ``input_image`` part it came from (a chat
    message index is not the client's: only the body says which item held it)."""
    out = {k: responses_path(v) if k in ("message", "param") and isinstance(v, str) else v
           for k, v in error.items()}
    message = error.get("message")
    m = _IMAGE_PART.search(message) if body is not None and isinstance(message, str) else None
    if m is not None and (path := _image_part(body)) is not None:
        out["message"] = (message[:m.start()] + f"{path}: content part type 'input_image' is not supported"
                          + responses_path(message[m.end():]))
        out["param"] = f"{path}.type"
    return out


def responses_error(e: ClientError) -> ClientError:
    """A refusal of the translated chat body, naming (in ``param`` and the message) the Responses parameter the
    client wrote."""
    param = responses_path(e.param) if e.param else e.param
    return ClientError(e.status, responses_path(e.message), param, e.code, e.headers)

