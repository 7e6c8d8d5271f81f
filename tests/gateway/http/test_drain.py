"""SIGTERM's (and Ctrl-C's SIGINT's) drain against a stream that would outlive it (tests/gateway/script_upstream.py keeps it alive with
comments): the stream ends with the ``stream_interrupted`` event at ``drain_timeout_s``, read by the official
``openai`` client, and a second signal exits at once."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.gateway.script_upstream import chunk, data, upstream  # noqa: F401 -- upstream: the module-scoped fixture
from tests.engine.test_core_process import alive, core_pid
from tests.gateway.support import GatewayProcess

CONFIG = """
server: {{drain_timeout_s: {drain}}}
models:
  - name: m1
backends:
  up: {{type: openai, base_url: '{url}', timeouts: {{inter_chunk_s: 5}}}}
routes:
  main: {{targets: [{{backend: up}}]}}
policy: {{default_route: main}}
resilience: {{health: {{interval_s: 0}}}}
"""
# one content chunk, then 20 s of keep-alive comments: alive, never finished
LONG_STREAM = {"parts": [data(chunk("a")), *[0.2, b": keep-alive\n\n"] * 100]}


@contextlib.contextmanager
def draining_gateway(upstream, tmp_path, drain_s: float):
    """A gateway with ``drain_timeout_s: drain_s`` whose next upstream answer is LONG_STREAM; stopped at the end."""
    upstream.push(LONG_STREAM)
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(drain=drain_s, url=upstream.base_url))
    g = GatewayProcess(path).start()
    try:
        yield g
    finally:
        g.stop()


def open_stream(g: GatewayProcess):
    """Start a streamed call in a thread; returns (first chunk read event, outcome dict filled at its end)."""
    first, outcome = threading.Event(), {}

    def run() -> None:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0, timeout=30)
        try:
            for _ in client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}],
                                                    stream=True):
                first.set()
            outcome["ended"] = "cleanly"
        except Exception as exc:  # noqa: BLE001 -- the outcome is the assertion
            outcome["ended"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    outcome["thread"] = t
    assert first.wait(10)
    return outcome


def assert_interrupted(outcome: dict) -> None:
    """The stream ended with the ``stream_interrupted`` event the gateway's shutdown wrote, not a cut."""
    outcome["thread"].join(15)
    err = outcome["ended"]
    assert isinstance(err, openai.APIError) and "shutting down" in str(err), err
    assert err.code == "stream_interrupted" and err.type == "service_unavailable", err.body


def test_drain_deadline_ends_open_streams_with_stream_interrupted(upstream, tmp_path):
    with draining_gateway(upstream, tmp_path, drain_s=1) as g:
        outcome = open_stream(g)
        g.proc.send_signal(signal.SIGTERM)
        assert_interrupted(outcome)
        assert g.proc.wait(15) == 0           # a hang bound, not a timing claim; SIGTERM's stop is a clean exit
        assert "drained: 1 stream(s) cut with stream_interrupted, 0 request(s) still in flight" in g.log()
    # its request log line (stderr): the shutdown's 503, not a client that left (499) nor a success; billed for
    # the prompt and the text it was sent ("a", counted: the upstream's usage never came)
    [line] = [json.loads(x) for x in g.log().splitlines() if x.startswith("{") and '"event":"request"' in x]
    assert (line["status"], line["error"], line["disconnected"]) == (503, "service_unavailable", False), line
    assert line["completion_tokens"] == 1 and line["prompt_tokens"] and line["usage_estimated"], line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_second_signal_during_a_drain_exits_at_once_still_ending_streams_with_the_event(upstream, tmp_path, sig):
    with draining_gateway(upstream, tmp_path, drain_s=120) as g:
        outcome = open_stream(g)
        g.proc.send_signal(sig)
        time.sleep(1.5)                        # past the echo window of a forwarded signal
        g.proc.send_signal(sig)
        assert_interrupted(outcome)
        g.proc.wait(15)                        # the drain alone would take 120 s
        assert "second signal during the drain" in g.log()
        # a new user's log said "0 cut" here: the count is of the streams any shutdown path ended
        assert "drained: 1 stream(s) cut with stream_interrupted, 0 request(s) still in flight" in g.log()
        assert "Traceback" not in g.log()


def test_ctrl_c_drains_like_sigterm(upstream, tmp_path):
    with draining_gateway(upstream, tmp_path, drain_s=3) as g:
        outcome = open_stream(g)
        g.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)                          # the handler runs on the gateway's loop, not in this call
        r = httpx.post(g.url + "/v1/chat/completions", timeout=5, json={"model": "m1", "messages": []})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert_interrupted(outcome)
        assert g.proc.wait(15) == 130            # as a shell reports Ctrl-C (tandem engine serve too)
        assert "drained: 1 stream(s) cut with stream_interrupted, 0 request(s) still in flight" in g.log()
        assert "Traceback" not in g.log()


def test_ctrl_c_forwarded_again_by_make_is_the_same_drain(upstream, tmp_path):
    # a terminal's Ctrl-C reaches the process group, then make forwards it: two signals back to back
    with draining_gateway(upstream, tmp_path, drain_s=2) as g:
        outcome = open_stream(g)
        g.proc.send_signal(signal.SIGINT)
        g.proc.send_signal(signal.SIGINT)
        assert_interrupted(outcome)
        g.proc.wait(15)
        assert "drained: 1 stream(s) cut with stream_interrupted, 0 request(s) still in flight" in g.log()
        assert "second signal during the drain" not in g.log()


def test_ctrl_c_while_the_local_engine_loads_exits_and_leaves_no_engine_behind(tmp_path):
    """A new user's Ctrl-C right after ``make serve`` started (the engine still loading): the gateway drained, but
    the engine core started meanwhile outlived the stop and the process never exited. Now it exits, 130."""
    path = tmp_path / "local.yaml"
    path.write_text("models: [{name: m1}]\nbackends:\n  local: {type: local, engine: {kv_cache_memory: 64MiB}}\n"
                    "routes:\n  a: {targets: [{backend: local}]}\npolicy: {default_route: a}\n")
    g = GatewayProcess(path).start(wait_ready=False)     # listening; the engine loads
    try:
        deadline = time.monotonic() + 60
        while True:                                       # its core process is spawned: the model is loading
            with contextlib.suppress(AssertionError):
                core = core_pid(g.proc.pid)
                break
            assert time.monotonic() < deadline and g.proc.poll() is None, g.log()
            time.sleep(0.01)
        g.proc.send_signal(signal.SIGINT)
        assert g.proc.wait(60) == 130, g.log()           # a hang bound, not a timing claim
        assert "Traceback" not in g.log()
        deadline = time.monotonic() + 10
        while alive(core):
            assert time.monotonic() < deadline, "the engine core outlived the gateway"
            time.sleep(0.05)
    finally:
        g.stop()
