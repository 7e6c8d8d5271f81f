"""The engine's OpenAI-compatible server, end to end through the official
``openai`` client against a live server on 127.0.0.1 (SmolLM2, float32).

One in-process server (``server``: uvicorn in a thread, chunked prefill with
a 256-token budget, max_model_len 1024; conftest.py's, shared with
test_serving_request_semantics.py); the real ``tandem engine serve`` CLI in a
subprocess (unchunked) only for the chunked-prefill comparison and the SIGTERM
drain. Every successful response is re-validated against the SDK's
pydantic types (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.entrypoints.server import KEEP_ALIVE_S, build_app
from tests.conftest import free_port

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
PREFILL_CHUNK = 256     # max_num_batched_tokens: a prompt over 2 * 256 tokens is prefilled in 3+ chunks
ALPHABET_PROMPT = "The alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ. Again:"
CODE_PROMPT = "def setup():\n    a = 1\n\n    b = 2\n\n    c = 3\n\n    d"  # "\n\n    " is one token
EMOJI_HANGUL_PROMPT = " ".join(["안녕 🎉"] * 10) + " 안녕"


@dataclass
class LiveServer:
    base_url: str
    client: openai.OpenAI
    model: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=120)


def start_server(**engine_kwargs) -> LiveServer:
    """``tandem engine serve`` in a thread: build_app + uvicorn on a free port."""
    engine = AsyncEngine(EngineArgs(**engine_kwargs))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    base = f"http://127.0.0.1:{port}"
    while not (server.started and engine.ready):  # it listens first, then loads the model
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the engine server did not start")
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    return LiveServer(base, client, engine.served_model_name, engine, server, thread)


@pytest.fixture
def server(float32_server):
    return float32_server


# ----------------------------------------------------------------- helpers
def chat(s: LiveServer, **kw) -> ChatCompletion:
    raw = s.client.chat.completions.with_raw_response.create(model=s.model, **kw)
    return ChatCompletion.model_validate_json(raw.http_response.text)


def complete(s: LiveServer, **kw) -> Completion:
    raw = s.client.completions.with_raw_response.create(model=s.model, **kw)
    return Completion.model_validate_json(raw.http_response.text)


def chat_stream(s: LiveServer, **kw) -> list[ChatCompletionChunk]:
    chunks = []
    for chunk in s.client.chat.completions.create(model=s.model, stream=True, **kw):
        chunks.append(ChatCompletionChunk.model_validate(chunk.to_dict()))
    return chunks


def complete_stream(s: LiveServer, **kw) -> list[Completion]:
    """Streamed completions; chunks that finish a choice (and the usage
    chunk) are validated as ``Completion`` (the SDK type requires a
    ``finish_reason``, which OpenAI's own stream leaves null until the end)."""
    chunks = []
    for chunk in s.client.completions.create(model=s.model, stream=True, **kw):
        if all(c.finish_reason is not None for c in chunk.choices):
            Completion.model_validate(chunk.to_dict())
        chunks.append(chunk)
    return chunks


def stream_text(chunks, index: int = 0) -> str:
    return "".join(c.text for ch in chunks for c in ch.choices if c.index == index)


def scrape(s: LiveServer) -> dict[str, float]:
    """``/metrics`` as {sample name (+ finished_reason): value}."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{s.base_url}/metrics").text):
        for sample in fam.samples:
            assert sample.labels.get("model_name") == s.model
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


def wait_until(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def concurrently(*calls):
    """Each of ``calls`` (no-argument callables: requests) in a thread of its own; their results, in order.

    Requests that do not depend on one another's results are sent together so that the engine decodes them
    in one batch (a step of SmolLM2 costs about the same for 1 sequence as for 6 on a CPU). The engine is
    batch-invariant (docs/app-teams/reproducibility.md; ``test_seeded_request_is_independent_of_batching``), so
    every output is the one the request would get alone."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def counting_prompt(tokenizer, min_tokens: int) -> tuple[str, int]:
    """"0, 1, 2, ..." with at least ``min_tokens`` tokens; returns (prompt, next number)."""
    parts = []
    i = 0
    while len(tokenizer.encode(", ".join(parts), add_special_tokens=True)) < min_tokens:
        parts.append(str(i))
        i += 1
    return ", ".join(parts), i


# ------------------------------------------------------------------- tests
def test_models_health_and_plain_chat(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    r = chat(server, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.model == server.model
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_fields_the_server_does_not_read_are_taken_and_logged_as_vllm_does(server, caplog):
    """vLLM's server serves a request with fields it does not know and logs them; a sampling trial: taken
    without a word."""
    with caplog.at_level("WARNING", logger="tandem.server"):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "store": True, "not_a_field": 1})
    assert r.status_code == 200, r.text
    said = [rec.getMessage() for rec in caplog.records if rec.name == "tandem.server"]
    assert "The following fields were present in the request but ignored: ['not_a_field', 'store']" in said


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_body_nested_past_the_decoders_limit_is_a_400(server, path):
    """msgspec raises RecursionError past ~1,000 levels: a client's 400, never a 500 with a traceback."""
    raw = '{"model": "x", "messages": ' + "[" * 3000 + "]" * 3000 + "}"
    r = httpx.post(server.base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json" and "deep" in r.text


def test_stop_string_is_never_streamed(server):
    free, full, chunks = concurrently(
        lambda: complete(server, prompt=ALPHABET_PROMPT, max_tokens=12, temperature=0),
        lambda: complete(server, prompt=ALPHABET_PROMPT, max_tokens=12, temperature=0, stop=["DEFGHIJ"]),
        lambda: complete_stream(server, prompt=ALPHABET_PROMPT, max_tokens=12, temperature=0, stop=["DEFGHIJ"]))
    free = free.choices[0].text
    assert "DEFGHIJ" in free, free  # precondition: the model continues the alphabet
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "DEFGHIJ"
    assert free.startswith(choice.text + "DEFGHIJ")
    deltas = [c.text for ch in chunks for c in ch.choices]
    assert "".join(deltas) == choice.text
    assert not set("DEFGHIJ") & set("".join(deltas))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_fused_into_a_larger_token(server):
    free, full, chunks = concurrently(
        lambda: complete(server, prompt=CODE_PROMPT, max_tokens=10, temperature=0, logprobs=0).choices[0],
        lambda: complete(server, prompt=CODE_PROMPT, max_tokens=10, temperature=0, stop="\n\n").choices[0],
        lambda: complete_stream(server, prompt=CODE_PROMPT, max_tokens=10, temperature=0, stop="\n\n"))
    assert "\n\n" in free.text, free.text
    fused = [t for t in free.logprobs.tokens if "\n\n" in t and len(t) > 2]
    assert fused, (free.logprobs.tokens, free.text)  # precondition: "\n\n" sits inside a larger token
    assert full.finish_reason == "stop"
    assert full.text == free.text[: free.text.index("\n\n")] and full.text
    assert stream_text(chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_emoji_and_hangul_stream_without_replacement_chars(server):
    chunks, whole = concurrently(
        lambda: complete_stream(server, prompt=EMOJI_HANGUL_PROMPT, max_tokens=27, temperature=0),
        lambda: complete(server, prompt=EMOJI_HANGUL_PROMPT, max_tokens=27, temperature=0))
    deltas = [c.text for ch in chunks for c in ch.choices]
    assert all("\ufffd" not in d for d in deltas), deltas
    text = "".join(deltas)
    assert "🎉" in text and "안녕" in text, text
    assert text == whole.choices[0].text


def test_n3_choices_have_indices_and_finish_reasons(server):
    msgs = [{"role": "user", "content": "Name a color."}]
    r = chat(server, messages=msgs, n=3, temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # the children differ
    assert 3 <= r.usage.completion_tokens <= 3 * 8
    chunks = chat_stream(server, messages=msgs, n=3, temperature=1.0, seed=11, max_tokens=8)
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for ch in chunks:
        assert len(ch.choices) == 1
        c = ch.choices[0]
        assert c.index in finishes
        if c.finish_reason is not None:
            finishes[c.index].append(c.finish_reason)
    assert all(len(v) == 1 for v in finishes.values()), finishes
    # Every index got its role chunk and some content.
    for i in range(3):
        assert any(c.delta.role == "assistant" for ch in chunks for c in ch.choices if c.index == i)
        assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == i)


def test_seeded_request_is_independent_of_batching(server):
    seeded = dict(prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=42)
    alone = complete(server, **seeded).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(4):
            f_seeded = pool.submit(complete, server, **seeded)
            f_other = pool.submit(complete, server, prompt="The weather today is", max_tokens=10, temperature=1.0)
            assert f_seeded.result().choices[0].text == alone
            f_other.result()


def test_stream_usage_only_in_the_final_chunk(server):
    msgs = [{"role": "user", "content": "Count to ten."}]
    chunks = chat_stream(server, messages=msgs, n=2, max_tokens=8, temperature=0, stream_options={"include_usage": True},
                         extra_body={"ignore_eos": True})
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 16
    assert all(ch.usage is None for ch in chunks[:-1])
    assert {c.index for ch in chunks for c in ch.choices} == {0, 1}
    plain = chat_stream(server, messages=msgs, n=2, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)
    # Completions: same rule.
    comp = complete_stream(server, prompt="Hello", max_tokens=4, temperature=0, stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True})
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens == 4
    assert all(ch.usage is None for ch in comp[:-1])


def test_chat_without_max_tokens_fills_the_context(server):
    prompt, _ = counting_prompt(server.engine.tokenizer, MAX_MODEL_LEN - 48)  # + ~30 template tokens
    r = chat(server, messages=[{"role": "user", "content": prompt}], temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN
    assert r.usage.completion_tokens > 0


def test_logprobs_follow_openai_format(server):
    r = chat(server, messages=[{"role": "user", "content": "Say yes."}], max_tokens=4, temperature=0,
             logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes is not None and entry.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == r.choices[0].message.content
    c = complete(server, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    # echo + logprobs: the first prompt token has no logprob: null, as OpenAI and vLLM send it (the SDK's
    # type says float, so this one response is checked as JSON).
    raw = server.client.completions.with_raw_response.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=2,
                                                             temperature=0, logprobs=1, echo=True)
    echo = raw.http_response.json()["choices"][0]
    assert echo["text"].startswith("1, 2, 3, 4,") and echo["logprobs"]["token_logprobs"][0] is None
    assert "".join(echo["logprobs"]["tokens"]) == echo["text"]
    assert all(lp <= 0 for lp in echo["logprobs"]["token_logprobs"][1:])


@contextlib.contextmanager
def cli_server(*flags: str):
    """The real ``tandem engine serve`` in a subprocess; yields (process, base URL, its output so far: a callable)."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "engine", "serve", "--port", str(port),
                             "--uvicorn-log-level", "warning", *flags],
                            cwd=Path(__file__).resolve().parents[3], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"tandem engine serve exited: {log.read().decode()[-3000:]}")
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=300)

        def output() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        yield proc, base, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_chunked_prefill_matches_unchunked_cli_server(server):
    prompt, next_number = counting_prompt(server.engine.tokenizer, 2 * PREFILL_CHUNK + 50)
    assert len(server.engine.tokenizer.encode(prompt, add_special_tokens=True)) > 2 * PREFILL_CHUNK
    # The chunked request runs on the in-process server while the CLI server starts (a model load).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    chunked_future = pool.submit(lambda: complete(server, prompt=prompt, max_tokens=8, temperature=0))
    with pool, cli_server("--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len",
                          str(MAX_MODEL_LEN), "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
                          "--served-model-name", "unchunked") as (proc, base, output):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        raw = client.completions.with_raw_response.create(model="unchunked", prompt=prompt, max_tokens=8,
                                                          temperature=0)
        unchunked = Completion.model_validate_json(raw.http_response.text).choices[0].text
        # Ctrl-C drains: a running stream still gets all its tokens, then the server exits, quietly. The terminal's
        # SIGINT reaches the process group, and may come again (a wrapper forwarding it): the echo is the same stop,
        # not uvicorn's force-quit that cut the stream, and no KeyboardInterrupt traceback (a new user's trial).
        body = {"model": "unchunked", "prompt": "Once", "max_tokens": 12, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            rest = list(lines)
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == 12
        assert proc.wait(timeout=120) == 130 and "Traceback" not in output(), output()[-3000:]
        chunked = chunked_future.result().choices[0].text
    assert chunked == unchunked
    assert str(next_number) in chunked  # it keeps counting


def test_abort_mid_stream_frees_the_request(server):
    assert wait_until(lambda: scrape(server)["vllm:num_requests_running"] == 0)
    idle_kv = scrape(server)["vllm:kv_cache_usage_perc"]
    aborted_before = scrape(server).get("vllm:request_success_total{abort}", 0.0)
    stream = server.client.completions.create(model=server.model, prompt="Tell me a long story.", max_tokens=1000,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += len(chunk.choices[0].text)
        if received > 10:
            break
    metrics = scrape(server)
    assert metrics["vllm:num_requests_running"] == 1
    assert metrics["vllm:kv_cache_usage_perc"] > idle_kv
    stream.close()  # the client goes away
    assert wait_until(lambda: scrape(server)["vllm:num_requests_running"] == 0)
    assert wait_until(lambda: scrape(server)["vllm:kv_cache_usage_perc"] == idle_kv)
    assert scrape(server)["vllm:num_requests_waiting"] == 0
    assert server.engine.get_stats().tokens_in_flight == 0
    # A non-streamed request whose client gives up is aborted too.
    body = {"model": server.model, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=3.0)
    assert wait_until(lambda: scrape(server)["vllm:num_requests_running"] == 0)
    assert wait_until(lambda: scrape(server)["vllm:kv_cache_usage_perc"] == idle_kv)
    assert scrape(server)["vllm:request_success_total{abort}"] == aborted_before + 2


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server):
    url = f"{server.base_url}/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as exc:
        server.client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "no-such-model" in exc.value.message
    too_long, _ = counting_prompt(server.engine.tokenizer, MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as exc:
        server.client.completions.create(model=server.model, prompt=too_long, max_tokens=4)
    assert str(MAX_MODEL_LEN) in exc.value.message
    for params, name in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"n": 0}, "n"),
                         ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 99}, "logprobs"),
                         ({"max_tokens": "ten"}, "max_tokens"), ({"stop": [3]}, "stop")]:
        with pytest.raises(openai.BadRequestError) as exc:
            server.client.completions.create(model=server.model, prompt="hi", **params)
        assert exc.value.body["param"] == name, (params, exc.value.body)
        assert name in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True, top_logprobs=30)
    assert exc.value.body["param"] == "top_logprobs"
    r = httpx.post(url, json={"model": server.model, "messages": "not a list"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # As OpenAI (and the gateway): a user message needs content; stream_options needs stream (a fresh-user
    # trial got 200 and ~1,000 generated tokens for the first).
    r = httpx.post(url, json={"model": server.model, "messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    # A content part the engine does not take is named by its path, as OpenAI names it (a new-user trial got
    # param "messages", code null).
    r = httpx.post(url, json={"model": server.model, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "bogus"}]}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content[1].type", err
    assert err["code"] == "invalid_value" and "'bogus'" in err["message"], err
    # a text part without its string is named by that field, not blamed on its type (a trial)
    r = httpx.post(url, json={"model": server.model, "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text", r.text
    r = httpx.post(url, json={"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                              "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    # vLLM's older constraint fields: refused, never answered unconstrained (a trial got free text for
    # guided_choice ["yes", "no"]); the context error names the length field the client sent
    for name, value in (("guided_choice", ["yes", "no"]), ("guided_json", {"type": "object"}),
                        ("guided_regex", "[0-9]{3}"), ("guided_grammar", "root ::= \"a\"")):
        with pytest.raises(openai.BadRequestError) as exc:
            chat(server, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=4, extra_body={name: value})
        assert exc.value.body["param"] == name and "structured_outputs" in exc.value.message, exc.value.body
        with pytest.raises(openai.BadRequestError) as exc:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=4, extra_body={name: value})
        assert exc.value.body["param"] == name, exc.value.body
    # vLLM's fields the engine does not implement: refused too (a trial's prompt_embeds: 200, generated from "hi")
    for name, value in (("logits_processors", ["x"]), ("prompt_embeds", "abc")):
        with pytest.raises(openai.BadRequestError) as exc:
            server.client.completions.create(model=server.model, prompt="hi", max_tokens=4, extra_body={name: value})
        assert exc.value.body["param"] == name, exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:   # chat's (vLLM's): this engine serves no multimodal model
        chat(server, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
             extra_body={"mm_processor_kwargs": {"num_crops": 4}})
    assert exc.value.body["param"] == "mm_processor_kwargs", exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=MAX_MODEL_LEN)
    assert exc.value.body["param"] == "max_completion_tokens" and exc.value.message.endswith(
        "or of max_completion_tokens."), exc.value.body
    assert httpx.get(f"{server.base_url}/v1/nothing-here").status_code == 404
    assert server.client.models.retrieve(server.model).id == server.model     # OpenAI's retrieve, as the gateway
    with pytest.raises(openai.NotFoundError) as exc:
        server.client.models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    ok = chat(server, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_x_request_id_on_every_answer(server):
    """As the gateway (and vLLM's ``X-Request-Id``): the client's id is echoed and names the answer; without
    one a generated id is echoed and is the answer's ``id``; errors and unknown paths carry one too."""
    url = f"{server.base_url}/v1/chat/completions"
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"x-request-id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"].startswith("chatcmpl-trace-42-")
    r = httpx.post(url, json=body)
    assert r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers={"x-request-id": "s-1"},
                      json={"model": server.model, "prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        first = json.loads(next(line for line in r.iter_lines() if line)[len("data: "):])
        assert r.headers["x-request-id"] == "s-1" and first["id"].startswith("cmpl-s-1-")
    for r in (httpx.post(url, json={**body, "top_p": 7}, headers={"x-request-id": "bad-1"}),
              httpx.get(f"{server.base_url}/v1/nothing-here", headers={"x-request-id": "bad-1"})):
        assert r.status_code in (400, 404) and r.headers["x-request-id"] == "bad-1"
    generated = httpx.get(f"{server.base_url}/health", headers={"x-request-id": "x" * 200}).headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{24}", generated)                 # not a valid id: a generated one instead


def test_raw_sse_format(server):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_metrics_use_vllm_names(server):
    stopped = complete(server, prompt=ALPHABET_PROMPT, max_tokens=4, temperature=0, stop=["B"]).choices[0]
    assert stopped.finish_reason == "stop"
    complete(server, prompt=ALPHABET_PROMPT, max_tokens=2, temperature=0)
    m = scrape(server)
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:cache_config_info"]:
        assert name in m, name
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] > 0
    assert m["vllm:request_success_total{length}"] > 0 and m["vllm:request_success_total{stop}"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] > 0 and m["vllm:prefix_cache_hits_total"] > 0
    # vLLM's per-request histograms too (a trial's vLLM dashboards had empty panels without them)
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert m[f"vllm:{name}_count"] >= 2, name
    assert m["vllm:request_generation_tokens_sum"] >= 2 + 1 and m["vllm:request_params_n_sum"] >= 2


def test_request_histograms_count_every_choice_and_each_step(server):
    """vLLM's per-request histograms of an n=3 request whose choices end at different steps (a finished
    request's last delta holds only its last choice: its histograms counted that choice alone and n=1): one
    sample per choice, as vLLM v1 counts its child requests (a trial found request_success counting choices and
    the latency histograms requests), n and the longest choice once; and vLLM's tokens-per-step histogram: every
    step's prompt and generated tokens."""
    before, core_before = scrape(server), server.engine.get_stats()
    out = complete(server, prompt="Three words about cats:", n=3, max_tokens=12, temperature=1.0, seed=11,
                   stop=[".", ","], logprobs=1)
    lengths = [len(c.logprobs.tokens) for c in out.choices]
    assert len(set(lengths)) > 1, lengths    # the choices end at different steps (else the test cannot fail)
    after, core_after = scrape(server), server.engine.get_stats()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:request_generation_tokens_sum") == out.usage.completion_tokens == sum(lengths)
    assert delta("vllm:request_generation_tokens_count") == 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == max(lengths)
    assert delta("vllm:request_max_num_generation_tokens_count") == 1
    assert delta("vllm:request_params_n_sum") == 3 and delta("vllm:request_params_n_count") == 1
    assert delta("vllm:request_params_max_tokens_sum") == 3 * 12
    per_choice = [delta(f"vllm:{name}_count") for name in (
        "request_prefill_kv_computed_tokens", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
        "time_to_first_token_seconds", "request_queue_time_seconds", "request_prompt_tokens",
        "request_decode_time_seconds")]
    assert per_choice == [3] * 7 and sum(delta(k) for k in after if k.startswith("vllm:request_success_total")) == 3
    assert 0 < delta("vllm:request_prefill_kv_computed_tokens_sum") <= 3 * out.usage.prompt_tokens
    steps, tokens = delta("vllm:iteration_tokens_total_count"), delta("vllm:iteration_tokens_total_sum")
    # the steps' tokens are those the core computed: the prompt's less cache hits, and every generated token
    # (one a stop string ended in the front end while the core ran a step more included)
    computed = core_after.prompt_tokens_total - core_before.prompt_tokens_total
    generated = core_after.generation_tokens_total - core_before.generation_tokens_total
    assert tokens == computed + generated and generated >= delta("vllm:generation_tokens_total") > 0
    assert max(lengths) <= steps <= tokens


# A copy of the metrics table of the Gateway API Inference Extension's model-server protocol (kubernetes-sigs/
# gateway-api-inference-extension, docs/proposals/003-model-server-protocol, read 2026-12-04), vLLM's column:
# what its endpoint picker (and llm-d's router) scrape from a model server. (name, type, labels it reads)
MODEL_SERVER_PROTOCOL = [
    ("vllm:num_requests_waiting", "gauge", set()),                        # TotalQueuedRequests
    ("vllm:num_requests_running", "gauge", set()),                        # TotalRunningRequests
    ("vllm:kv_cache_usage_perc", "gauge", set()),                         # KVCacheUtilization
    ("vllm:lora_requests_info", "gauge", {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}),  # LoRA
    ("vllm:cache_config_info", "gauge", {"block_size", "num_gpu_blocks"}),  # CacheInfo (prefix-aware scoring)
]


def test_metrics_cover_the_inference_extension_model_server_protocol(server):
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)}
    for name, kind, labels in MODEL_SERVER_PROTOCOL:
        assert name in families, name
        fam = families[name]
        assert fam.type == kind and fam.samples, name
        assert labels <= set(fam.samples[0].labels), (name, fam.samples[0].labels)
    info = families["vllm:cache_config_info"].samples[0].labels
    assert int(info["block_size"]) == server.engine.args.block_size and int(info["num_gpu_blocks"]) > 0
    usage = families["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= usage <= 1.0


def test_prompt_logprobs_and_multiple_prompts(server):
    c = complete(server, prompt=["1, 2, 3", "A, B, C"], max_tokens=3, temperature=0, n=2,
                 extra_body={"prompt_logprobs": 1})
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch for ch in c.choices}
    assert by_index[0].text == by_index[1].text and by_index[2].text == by_index[3].text  # greedy
    assert by_index[0].text != by_index[2].text
    assert c.usage.completion_tokens == 12
    plp = by_index[0].model_extra["prompt_logprobs"]
    ids = server.engine.tokenizer.encode("1, 2, 3", add_special_tokens=True)
    assert len(plp) == len(ids) and plp[0] is None
    assert all(str(t) in pos and pos[str(t)]["logprob"] <= 0 for t, pos in zip(ids[1:], plp[1:]))


def test_the_guided_fields_the_server_reads_are_the_ones_it_refuses():
    # the request struct declares vLLM's older fields only to refuse them: the two lists are one
    from engine.protocol.guided import GUIDED_FIELDS
    from engine.serving.protocol import ChatCompletionRequest, CompletionRequest
    for struct in (ChatCompletionRequest, CompletionRequest):
        assert tuple(f for f in struct.__struct_fields__ if f.startswith("guided_")) == GUIDED_FIELDS


def test_logit_bias_steers_the_real_model_and_keeps_its_bits(server):
    """OpenAI's ``logit_bias`` on the real model (it was a 400): +100 on a token makes it the first one, -100 on
    the greedy answer's first token bans it; a biased request's tokens and logprobs are bitwise the same alone
    and beside unbiased ones, streamed or not; the logprobs stay the model's own."""
    import concurrent.futures

    kw = dict(prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
    plain = complete(server, **kw).choices[0]
    first = server.engine.tokenizer.encode(plain.logprobs.tokens[0], add_special_tokens=False)[0]
    forced_id = server.engine.tokenizer.encode(" London", add_special_tokens=False)[0]
    forced = complete(server, **kw, logit_bias={str(forced_id): 100}).choices[0]
    assert forced.text.startswith(" London")
    banned = complete(server, **kw, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]
    assert banned.logprobs.token_logprobs[0] < plain.logprobs.token_logprobs[0]   # the raw logprob of its pick
    with concurrent.futures.ThreadPoolExecutor(4) as pool:   # beside unbiased requests, in the same steps
        together = list(pool.map(lambda b: complete(server, **kw, logit_bias=b).choices[0],
                                 [{str(first): -100}, None, {str(forced_id): 100}, None]))
    assert (together[0].text, together[0].logprobs.token_logprobs) == (banned.text, banned.logprobs.token_logprobs)
    assert together[2].text == forced.text and together[1].text == plain.text
    streamed = "".join(c.choices[0].text for c in complete_stream(server, **kw, logit_bias={str(first): -100}))
    assert streamed == banned.text
