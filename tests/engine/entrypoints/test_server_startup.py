"""``tandem engine serve`` around the model load and at its edges: it listens
before the model is loaded (503 ``engine_loading`` with ``Retry-After``,
``/health`` says loading), logs the load's progress, and refuses a body over
``--max-request-body-bytes`` with 413 in OpenAI's form. Tiny random Llama
(``tests/tiny_models.py``), real HTTP, the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.entrypoints.server import KEEP_ALIVE_S, build_app
from loadtests.procs import Server, free_port, tandem_cmd
from tests.tiny_models import save_byte_level_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny"), printable_only=True)


class GatedEngine(AsyncEngine):
    """Fault injector: the model load waits until ``gate`` is set."""

    gate: threading.Event

    async def start(self) -> None:
        await asyncio.to_thread(self.gate.wait, 120)
        await super().start()


def test_requests_during_the_model_load_get_503_engine_loading(tiny_model):
    engine = GatedEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", served_model_name="tiny"))
    engine.gate = threading.Event()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started  # listening although the model is not loaded
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        r = httpx.post(base + "/v1/chat/completions", timeout=10,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        err = r.json()["error"]
        assert err["code"] == "engine_loading" and err["type"] == "server_error" and set(err) == {
            "message", "type", "param", "code"}
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as info:
            client.models.list()
        assert info.value.status_code == 503
        engine.gate.set()
        while httpx.get(base + "/health", timeout=10).status_code != 200 and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        out = client.completions.create(model="tiny", prompt="abc", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        ready = httpx.get(base + "/health", timeout=10)   # vLLM's: an empty 200 (it had said JSON, and sent none)
        assert ready.content == b"" and not ready.headers["content-type"].startswith("application/json")
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(60)


def test_a_front_end_that_fails_to_build_stops_the_server_as_a_failed_load(tiny_model, monkeypatch, caplog):
    """A trial's server whose request handlers failed to build after the engine started said healthy for good
    and answered every request 503 "loading" (the error surfaced at shutdown only): it is the failed load's one
    line, ``/health`` says failed, and the server is told to stop."""
    import engine.entrypoints.server as server_module

    def broken(*_args, **_kwargs):
        raise TypeError("a broken front end")

    monkeypatch.setattr(server_module, "OpenAIServingCompletion", broken)
    engine = AsyncEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", served_model_name="tiny"))
    stopped = threading.Event()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, on_load_failed=stopped.set), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert stopped.wait(120)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        assert "the engine failed to load: TypeError: a broken front end" in caplog.text
    finally:
        server.should_exit = True
        thread.join(60)


def test_the_loaded_front_end_is_frozen_out_of_full_collections(tiny_model):
    """Issue #34: a full collection in the serving process walked everything loaded (~77,000 objects with
    SmolLM2's tokenizer, ~200 ms on a busy 2-core box) with the GIL held, no stream getting an event meanwhile.
    Once the engine is loaded, what it built is frozen: no collection visits it."""
    import gc

    engine = AsyncEngine(EngineArgs(model=tiny_model, kv_cache_memory="64MiB", served_model_name="tiny"))
    app = build_app(engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # deadlock guard only
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=10).status_code == 200:
                    break
            time.sleep(0.05)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt="abc", max_tokens=2).usage.completion_tokens >= 1
        loaded = [app.state.chat, app.state.completion, engine]  # built by the load, before the freeze
        visited = {id(o) for o in gc.get_objects()}  # every object a full collection would walk
        assert all(gc.is_tracked(o) and id(o) not in visited for o in loaded)
    finally:
        server.should_exit = True
        thread.join(60)


API_KEY = "sk-engine-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cli_server(tiny_model, tmp_path_factory):
    """A real ``tandem engine serve`` with two served names (vLLM's aliases), a 2 KiB body limit, and vLLM's
    command line: the model as its positional ``MODEL``, ``--api-key``, ``--enable-log-requests``,
    ``--trust-remote-code``, and flags of vLLM's that change nothing here (``VLLM_FLAGS``)."""
    port = free_port()
    srv = Server([*tandem_cmd("engine", "serve"), tiny_model, "--port", str(port), "--served-model-name",
                  "tiny", "tiny-alias", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-request-body-bytes", "2KiB",
                  "--api-key", API_KEY, "--enable-log-requests", "--trust-remote-code", "--enforce-eager",
                  "--disable-log-stats", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--kv-cache-dtype", "auto", "-pp", "1", "--tokenizer", tiny_model,
                  "--prefix-caching-hash-algo", "sha256",   # vLLM's default (a scale-out trial's command line)
                  # a trial's production command line's (each stopped the server at "unrecognized arguments")
                  "--disable-custom-all-reduce", "--distributed-executor-backend", "mp",
                  "--max-seq-len-to-capture", "8192", "--preemption-mode", "recompute", "--async-scheduling",
                  "--logprobs-mode", "raw_logprobs", "--max-num-partial-prefills", "1", "--max-logprobs", "5",
                  "--gpu-memory-utilization", "0.5",
                  # a CLI trial's (unrecognized arguments before)
                  "--guided-decoding-backend", "xgrammar", "--disable-uvicorn-access-log",
                  # a vLLM operator's trial's (refused at start, or "unrecognized arguments")
                  "--return-tokens-as-token-ids", "--load-format", "safetensors"],
                 f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}",
                 # vLLM-CPU's environment: its KV cache size yields to the flag; the others are said not read
                 env={"VLLM_CPU_KVCACHE_SPACE": "40", "VLLM_CPU_OMP_THREADS_BIND": "auto"},
                 log_dir=tmp_path_factory.mktemp("serve")).wait_ready(120)
    yield srv
    srv.stop()


def test_body_limit_gives_413_and_the_load_is_logged(cli_server):
    srv = cli_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="x" * 4096, max_tokens=2)
    assert info.value.status_code == 413
    err = info.value.response.json()["error"]
    assert err["code"] == "request_too_large" and "2048 bytes" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    small = client.completions.create(model="tiny", prompt="x" * 100, max_tokens=2)  # under the limit: served
    assert small.choices[0].finish_reason == "length"
    log = srv.log_tail(100_000)
    assert "loading model" in log and " MB " in log and "weights read" in log
    # vLLM's flags without a setting here: each said to change nothing, and why
    assert "--enforce-eager: accepted for vLLM's command lines; changes nothing: no CUDA graph" in log
    assert "--tool-call-parser hermes: accepted" in log and "-pp 1" not in log and "--pipeline-parallel-size 1" in log
    assert "--async-scheduling: accepted" in log and "--preemption-mode recompute: accepted" in log
    assert "gpu_memory_utilization=0.5 changes nothing on CPU" in log
    assert "--guided-decoding-backend xgrammar: accepted" in log and '"POST /v1/completions HTTP/1.1"' not in log
    # a CLI trial's VLLM_* variables changed nothing without a word
    assert "$VLLM_CPU_OMP_THREADS_BIND: vLLM's; not read here (its setting here: --num-threads)" in log
    assert "(0.06 GiB;" in log and "VLLM_CPU_KVCACHE_SPACE=40" not in log      # --kv-cache-memory 64MiB wins


def test_vllm_cpus_kv_cache_variable_sizes_the_cache_when_the_flag_is_left_alone():
    from engine.config import KV_CACHE_MEMORY_DEFAULT
    from engine.entrypoints.vllm_flags import kv_cache_from_vllm_env

    default = KV_CACHE_MEMORY_DEFAULT
    assert kv_cache_from_vllm_env(default, default, {"VLLM_CPU_KVCACHE_SPACE": "40"}) == (
        "40GiB", "$VLLM_CPU_KVCACHE_SPACE=40: a KV cache of 40 GiB (--kv-cache-memory)")
    assert kv_cache_from_vllm_env(default, default, {"VLLM_CPU_KVCACHE_SPACE": "0"}) == (default, None)  # auto
    assert kv_cache_from_vllm_env("64MiB", default, {"VLLM_CPU_KVCACHE_SPACE": "40"}) == ("64MiB", None)


def test_max_logprobs_caps_what_a_request_may_ask(cli_server):
    """vLLM's ``--max-logprobs 5`` stopped the server at start (a trial): it is the cap, in vLLM's words."""
    auth, base = AUTH, cli_server.base_url
    for path, body, param in (
            ("/v1/completions", {"prompt": "abc", "max_tokens": 1, "logprobs": 6}, "logprobs"),
            ("/v1/completions", {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 6}, "prompt_logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                      "logprobs": True, "top_logprobs": 6}, "top_logprobs")):
        r = httpx.post(base + path, json={"model": "tiny", **body}, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "greater than max allowed: 5" in r.json()["error"]["message"]
    ok = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 1,
                                                     "logprobs": 5}, headers=auth, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5
    # --return-tokens-as-token-ids: the default of the request's field, which may say no
    assert all(t.startswith("token_id:") for t in ok.json()["choices"][0]["logprobs"]["top_logprobs"][0])
    text = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 1, "logprobs": 5,
                                                      "return_tokens_as_token_ids": False}, headers=auth, timeout=60)
    assert not any(t.startswith("token_id:") for t in text.json()["choices"][0]["logprobs"]["top_logprobs"][0])


def test_several_served_model_names_are_aliases(cli_server, tiny_model):
    """vLLM's ``--served-model-name a b``: both listed and taken, each answer reports the name its request
    used, a request without one reports the first, and the metrics carry the first."""
    base = cli_server.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert {m.root for m in client.models.list().data} == {tiny_model}     # vLLM's: the model as given
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    plain = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
    alias = client.completions.create(model="tiny-alias", prompt="abc", max_tokens=3, temperature=0)
    assert (plain.model, alias.model) == ("tiny", "tiny-alias")
    assert alias.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2)
    assert chat.model == "tiny-alias"
    assert client.embeddings.create(model="tiny-alias", input="abc").model == "tiny-alias"
    r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    for url, body in (("/v1/completions", {"model": "other", "prompt": "abc", "max_tokens": 2}),
                      ("/v1/embeddings", {"model": "other", "input": "abc"})):
        r = httpx.post(base + url, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert "tiny, tiny-alias" in r.json()["error"]["message"]
    assert httpx.get(base + "/v1/models/other", headers=AUTH, timeout=10).status_code == 404
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'model_name="tiny"' in metrics and 'model_name="tiny-alias"' not in metrics


def test_api_key_guards_the_v1_paths_and_requests_are_logged(cli_server):
    """vLLM's ``--api-key``: every /v1 endpoint needs the bearer key (401 in OpenAI's form otherwise); /health,
    /metrics and the utility endpoints stay open. ``--enable-log-requests`` logs each
    request with its id; the positional MODEL served the model (``cli_server``)."""
    base = cli_server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/models/tiny")):
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "abc", "max_tokens": 1},
                              timeout=60)
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
            assert r.headers.get("x-request-id")
    client = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    for path in ("/health", "/metrics", "/version", "/ping"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    assert httpx.post(base + "/tokenize", json={"prompt": "abc"}, timeout=10).json()["count"] >= 1
    r = httpx.post(base + "/v1/completions", headers={**AUTH, "x-request-id": "logged-request-1"},
                   json={"model": "tiny", "prompt": "logged prompt", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    log = cli_server.log_tail(100_000)
    assert "Received request" in log and "logged-request-1" in log and "logged prompt" in log
    # vLLM's body field request_id names the answer when no x-request-id header does (a trial's was dropped)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "request_id": "abc-123"}
    r = httpx.post(base + "/v1/chat/completions", headers=AUTH, json=chat, timeout=60)
    assert r.json()["id"].startswith("chatcmpl-abc-123-") and r.headers["x-request-id"] == "abc-123", r.text
    r = httpx.post(base + "/v1/chat/completions", headers={**AUTH, "x-request-id": "hdr-1"}, json=chat, timeout=60)
    assert r.json()["id"].startswith("chatcmpl-hdr-1-") and r.headers["x-request-id"] == "hdr-1", r.text


def test_serve_flags_refuse_what_vllm_would_not_take(tmp_path, capsys, caplog):
    """``--drain-timeout`` refuses a negative wait in one line (as the other typed flags); the positional MODEL
    and ``--model`` must agree (vLLM's ``serve MODEL`` is ``--model``)."""
    import argparse

    from engine.entrypoints.server import add_serve_args, run_server

    parser = argparse.ArgumentParser(prog="tandem engine serve")
    add_serve_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--drain-timeout", "-1"])
    err = capsys.readouterr().err
    assert "--drain-timeout" in err and "must be >= 0 seconds" in err and "Traceback" not in err
    assert parser.parse_args(["--drain-timeout", "0"]).drain_timeout == 0
    args = parser.parse_args([str(tmp_path / "a.gguf"), "--model", str(tmp_path / "b.gguf")])
    assert run_server(args) == 1
    args = parser.parse_args([str(tmp_path / "a.gguf")])
    assert args.model_tag == str(tmp_path / "a.gguf") and args.model is None
    # vLLM's flags this server cannot honour: one line naming the flag and why, exit 2, before any load
    for flags, needle in ((["--pipeline-parallel-size", "2"], "tensor parallelism only"),
                          (["--reasoning-parser", "deepseek_r1"], "reasoning is not split out"),
                          (["--tokenizer", str(tmp_path / "other")], "the model's own"),
                          (["--kv-cache-dtype", "fp8"], "(taken: auto)"),
                          (["--prefix-caching-hash-algo", "sha256_cbor"], "are not made here"),
                          (["--trust-request-chat-template"], "is refused")):
        caplog.clear()
        assert run_server(parser.parse_args([str(tmp_path / "a.gguf"), *flags])) == 2, flags
        assert f"{flags[0]}" in caplog.text and needle in caplog.text, caplog.text



def test_vllms_other_spellings_of_the_flags_are_read():
    """vLLM's FlexibleArgumentParser reads ``--tensor_parallel_size`` and a JSON option key by key
    (``--speculative-config.method ngram``); a trial got "unrecognized arguments" for both."""
    import json

    from engine.protocol.cli_spellings import vllm_argv
    from gateway.cli import build_parser

    argv = vllm_argv(["engine", "serve", "m.gguf", "--tensor_parallel_size", "2", "--speculative-config.method",
                      "ngram", "--speculative_config.num_speculative_tokens=3", "--served-model-name", "a_b"])
    args, extra = build_parser("engine").parse_known_args(argv)
    assert not extra and args.tensor_parallel_size == 2 and args.served_model_name == ["a_b"]
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert vllm_argv(["generate", "--max_tokens=4", "--", "--a_b"]) == ["generate", "--max-tokens=4", "--", "--a_b"]


def test_serve_keeps_idle_connections_longer_than_clients_do(tmp_path, monkeypatch):
    """``tandem engine serve`` keeps an idle connection open past the 5 s after which httpx (so the openai SDK)
    drops it: with uvicorn's 5 s the two expire together and a request sent on a connection the server is
    closing is reset (seen as an APIConnectionError by a client without retries)."""
    import argparse

    import httpx

    from engine.entrypoints import server as server_module

    seen = {}
    monkeypatch.setattr(server_module.EngineServer, "run", lambda self: seen.setdefault("config", self.config))
    parser = argparse.ArgumentParser(prog="tandem engine serve")
    server_module.add_serve_args(parser)
    path = save_byte_level_llama(tmp_path)
    assert server_module.run_server(parser.parse_args([path])) == 1   # never started: the stub returned at once
    assert seen["config"].timeout_keep_alive == server_module.KEEP_ALIVE_S
    assert server_module.KEEP_ALIVE_S > httpx.Limits().keepalive_expiry


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_second_signal_past_the_echo_window_ends_the_drain_at_once(tiny_model, tmp_path, sig):
    """A second Ctrl-C (or SIGTERM) past the echo window quits at once, as serve.md says: the stream still running
    ends with the engine's error event and [DONE], and the process exits with the first signal's status. A vLLM
    operator's trial: after a second SIGINT uvicorn's force-exit cancelled the app's shutdown mid-drain and the
    server hung for good (its engine core alive); a second SIGTERM did nothing until the stream finished."""
    import json
    import signal

    port = free_port()
    srv = Server([*tandem_cmd("engine", "serve"), "--model", tiny_model, "--port", str(port), "--kv-cache-memory",
                  "64MiB", "--drain-timeout", "600", "--dtype", "float32"],
                 f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path).wait_ready(120)
    try:
        lines, signum = [], getattr(signal, sig)
        card = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]
        body = {"model": card["id"], "prompt": "hi", "max_tokens": card["max_model_len"] - 8, "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 5:
                    srv.proc.send_signal(signum)
                    first = time.monotonic()
                elif len(lines) > 5 and time.monotonic() - first > 1.5 and signum is not None:
                    srv.proc.send_signal(signum)     # past the echo window: the operator insists
                    signum = None
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: "):])
        assert last["error"]["code"] == "aborted" and "shutting down" in last["error"]["message"], last
        assert srv.proc.wait(30) == (130 if sig == "SIGINT" else 0)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_a_stream_still_running_at_the_drain_timeout_ends_with_an_error_event_and_done(tiny_model, tmp_path):
    """SIGTERM with a stream longer than --drain-timeout: a stress trial's streams were cut mid-body at the
    timeout + 5 s (no finish, no [DONE]; an ASGI traceback each in the log). The engine's drain starts at the
    signal: at the timeout the request is aborted, and its stream ends with the engine's error event and [DONE]."""
    import json
    import signal

    port = free_port()
    srv = Server([*tandem_cmd("engine", "serve"), "--model", tiny_model, "--port", str(port), "--kv-cache-memory",
                  "64MiB", "--drain-timeout", "1", "--dtype", "float32"],
                 f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", log_dir=tmp_path).wait_ready(120)
    try:
        lines = []
        model = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 5:
                    srv.proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: "):])      # the engine's error event, then [DONE]
        assert last["error"]["code"] == "aborted" and "shutting down" in last["error"]["message"], last
        assert srv.proc.wait(30) == 0     # an orchestrator's normal stop (it died by the re-raised SIGTERM: -15)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]
