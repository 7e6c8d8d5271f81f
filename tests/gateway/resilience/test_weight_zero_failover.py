"""A route's targets of weight 0 serve before its fallbacks when its weighted targets cannot (new-user trial: the
README's "promote" onto a canary arm not started gave 502, then 503 on every request, while ``/health/ready``
said the route served). Real ``tandem serve`` processes, a real Redis, the official ``openai`` and ``anthropic``
clients, fault-injecting upstreams (tests/gateway/fault_upstream.py) and a port nothing listens on (the arm)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.gateway.fault_upstream import FaultUpstream
from tests.gateway.support import ROOT, GatewayProcess, wait_until

ENV = {"TEST_UPSTREAM_KEY": "upstream-secret", "TANDEM_ADMIN_TOKEN": "admin-tok"}
MSG = [{"role": "user", "content": "hi"}]


def config(ups: dict[str, FaultUpstream], redis_url: str, dead_port: int) -> str:
    backends = "".join(
        f"  {n}:\n    type: openai\n    base_url: {u.base_url}\n    api_key_env: TEST_UPSTREAM_KEY\n"
        f"    timeouts: {{connect_s: 1, read_s: 3, first_token_s: 3}}\n" for n, u in ups.items())
    backends += (f"  arm:\n    type: openai\n    base_url: http://127.0.0.1:{dead_port}/v1\n"
                 f"    timeouts: {{connect_s: 1, read_s: 3}}\n"
                 f"  nokey:\n    type: openai\n    base_url: {ups['stay'].base_url}\n    api_key_env: UNSET_KEY_ENV\n")
    return (f"state: {{redis_url: '{redis_url}', key_prefix: wz{uuid.uuid4().hex[:8]}}}\n"
            "reload: {watch: false}\n"
            "resilience:\n"
            "  retry: {max_attempts: 4, deadline_s: 10, backoff_initial_s: 0.05, backoff_max_s: 0.2}\n"
            "  breaker: {consecutive_failures: 1, open_s: 600, cache_s: 0}\n"
            "  health: {interval_s: 0.2, timeout_s: 1}\n"
            "models:\n  - name: promo\n  - name: spare\n"
            f"backends:\n{backends}"
            "routes:\n"
            # the README's local-first: a 5 % arm that is not started, keyless fallbacks
            "  promo:\n    targets: [{backend: stay, weight: 95}, {backend: arm, weight: 5}]\n"
            "    fallbacks: [{backend: nokey}]\n"
            "  spare:\n    targets: [{backend: zero, weight: 0}, {backend: arm, weight: 100}]\n"
            "    fallbacks: [{backend: fb}]\n"
            "policy:\n  default_route: promo\n  rules:\n"
            "    - {name: spare, match: {model: spare}, route: spare}\n")


@pytest.fixture(scope="module")
def ups():
    us = {n: FaultUpstream(n).start() for n in ("stay", "zero", "fb")}
    yield us
    for u in us.values():
        u.stop()


@pytest.fixture(scope="module")
def gw(ups, redis_url, tmp_path_factory):
    path = tmp_path_factory.mktemp("weight0") / "config.yaml"
    path.write_text(config(ups, redis_url, free_port()))
    g = GatewayProcess(path, env=ENV).start()
    yield g
    g.stop()


def chat(g: GatewayProcess, model: str, user: str):
    c = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        return c.chat.completions.with_raw_response.create(model=model, messages=MSG, user=user)
    except openai.APIStatusError as e:
        return e.response


def ready(g: GatewayProcess) -> httpx.Response:
    return httpx.get(g.url + "/health/ready", timeout=10)


def test_promote_onto_a_down_arm_is_served_by_the_weight_0_target(gw, ups):
    """``ctl weights promo arm=100 stay=0`` with the arm refusing connections: the warning names ``stay``, and
    every request, the first included, is answered by ``stay`` (a refused connection moves on at once), on the
    OpenAI and the Anthropic API; the route is ready."""
    wait_until(lambda: not ready(gw).json()["backends"]["arm"]["available"])   # the probe found the arm down
    r = subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", gw.url, "weights", "promo",
                        "arm=100", "stay=0"], cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "then goes to its targets of weight 0 (stay) (nokey: down too)" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "stay=0 (0 %), arm=100 (100 %)" in r.stdout and "    now: arm out (" in r.stdout, r.stdout
    assert "stay 100 %" in r.stdout, r.stdout     # the change's answer says what the requests get, as status does
    first = chat(gw, "promo", "u0")
    assert first.status_code == 200 and first.headers["x-tandem-backend"] == "stay", first.headers
    assert first.headers["x-tandem-attempts"] == "2"        # the arm (refused), then stay
    for i in range(1, 5):
        r = chat(gw, "promo", f"u{i}")
        assert r.status_code == 200 and r.headers["x-tandem-backend"] == "stay", r.headers
    assert ups["stay"].calls == 5
    m = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30)
    raw = m.messages.with_raw_response.create(model="promo", max_tokens=16, messages=MSG)
    assert raw.headers["x-tandem-backend"] == "stay" and raw.parse().content[0].text == "hello from stay"
    r = ready(gw)
    assert r.status_code == 200 and "promo" in r.json()["routes_serving"], r.json()
    st = subprocess.run([sys.executable, "-m", "gateway.commands", "ctl", "--url", gw.url, "status"], cwd=ROOT,
                        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr      # the weights say arm 100; what the requests get now is stay's
    assert "route promo: stay 0, arm 100  [operator]" in st.stdout and "    now: arm out (" in st.stdout, st.stdout
    assert "stay 100 %" in st.stdout, st.stdout


def test_weight_0_target_then_fallbacks_then_503_when_every_member_is_down(gw, ups):
    """Route spare: zero (weight 0) and the down arm (weight 100), fallback fb. zero answers while it can; when it
    fails, fb answers; when every member and fallback has failed: 503 and the route is not ready."""
    r = chat(gw, "spare", "s0")
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "zero" and ups["fb"].calls == 0, r.headers
    ups["zero"].set_default({"status": 503})
    r = chat(gw, "spare", "s1")
    assert r.status_code == 200 and r.headers["x-tandem-backend"] == "fb", r.headers
    assert ups["zero"].calls == 2 and ups["fb"].calls == 1     # zero tried before the fallback
    assert "spare" in ready(gw).json()["routes_serving"]    # fb can still answer
    ups["fb"].set_default({"status": 503})
    r = chat(gw, "spare", "s2")                # fb fails now: nothing is left
    assert r.status_code == 503, r.text
    assert ups["zero"].calls == 2 and ups["fb"].calls == 2   # open breakers are skipped, not called
    r = ready(gw)
    assert "spare" not in r.json()["routes_serving"] and "promo" in r.json()["routes_serving"], r.json()
