"""Refusals in the error format of the API a path belongs to (``gateway/http/exceptions.py``), on a gateway
(the Litestar app under uvicorn, in this process, on the hot path and off it) over the fault-injecting upstream,
with httpx as the client:

- a body declared as anything but JSON is a 400 ``unsupported_content_type`` naming the type, on every client
  endpoint; ``application/json`` with parameters, ``application/*+json`` and no ``Content-Type`` are read as JSON;
- every path under ``/v1/messages`` answers Anthropic's error JSON, the router's 404 and 405 included; every other
  path OpenAI's."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from gateway.config.compile import load_config_text
from gateway.http.app import create_app
from gateway.runtime import Gateway
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.http.test_messages import KEY, config
from tests.gateway.support import serve_app

AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
MESSAGES = b'{"model": "m1", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}'
# path -> a valid body of that endpoint
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": b'{"model": "m1", "prompt": "hi"}',
          "/v1/embeddings": b'{"model": "m1", "input": "hi"}', "/v1/responses": b'{"model": "m1", "input": "hi"}',
          "/v1/messages": MESSAGES, "/v1/messages/count_tokens": MESSAGES}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture
def up():
    with FaultUpstream("up") as u:
        yield u


@contextlib.asynccontextmanager
async def served(up: FaultUpstream, hot_path: bool):
    """An httpx client on a gateway over ``up`` (``hot_path``: the client POST endpoints past Litestar's router)."""
    gw = Gateway(None, load_config_text(config(up)), start_engine=False)
    server, task, url = await serve_app(create_app(gw, hot_path=hot_path))
    try:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=20) as client:
            yield client
    finally:
        server.should_exit = True
        await task


def anthropic_error(r: httpx.Response, status: int, type_: str) -> str:
    """The message of Anthropic's error JSON in ``r``, checked to have ``status`` and error type ``type_``."""
    body = r.json()
    assert r.status_code == status and body["type"] == "error" and set(body) == {"type", "error"}, (r, body)
    assert body["error"]["type"] == type_, body
    return body["error"]["message"]


def openai_error(r: httpx.Response, status: int, code: str) -> str:
    """The message of OpenAI's error JSON in ``r``, checked to have ``status`` and ``code``."""
    body = r.json()
    assert r.status_code == status and set(body) == {"error"}, (r, body)
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


@pytest.mark.parametrize("hot_path", [True, False])
async def test_only_a_body_declared_as_json_or_undeclared_is_read(up, hot_path):
    """A body declared as another type is refused in the endpoint's own format, before it is routed; the JSON
    media types (parameters and case aside) and no ``Content-Type`` are answered."""
    async with served(up, hot_path) as client:
        for path, body in BODIES.items():
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                r = await client.post(path, content=body, headers={"content-type": ctype})
                if path in ANTHROPIC:
                    message = anthropic_error(r, 400, "invalid_request_error")
                else:
                    message = openai_error(r, 400, "unsupported_content_type")
                    assert r.json()["error"]["param"] == "content-type"
                assert f"'{ctype}'" in message and "application/json" in message, (path, message)
            assert up.requests == []
            for ctype in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json", None):
                headers = {"content-type": ctype} if ctype else {}
                r = await client.post(path, content=body, headers=headers)
                assert r.status_code == 200, (path, ctype, r.text)
                assert ("content-type" in r.request.headers) == (ctype is not None)
            up.requests.clear()


@pytest.mark.parametrize("hot_path", [True, False])
async def test_every_path_under_messages_answers_anthropics_errors(up, hot_path):
    async with served(up, hot_path) as client:
        r = await client.get("/v1/messages")
        anthropic_error(r, 405, "invalid_request_error")
        assert "POST" in r.headers["allow"].split(", ")
        anthropic_error(await client.get("/v1/messages/count_tokens"), 405, "invalid_request_error")
        for path in ("/v1/messages/foo", "/v1/messages/batches", "/v1/messages/count_tokens/x"):
            anthropic_error(await client.post(path, content=MESSAGES), 404, "not_found_error")
        r = await client.post("/v1/messages", json={"model": "m1", "max_tokens": 5, "messages": []})
        anthropic_error(r, 400, "invalid_request_error")                 # a handler's refusal, as before
        r = await client.post("/v1/messages", content=MESSAGES, headers={"authorization": "Bearer wrong"})
        anthropic_error(r, 401, "authentication_error")


@pytest.mark.parametrize("hot_path", [True, False])
async def test_every_other_path_answers_openais_errors_with_the_routers_headers(up, hot_path):
    async with served(up, hot_path) as client:
        r = await client.get("/v1/chat/completions")
        openai_error(r, 405, "method_not_allowed")
        assert "POST" in r.headers["allow"].split(", ")
        openai_error(await client.post("/v1/messagesx", content=MESSAGES), 404, "not_found")
        openai_error(await client.post("/v1/chat/completions/foo", content=CHAT), 404, "not_found")
        openai_error(await client.post("/v1/nope", content=CHAT), 404, "not_found")
        # naming what was asked, in OpenAI's words (a new user's /v1/chat/completion got a bare "Not Found")
        r = await client.post("/v1/chat/completion", content=CHAT)
        assert r.json()["error"]["message"] == "Invalid URL (POST /v1/chat/completion)"
        r = await client.get("/v1/chat/completions")
        assert r.json()["error"]["message"] == "Method GET is not allowed on /v1/chat/completions"
