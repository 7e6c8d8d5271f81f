"""A battery of chat and completion requests for SmolLM2 through the official ``openai`` SDK, answered streamed and
not: greedy and seeded sampling, ``n`` > 1, logprobs, stop strings, tool calls (required, named, auto), structured
outputs (``json_schema``, ``json_object``, vLLM's ``structured_outputs``), usage (final and continuous), echo and
several prompts. ``run_battery`` returns every answer as plain data with what legitimately differs between two
servers removed (``id``, ``created``, the tool-call ids the engine draws), so two runs compare with ``==``: the
gateway's local backend against ``tandem engine serve`` (``test_local_parity.py``)."""

from __future__ import annotations

import time

import openai

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}

CHAT = {
    "greedy_logprobs": dict(messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3),
    "seeded_n2": dict(messages=ASK, max_tokens=10, temperature=0.9, seed=7, n=2),
    "stop": dict(messages=ASK, max_tokens=24, temperature=0, stop=[" Paris", "."]),
    "tool_required": dict(messages=ASK_WEATHER, max_tokens=40, temperature=0, tools=[WEATHER_TOOL],
                          tool_choice="required"),
    "tool_named": dict(messages=ASK_WEATHER, max_tokens=40, temperature=0, tools=[WEATHER_TOOL],
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "tool_auto": dict(messages=ASK_WEATHER, max_tokens=40, temperature=0, tools=[WEATHER_TOOL]),
    "tool_cut": dict(messages=ASK_WEATHER, max_tokens=14, temperature=0, tools=[WEATHER_TOOL],
                     tool_choice="required"),
    "json_schema": dict(messages=[{"role": "user", "content": "Invent a person."}], max_tokens=40, temperature=0,
                        response_format=PERSON),
    "json_object": dict(messages=[{"role": "user", "content": "A JSON object about Paris."}], max_tokens=24,
                        temperature=0, response_format={"type": "json_object"}),
    "choice": dict(messages=ASK, max_tokens=8, temperature=0,
                   extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}}),
}
COMPLETIONS = {
    "text_logprobs": dict(prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2),
    "echo": dict(prompt="Once upon a time", max_tokens=6, temperature=0, echo=True, logprobs=1),
    "two_prompts": dict(prompt=["Hello, my name is", "The sky is"], max_tokens=6, temperature=0),
    "stop": dict(prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"]),
}


def _scrub(obj, call_ids: dict):
    """``obj`` (an SDK model dumped) without the fields two servers fill differently; tool-call ids numbered in
    order of appearance (the same call keeps the same number)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in ("id", "created") and not isinstance(v, dict):
                if k == "id" and isinstance(v, str) and v.startswith("call_"):
                    out[k] = call_ids.setdefault(v, f"call-{len(call_ids)}")
                continue
            out[k] = _scrub(v, call_ids)
        return out
    if isinstance(obj, list):
        return [_scrub(v, call_ids) for v in obj]
    return obj


def _by_choice(chunks: list[dict]) -> list[dict]:
    """A stream's chunks in choice order, each choice's in their own order: the choices of several prompts are
    separate engine requests, whose outputs interleave as they come (the usage chunk, which has no choice, last)."""
    return sorted(chunks, key=lambda c: c["choices"][0]["index"] if c["choices"] else float("inf"))


def _again(call, *args, **kw):
    """``call``, sent again while the engine answers that a grammar is still compiling (a 503 that asks for it:
    the compile goes on in the engine; on a loaded machine it may take longer than a request's wait)."""
    for _ in range(20):
        try:
            return call(*args, **kw)
        except openai.APIStatusError as e:
            if e.status_code != 503 or "still compiling" not in str(e):
                raise
            time.sleep(3)
    return call(*args, **kw)


def first_difference(a, b, path: str = "") -> str | None:
    """Where two scrubbed answers first part, as ``path: a != b`` (None when equal): a failing comparison's message
    names the field and both values, which pytest's truncated repr of two whole answers hides."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'the first' if k in a else 'the second'}"
            found = first_difference(a[k], b[k], f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None if len(a) == len(b) else f"{path}: {len(a)} items != {len(b)}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def run_battery(base_url: str, model: str, headers: dict | None = None) -> dict:
    """Every request of the battery against ``base_url`` (an OpenAI ``/v1`` base), whole and streamed (with
    ``include_usage``; the greedy one also with vLLM's ``continuous_usage_stats``): name -> scrubbed answer
    (a streamed one: its list of chunks)."""
    client = openai.OpenAI(base_url=base_url, api_key="battery", max_retries=0, timeout=300,
                           default_headers=headers or {})
    out: dict = {}
    for api, requests in (("chat", CHAT), ("completions", COMPLETIONS)):
        create = client.chat.completions.create if api == "chat" else client.completions.create
        for name, kw in requests.items():
            out[f"{api}/{name}"] = _scrub(_again(create, model=model, **kw).model_dump(), {})
            chunks = _again(create, model=model, stream=True, stream_options={"include_usage": True}, **kw)
            out[f"{api}/{name}/stream"] = _scrub(_by_choice([c.model_dump() for c in chunks]), {})
    kw = dict(CHAT["greedy_logprobs"], extra_body={"stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}})
    out["chat/continuous_usage/stream"] = _scrub(
        [c.model_dump() for c in client.chat.completions.create(model=model, stream=True, **kw)], {})
    return out
