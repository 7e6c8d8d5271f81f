"""Token counts of an answer the backend did not count (no ``usage``, or a stream the client left before its usage
chunk): the text of each choice as the client saw it, counted with the model's tokenizer when the local engine
answered, else with the prompts' estimator (``gateway/request/estimate.py``). Such a record is marked
``usage_estimated``.

What counts as completion text: ``content`` / ``text``, ``reasoning_content``, ``refusal``, and a tool call's
function ``name`` and ``arguments`` (the tokens the model generated for it), per choice ``index``.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from gateway.request.estimate import estimate_text_tokens
from gateway.values import ChoiceDelta

def counter_for(backend: Any) -> Callable[[str], int]:
    """The token counter of ``backend``'s answers: the local engine's tokenizer when it has one (exact for the
    text delivered), else ``estimate_text_tokens``."""
    tokenizer = getattr(getattr(backend, "engine", None), "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        return estimate_text_tokens
    return lambda text: len(tokenizer.encode(text)) if text else 0


def message_pieces(message: dict | None) -> list[str]:
    """The generated text of a chat ``message`` or stream ``delta`` (content, reasoning, refusal, tool calls)."""
    if not isinstance(message, dict):
        return []
    out = [v for k in ("content", "reasoning_content", "refusal") if isinstance(v := message.get(k), str) and v]
    calls = list(message.get("tool_calls") or [])
    if isinstance(message.get("function_call"), dict):
        calls.append({"function": message["function_call"]})
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out += [v for k in ("name", "arguments") if isinstance(v := fn.get(k), str) and v]
    return out


def choice_pieces(choice: Any) -> list[str]:
    """The generated text of one choice (``records._Choice`` or a dict): ``text``, or its message / delta."""
    get = choice.get if isinstance(choice, dict) else lambda k: getattr(choice, k, None)
    text = get("text")
    if isinstance(text, str):
        return [text] if text else []
    return message_pieces(get("message")) + message_pieces(get("delta"))


def delta_pieces(c: ChoiceDelta) -> list[str]:
    """The generated text of one streamed choice delta (``gateway.values.ChoiceDelta``): its text, reasoning,
    refusal, and each tool call's name and arguments pieces."""
    out = [v for v in (c.content, c.reasoning, c.refusal) if isinstance(v, str) and v]
    for t in c.tool_calls:
        out += [v for v in (t.name, t.arguments) if isinstance(v, str) and v]
    if isinstance(c.function_call, dict):
        out += [v for k in ("name", "arguments") if isinstance(v := c.function_call.get(k), str) and v]
    return out


def client_wants_usage(body: dict, option: str = "include_usage") -> bool:
    """True when a stream's client asked for the usage chunk itself (``stream_options.include_usage``; ``option``
    ``continuous_usage_stats``: vLLM's usage on every chunk, which vLLM gives only with ``include_usage`` too);
    else the gateway, which always asks its backends for it (the local engine for both), drops it from the
    client's stream."""
    opts = body.get("stream_options")
    return (isinstance(opts, dict) and opts.get(option) is True
            and (option == "include_usage" or opts.get("include_usage") is True))


def count_completion(texts: dict[int, list[str]], count: Callable[[str], int]) -> int:
    """Completion tokens of ``texts`` (choice index -> its text pieces, in order): each choice counted whole."""
    return sum(count("".join(pieces)) for pieces in texts.values())


def partial_usage(cancelled: BaseException) -> dict | None:
    """The usage a cancelled whole answer carries (the local engine's count up to the abort:
    ``engine.serving.serving.PARTIAL_USAGE``, the same attribute name); None when the backend could not know
    it (an upstream: what it generated before the connection closed is never reported)."""
    found = getattr(cancelled, "partial_usage", None)
    return found if isinstance(found, dict) else None


def estimated_usage(prompt_tokens: int, texts: dict[int, list[str]], count: Callable[[str], int]) -> dict:
    """OpenAI's ``usage`` object of an answer its backend did not count: ``prompt_tokens`` as counted at validation,
    the completion as ``count_completion`` counts ``texts``. The client gets it (LiteLLM fills computed usage the
    same way); the ledger's record of the answer says ``usage_estimated``."""
    completion = count_completion(texts, count)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def lacks_usage(content: bytes) -> bool:
    """Whether a whole chat or completion answer (JSON) carries no ``usage``: absent or null. Byte searches, no
    decode (every whole answer passes here before it is sent): in JSON a quoted ``"usage"`` followed by ``:`` is a
    key (quotes inside strings are escaped), written ``"usage":null`` by compact encoders and ``"usage": null`` by
    Python's ``json``."""
    keyed = b'"usage":' in content or b'"usage" :' in content
    return not keyed or b'"usage":null' in content or b'"usage": null' in content


def with_usage(content: bytes, usage: dict) -> bytes:
    """``content`` (a whole answer's JSON object) with ``usage`` set; unchanged when it is not a JSON object."""
    try:
        answer = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return content
    return msgspec.json.encode({**answer, "usage": usage}) if isinstance(answer, dict) else content
