"""The ops console (``/admin/ui``) in a real headless browser: Debian's chromium driven by Playwright, against a
real ``tandem serve`` on 127.0.0.1 whose backends are fault-injecting upstreams. What the page does is checked
through the admin API (the weights a slider set, the version a rollback restored), not only on the page.

Skips, saying why, only where no chromium is installed (``make test`` installs it with apt when it can)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.gateway.support import FaultInjectorUpstream, gateway_on, sha, upstream_config, wait_until

TOKEN = "adm-console-0123"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
KEY = "sk-tandem-console-acme-0123456789"
ENV = {"TEST_UPSTREAM_KEY": "k", "TANDEM_ADMIN_TOKEN": TOKEN}
ROUTES = """  main:
    targets: [{backend: a, weight: 95}, {backend: b, weight: 5}]
"""
EXTRA = f"""auth:
  keys:
    - {{tenant: acme, sha256: {sha(KEY)}, rpm: 120}}
    - {{tenant: beta, sha256: {sha(KEY + "-beta")}}}
limits:
  tenants: {{acme: {{rpm: 600, tpm: 200000}}}}
budgets:
  tenants: {{acme: {{usd: 5, period: day}}}}
resilience:
  retry: {{max_attempts: 1}}
  health: {{interval_s: 0}}
"""
# a folder to save the README's screenshots in (docs/console), when set
SHOTS = os.environ.get("TANDEM_CONSOLE_SCREENSHOTS")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
        "--no-first-run", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    a, b = FaultInjectorUpstream("a").start(), FaultInjectorUpstream("b").start()
    try:
        yield from gateway_on(tmp_path_factory, "console", upstream_config({"a": a, "b": b}, ROUTES, extra=EXTRA),
                              env=ENV)
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A fresh chromium profile (Debian's binary, never a downloaded one)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM}: install Debian's (apt-get install chromium; `make test` does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: "
                                                                 "pip install -e '.[test]'")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                   executable_path=CHROMIUM, args=ARGS, headless=True,
                                                   viewport={"width": 1360, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture
def page(browser, gateway):
    pg = browser.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # a refused token (401) and the optional endpoints' 404s are logged as failed loads: expected; any other
    # console error (a CSP violation, an exception) fails the test
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error"
          and not m.text.startswith("Failed to load resource") else None)
    pg.goto(gateway.url + "/admin/ui")
    yield pg
    pg.close()
    assert not errors, errors          # no script error and no CSP violation on any page


def sign_in(page, token: str = TOKEN) -> None:
    page.get_by_label("Admin token").fill(token)
    page.get_by_role("button", name="Sign in").click()


def shoot(page, name: str) -> None:
    if SHOTS:
        page.wait_for_timeout(300)      # let the share bars' transition end
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def weights(gateway) -> dict[str, float]:
    cfg = httpx.get(gateway.url + "/admin/config", headers=ADMIN, timeout=10).json()
    return {t["id"]: t["weight"] for t in cfg["routes"]["main"]["targets"]}


def test_page_is_a_shell_with_a_strict_policy(gateway):
    r = httpx.get(gateway.url + "/admin/ui", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "m1" not in r.text and "acme" not in r.text      # no data without the token
    assert httpx.get(gateway.url + "/admin/ui/console.js", timeout=10).headers["content-type"].startswith(
        "text/javascript")
    assert httpx.get(gateway.url + "/admin/ui/..%2Fadmin.py", timeout=10).status_code == 404
    assert httpx.get(gateway.url + "/admin/limits", timeout=10).status_code == 401
    lim = httpx.get(gateway.url + "/admin/limits", headers=ADMIN, timeout=10).json()
    assert lim["tenants"]["acme"] == {"rpm": 600, "tpm": 200000, "keys": [{"rpm": 120, "tpm": None}]}
    assert lim["tenants"]["beta"] == {"rpm": None, "tpm": None, "keys": [{"rpm": None, "tpm": None}]}


def test_wrong_token_is_refused_then_the_right_one_signs_in(page):
    sign_in(page, "not-the-token")
    page.get_by_role("alert").filter(has_text="Refused").wait_for()
    assert page.locator("#main").is_hidden()
    sign_in(page)
    page.locator("#main").wait_for()
    assert page.locator("#login").is_hidden()
    page.get_by_role("table", name="Targets of route main").get_by_text("95 %").wait_for()
    assert page.locator("#live").inner_text().startswith("live")


def test_canary_slider_sets_the_weight_then_rollback_restores_it(page, gateway):
    assert weights(gateway) == {"a": 95, "b": 5}
    sign_in(page)
    slider = page.locator("#canary-main")
    page.get_by_label("Canary target").select_option("b")
    assert slider.input_value() == "5"
    slider.focus()
    for _ in range(20):                           # keyboard only: 5 -> 25
        page.keyboard.press("ArrowRight")
    assert slider.input_value() == "25"
    page.wait_for_timeout(2500)                   # a poll in between keeps the operator's edit
    assert slider.input_value() == "25"
    page.get_by_role("button", name="Apply").click()
    wait_until(lambda: weights(gateway) == {"a": 75, "b": 25})
    page.get_by_role("status").filter(has_text="b to 25 %: done").wait_for()
    page.get_by_role("table", name="Targets of route main").get_by_text("75 %").wait_for()

    page.get_by_role("button", name="Roll back to previous version").click()
    wait_until(lambda: weights(gateway) == {"a": 95, "b": 5})
    page.get_by_role("status").filter(has_text="Roll back: done").wait_for()
    page.wait_for_function("document.getElementById('canary-main').value === '5'")


def test_explain_shows_the_live_decision_and_the_refusal(page, gateway):
    sign_in(page)
    page.locator("#main").wait_for()
    box = page.get_by_label("Request body (JSON)")
    wait_until(lambda: '"m1"' in box.input_value())             # prefilled with a public model
    page.get_by_role("button", name="Explain").click()
    decision = page.locator("#explain-result .chosen")
    decision.wait_for()
    assert decision.inner_text() in ("a", "b")
    assert "route main" in page.locator("#explain-result").inner_text()
    box.fill('{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}')
    page.get_by_role("button", name="Explain").click()
    page.get_by_role("alert").filter(has_text="Refused (404)").wait_for()


def test_tenants_spend_budget_and_limits(page, gateway):
    for _ in range(3):
        r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=10,
                       json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
    sign_in(page)
    row = page.get_by_role("table", name="Spend and limits per tenant").get_by_role("row", name="acme")
    row.wait_for()
    wait_until(lambda: row.locator("td").first.inner_text() == "3")
    text = row.inner_text()
    assert "600 rpm" in text and "200,000 tpm" in text and "per key: 120 rpm" in text and "/ day" in text
    shoot(page, "console")
    meter = row.get_by_role("meter")
    assert float(meter.get_attribute("aria-valuenow")) > 0
