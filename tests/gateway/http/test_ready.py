"""Readiness and ``tandem route explain --url`` tell the truth about the running gateway: runtime weights and
open breakers (scripted upstreams that fail on demand, tests/gateway/script_upstream.py)."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from tests.gateway.script_upstream import ScriptUpstream
from tests.gateway.support import PYTHON, ROOT, GatewayProcess

ADMIN = "ready-admin-token"
CONFIG = """
models:
  - name: m1
backends:
  up: {{type: openai, base_url: '{a}'}}
  up2: {{type: openai, base_url: '{b}'}}
routes:
  a: {{targets: [{{backend: up}}]}}
  b: {{targets: [{{backend: up2}}]}}
  split: {{targets: [{{backend: up, weight: 100}}, {{backend: up2, weight: 0}}]}}
policy:
  default_route: a
  rules:
    - {{name: to-b, match: {{header.x-route: b}}, route: b}}
    - {{name: to-split, match: {{header.x-route: split}}, route: split}}
resilience:
  retry: {{max_attempts: 1}}
  breaker: {{consecutive_failures: 1, open_s: 600}}
  health: {{interval_s: 0}}
"""
FAIL = {"status": 500, "body": b'{"error": {"message": "down", "type": "server_error"}}'}
MSG = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def ups():
    a, b = ScriptUpstream().start(), ScriptUpstream().start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gateway(ups, tmp_path_factory):
    path = tmp_path_factory.mktemp("ready") / "config.yaml"
    path.write_text(CONFIG.format(a=ups[0].base_url, b=ups[1].base_url))
    g = GatewayProcess(path, env={"TANDEM_ADMIN_TOKEN": ADMIN}).start()
    yield g
    g.stop()


def explain(g: GatewayProcess, tmp_path, *args: str) -> subprocess.CompletedProcess:
    req = tmp_path / "req.json"
    req.write_text(json.dumps(MSG))
    return subprocess.run([PYTHON, "-m", "gateway.commands", "route", "explain", "--request", str(req), *args],
                          cwd=ROOT, env={**os.environ, "TANDEM_ADMIN_TOKEN": ADMIN}, capture_output=True,
                          text=True, timeout=60)


def fail_route(g: GatewayProcess, upstream: ScriptUpstream, route: str) -> None:
    upstream.push(FAIL)
    r = httpx.post(g.url + "/v1/chat/completions", json=MSG, headers={"x-route": route}, timeout=10)
    assert r.status_code == 502, r.text + g.log()[-3000:]


def test_explain_url_is_the_running_gateways_decision(gateway, ups, tmp_path):
    r = httpx.post(gateway.url + "/admin/weights", json={"route": "split", "weights": {"up": 0, "up2": 100}},
                   headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text
    live = explain(gateway, tmp_path, "--url", gateway.url, "--header", "x-route=split", "--json")
    assert live.returncode == 0, live.stderr
    decision = json.loads(live.stdout)["decision"]
    assert decision["route"] == "split" and decision["attempts"][0]["id"] == "up2"   # the runtime weights, not
    # the file's (up 100, up2 0)


def test_ready_is_degraded_when_no_route_can_serve(gateway, ups, tmp_path):
    a, b = ups
    fail_route(gateway, a, "a")                 # up's breaker opens: route b still serves
    r = httpx.get(gateway.url + "/health/ready", timeout=10)
    assert r.status_code == 200 and r.json()["routes_serving"] == ["b", "split"]
    r = httpx.post(gateway.url + "/admin/explain", json={"request": MSG}, timeout=10,
                   headers={"authorization": f"Bearer {ADMIN}"})
    assert r.json()["breakers"] == {"up": "open"}, r.text
    deep = '{"request": ' + "[" * 3000 + "]" * 3000 + "}"      # a 400 as on the public endpoints, not a 500
    for path in ("/admin/explain", "/admin/weights"):
        r = httpx.post(gateway.url + path, content=deep, timeout=10, headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"], (path, r.text)
    for field, value in (("headers", "str"), ("headers", [1, 2]), ("headers", 5), ("tenant", ["a"])):   # a 500 once
        r = httpx.post(gateway.url + "/admin/explain", json={"request": MSG, field: value}, timeout=10,
                       headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    fail_route(gateway, b, "b")                 # and up2's: nothing can serve
    r = httpx.get(gateway.url + "/health/ready", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "degraded" and r.json()["routes_serving"] == []
