"""An upstream's redirect is its failure (gateway/backends/upstream.py ``_http_error``): never followed (the body
and the key would go where it says), never passed on as an answer. A security trial's 307 reached the client as
an empty 200-class answer, billed as estimated usage. A real ``tandem serve`` over a scripted upstream."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.script_upstream import upstream  # noqa: F401 -- the module-scoped fixture
from tests.gateway.support import gateway_on, one_upstream_config

REDIRECT = {"status": 307, "headers": {"location": "http://127.0.0.1:9/v1/chat/completions"}, "body": b""}


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    yield from gateway_on(tmp_path_factory, "redirect", one_upstream_config(
        upstream.base_url, resilience="health: {interval_s: 0}, retry: {max_attempts: 1}"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_redirect_is_a_502_naming_it(gateway, upstream, stream):
    upstream.reset()
    upstream.push(REDIRECT)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 502, (r.status_code, r.text)
    error = r.json()["error"]
    assert "The last one said: HTTP 307 redirect, not followed: set the backend's base_url" in error["message"], error
    assert upstream.calls == 1
