"""Request semantics of the engine's OpenAI server that depend on sampling
and scheduling settings, end to end through real HTTP (the official
``openai`` client, SmolLM2 in float32, greedy):

* ``min_tokens`` holds back every stop condition, stop strings included
  (vLLM's semantics): a stop string complete within the first ``min_tokens``
  tokens stays in the text, one that completes later ends the completion;
  streamed == non-streamed, completions and chat.
* ``priority`` needs ``--scheduling-policy priority``: a default (fcfs) server
  refuses a non-zero one with a 400 naming it; a priority server serves the
  more important request first, preempting the less important one.

Servers run in-process (``tests.engine.entrypoints.test_serving.start_server``: build_app +
uvicorn in a thread on a free 127.0.0.1 port); the default one is conftest.py's, shared with
test_serving.py.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.engine.entrypoints.test_serving import (
    LiveServer, chat, chat_stream, complete, concurrently, complete_stream, counting_prompt, scrape, start_server,
    stream_text, wait_until,
)

pytestmark = pytest.mark.slow

COLORS_PROMPT = "List three colors:\n1."
COLORS_CHAT = [{"role": "user", "content": "List three colors, one per line."}]
LONG_TOKENS = 100


@pytest.fixture
def server(float32_server):
    return float32_server


def chat_stream_text(chunks) -> str:
    return "".join(c.delta.content or "" for ch in chunks for c in ch.choices)


def cut_at_stop(text: str, stop: str, start: int) -> str:
    """``text`` cut before the first ``stop`` that starts at or after ``start``
    (the whole text when there is none)."""
    i = text.find(stop, start)
    return text if i < 0 else text[:i]


# ------------------------------------------------------------------- min_tokens
def test_min_tokens_holds_back_stop_strings_in_completions(server):
    held = dict(prompt=COLORS_PROMPT, max_tokens=30, temperature=0, stop=["\n"], extra_body={"min_tokens": 8})
    # min_tokens == max_tokens: the stop string never ends it.
    both = dict(prompt=COLORS_PROMPT, max_tokens=8, temperature=0, stop=["\n"], extra_body={"min_tokens": 8})
    free, plain, r, chunks, r_both, chunks_both = concurrently(  # independent requests: one batch
        lambda: complete(server, prompt=COLORS_PROMPT, max_tokens=30, temperature=0, logprobs=0).choices[0],
        lambda: complete(server, prompt=COLORS_PROMPT, max_tokens=30, temperature=0, stop=["\n"]).choices[0],
        lambda: complete(server, **held), lambda: complete_stream(server, **held),
        lambda: complete(server, **both), lambda: complete_stream(server, **both))
    head = "".join(free.logprobs.tokens[:8])  # text of the first 8 tokens (ASCII here)
    assert free.text.startswith(head) and "\n" in head, free.text  # precondition: a "\n" within 8 tokens
    assert "\n" in free.text[len(head):], free.text  # ... and one after them
    assert plain.text == cut_at_stop(free.text, "\n", 0) and plain.finish_reason == "stop"

    expected = cut_at_stop(free.text, "\n", len(head))  # the first "\n" after 8 tokens ends it, untrimmed before
    choice = r.choices[0]
    assert choice.text == expected, (choice.text, free.text)
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "\n"
    assert r.usage.completion_tokens > 8
    assert stream_text(chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    assert r_both.choices[0].text == head and r_both.choices[0].finish_reason == "length"
    assert r_both.usage.completion_tokens == 8
    assert stream_text(chunks_both) == head and chunks_both[-1].choices[0].finish_reason == "length"


def test_min_tokens_holds_back_stop_strings_in_chat(server):
    # Without a stop string (min_tokens also holds back EOS, so this is the text to cut).
    held = dict(messages=COLORS_CHAT, max_tokens=40, temperature=0, stop=["\n"], extra_body={"min_tokens": 15})
    free, plain, r, chunks = concurrently(  # independent requests: one batch
        lambda: chat(server, messages=COLORS_CHAT, max_tokens=40, temperature=0, logprobs=True,
                     extra_body={"min_tokens": 15}).choices[0],
        lambda: chat(server, messages=COLORS_CHAT, max_tokens=40, temperature=0, stop=["\n"]).choices[0],
        lambda: chat(server, **held), lambda: chat_stream(server, **held))
    content = free.message.content
    head = "".join(t.token for t in free.logprobs.content[:15])
    assert content.startswith(head) and "\n" in head, content  # precondition: a "\n" within 15 tokens
    assert plain.message.content == cut_at_stop(content, "\n", 0) and plain.finish_reason == "stop"

    expected = cut_at_stop(content, "\n", len(head))
    assert r.choices[0].message.content == expected, (r.choices[0].message.content, content)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens >= 15
    assert chat_stream_text(chunks) == expected
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["stop"]


def test_min_tokens_past_the_room_the_context_leaves_is_refused_without_max_tokens(server):
    """A trial's chat ``min_tokens: 100000`` without ``max_tokens`` ran to the whole context (minutes on a CPU,
    a seat held), while with ``max_tokens`` it was a 400: vLLM sets max_tokens to the context's room first, so
    the same check refuses it. Refused the same way; the room itself is taken."""
    import httpx

    body = {"model": server.model, "messages": COLORS_CHAT, "min_tokens": 100000}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", r.text
    assert err["message"].startswith("min_tokens must be <= max_tokens=") and err["message"].endswith("got 100000")
    room = int(err["message"].split("max_tokens=")[1].split(" ")[0])
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": server.model, "prompt": "0, 1, 2",
                                                               "min_tokens": room + 1, "max_tokens": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


# --------------------------------------------------------------------- priority
@pytest.mark.parametrize("stream", [False, True])
def test_priority_is_refused_without_priority_scheduling(server, stream):
    calls = [
        lambda **kw: server.client.completions.create(model=server.model, prompt="hi", max_tokens=3, **kw),
        lambda **kw: server.client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, **kw),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as exc:
            call(stream=stream, extra_body={"priority": 5})
        assert exc.value.status_code == 400 and exc.value.body["param"] == "priority"
        assert "--scheduling-policy priority" in exc.value.message
        ok = call(stream=stream, extra_body={"priority": 0})  # the default priority is fine
        if stream:
            assert list(ok)
        else:
            assert ok.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def priority_server():
    # 11 usable blocks of 16 tokens: a long request and a short one cannot both finish without a preemption.
    s = start_server(dtype="float32", scheduling_policy="priority", num_gpu_blocks_override=12, max_num_seqs=2,
                     max_model_len=176, enable_prefix_caching=False)
    yield s
    s.stop()


def test_priority_scheduling_preempts_the_less_important_request(priority_server):
    s: LiveServer = priority_server
    preemptions = scrape(s)["vllm:num_preemptions_total"]
    # 100 + 40 tokens (9 blocks) next to the long request's 3+ blocks do not fit in 11: one must be preempted,
    # and the urgent one is admitted while the long one holds at most 4 blocks (< 58 tokens generated). The long
    # one is preempted at the latest when the urgent one needs its 9th block (~30 tokens later), so it still has
    # tokens to stream after the urgent one ends.
    urgent_prompt, _ = counting_prompt(s.engine.tokenizer, 100)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        low = s.client.completions.create(
            model=s.model, prompt="Tell me a long story.", max_tokens=LONG_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "priority": 5})
        urgent = None
        urgent_done_while_low_ran = False
        chunks = []
        for chunk in low:
            chunks.append(chunk)
            if urgent is None:  # low is running (it holds few blocks yet): the urgent one arrives
                urgent = pool.submit(complete, s, prompt=urgent_prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "priority": -1})
            elif urgent.done() and chunk.choices and chunk.choices[0].finish_reason is None:
                urgent_done_while_low_ran = True
        result = urgent.result()
    # The older but less important request was the one preempted, so the urgent one finished first.
    assert urgent_done_while_low_ran
    assert result.usage.completion_tokens == 40 and result.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == LONG_TOKENS
    assert scrape(s)["vllm:num_preemptions_total"] > preemptions
    assert wait_until(lambda: scrape(s)["vllm:num_requests_running"] == 0)
