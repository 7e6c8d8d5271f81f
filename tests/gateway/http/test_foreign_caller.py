"""A keyless gateway serves this machine only (``gateway/request/auth.py`` ``foreign_caller``): browsers reach a
loopback port too, so a page of another site may not call it, blind (its ``Origin``) or through DNS rebinding (its
``Host``), and spend the upstreams' keys. A real ``tandem serve`` over a scripted upstream, and a real chromium for
the cross-site page (a security trial's blind ``fetch(..., {mode: "no-cors"})`` was served and billed)."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest

from gateway.request.auth import foreign_caller, serves_this_machine_only
from tests.conftest import free_port
from tests.gateway.http.test_console import browser  # noqa: F401 -- its module-scoped chromium
from tests.gateway.script_upstream import upstream  # noqa: F401 -- the module-scoped fixture
from tests.gateway.support import gateway_on, one_upstream_config, wait_until

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    yield from gateway_on(tmp_path_factory, "foreign", one_upstream_config(upstream.base_url))


def post(gateway, path: str, **headers) -> httpx.Response:
    body = CHAT if path != "/v1/messages" else {**CHAT, "max_tokens": 5}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)


def test_callers_on_this_machine_are_served(gateway, upstream):
    port = gateway.port
    for headers in ({}, {"host": f"localhost:{port}"}, {"host": f"[::1]:{port}"}, {"host": f"app.localhost:{port}"},
                    {"origin": f"http://127.0.0.1:{port}"}, {"host": "127.0.0.2"}):
        r = post(gateway, "/v1/chat/completions", **headers)
        assert r.status_code == 200, (headers, r.text)
    assert httpx.get(gateway.url + "/v1/models", headers={"host": f"localhost:{port}"}).status_code == 200


@pytest.mark.parametrize("headers, words", [
    ({"host": "attacker.example:{port}"}, "Host 'attacker.example:{port}' is not a loopback name"),
    ({"host": "127.0.0.1.nip.io"}, "Host '127.0.0.1.nip.io' is not a loopback name"),
    ({"origin": "http://evil.example"}, "a page of http://evil.example may not call this gateway"),
    ({"origin": "null"}, "a page of null may not call this gateway"),            # a sandboxed frame, a file
    ({"origin": "http://localhost:{port}"}, "a page of http://localhost:{port} may not"),   # another origin
])
def test_another_sites_page_is_refused_before_any_upstream_call(gateway, upstream, headers, words):
    headers = {k: v.format(port=gateway.port) for k, v in headers.items()}
    words = words.format(port=gateway.port)
    calls = upstream.calls
    r = post(gateway, "/v1/chat/completions", **headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "foreign_origin", r.text
    assert r.json()["error"]["type"] == "permission_error" and words in r.json()["error"]["message"]
    m = post(gateway, "/v1/messages", **headers)       # Anthropic's format there
    assert m.status_code == 403 and m.json()["type"] == "error", m.text
    assert m.json()["error"]["type"] == "permission_error" and words in m.json()["error"]["message"]
    assert httpx.get(gateway.url + "/v1/models", headers=headers).status_code == 403
    assert upstream.calls == calls
    # the operational details too (the README trial read /health/ready's backends and /metrics through a rebound
    # Host): readiness answers its status only, /metrics is refused
    ready = httpx.get(gateway.url + "/health/ready", headers=headers).json()
    assert ready["status"] == "ready" and "backends" not in ready, ready
    assert "backends" in httpx.get(gateway.url + "/health/ready").json()
    assert httpx.get(gateway.url + "/metrics", headers=headers).status_code == 403
    assert httpx.get(gateway.url + "/metrics").status_code == 200


def test_the_rule_holds_only_for_a_keyless_gateway_on_loopback():
    """Keys (a browser cannot send one it does not hold), ``--insecure`` or a public bind (an open gateway is meant,
    or refused at start) turn it off; ``server.cors``' origins may call."""
    from gateway.config.compile import load_config_text

    text = one_upstream_config("http://127.0.0.1:9/v1")
    keyless, keyed = load_config_text(text), load_config_text(text + "auth: {keys: [{tenant: t, env: K}]}",
                                                               environ={"K": "sk"})
    assert serves_this_machine_only(keyless, "127.0.0.1") and serves_this_machine_only(keyless, "::1")
    assert not serves_this_machine_only(keyless, "127.0.0.1", insecure=True)
    assert not serves_this_machine_only(keyless, "0.0.0.0") and not serves_this_machine_only(keyed, "127.0.0.1")
    assert foreign_caller("localhost:8000", "http://app.example", ("http://app.example",)) is None
    assert foreign_caller("localhost:8000", "http://app.example", ("*",)) is None
    assert foreign_caller("localhost:8000", "http://other.example", ("http://app.example",)) is not None
    assert foreign_caller(None, None, ()) is None and foreign_caller("[::1]", None, ()) is None


class _OtherSite(http.server.BaseHTTPRequestHandler):
    """A page of another site (another origin than the gateway's)."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(b"<p>a page of another site</p>")

    def log_message(self, *args):
        pass


def test_a_real_cross_site_page_cannot_post_blind_but_the_gateways_own_origin_can(gateway, upstream, browser):
    """chromium on a page of http://localhost:P (another origin than http://127.0.0.1:G) runs the trial's blind
    POST (a Blob: no content type, so no preflight); the upstream sees no call. The same fetch from the
    gateway's own origin is served."""
    script = ("fetch('%s/v1/chat/completions', {method: 'POST', mode: 'no-cors', body: new Blob([%r])})"
              % (gateway.url, json.dumps(CHAT)))
    page_server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _OtherSite)
    threading.Thread(target=page_server.serve_forever, daemon=True).start()
    page = browser.new_page()
    try:
        calls = upstream.calls
        page.goto(f"http://localhost:{page_server.server_address[1]}/")
        refused = gateway.log().count("foreign_origin")
        # sent (an opaque answer: the browser let it out) and refused by the gateway, not blocked on the way
        assert page.evaluate(f"{script}.then(() => 'sent', e => String(e))") == "sent"
        wait_until(lambda: gateway.log().count("foreign_origin") > refused)
        assert upstream.calls == calls
        page.goto(gateway.url + "/v1/models")                 # a page of the gateway's own origin
        assert page.evaluate(f"{script}.then(() => 'sent', e => String(e))") == "sent"
        wait_until(lambda: upstream.calls == calls + 1)
    finally:
        page.close()
        page_server.shutdown()

