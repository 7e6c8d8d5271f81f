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

from tests.gateway.support import FaultInjectorUpstream, GatewayProcess, gateway_on, sha, upstream_config, wait_until

pytestmark = pytest.mark.slow   # a large workload: tests/conftest.py runs these files first

TOKEN = "adm-console-0123"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
KEY = "sk-tandem-console-acme-0123456789"
ENV = {"TEST_UPSTREAM_KEY": "k", "TANDEM_ADMIN_TOKEN": TOKEN}
ROUTES = """  main:
    targets: [{backend: a, weight: 95}, {backend: b, weight: 5}]
  cheap:
    select: cheapest
    targets: [{backend: a}, {backend: b}]
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
        for g in gateway_on(tmp_path_factory, "console", upstream_config({"a": a, "b": b}, ROUTES, extra=EXTRA),
                            env=ENV):
            g.upstreams = {"a": a, "b": b}
            yield g
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


def signed_in(browser, url: str, viewport: dict | None = None):
    """A new page on the console of the gateway at ``url``, signed in (``viewport``: its size, else the
    browser's)."""
    page = browser.new_page()
    if viewport is not None:
        page.set_viewport_size(viewport)
    page.goto(url + "/admin/ui")
    sign_in(page)
    return page


def shoot(page, name: str, section: str | None = None) -> None:
    """Save the page (or its section titled ``section``) as ``SHOTS/name.png``, when SHOTS is set."""
    if SHOTS:
        page.evaluate("window.scrollTo(0, 0)")   # the sticky header at the top of the picture
        page.wait_for_timeout(300)                # let the share bars' transition end
        path = str(Path(SHOTS) / f"{name}.png")
        if section is None:
            page.screenshot(path=path, full_page=True)
        else:
            page.get_by_role("region", name=section).screenshot(path=path)


def weights_of(gateway) -> dict[str, float]:
    """Route ``main``'s live weights, from the admin API."""
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
    head = httpx.head(gateway.url + "/admin/ui", timeout=10)            # uptime checkers send HEAD
    assert head.status_code == 200 and head.content == b"" and "script-src 'self'" in head.headers[
        "content-security-policy"]
    for path in ("/health/live", "/health/ready"):
        assert httpx.head(gateway.url + path, timeout=10).status_code in (200, 503)
    assert httpx.get(gateway.url + "/admin/limits", timeout=10).status_code == 401
    lim = httpx.get(gateway.url + "/admin/limits", headers=ADMIN, timeout=10).json()
    assert lim["tenants"]["acme"] == {"rpm": 600, "tpm": 200000, "keys": [{"rpm": 120, "tpm": None}]}
    assert lim["tenants"]["beta"] == {"rpm": None, "tpm": None, "keys": [{"rpm": None, "tpm": None}]}


def test_wrong_token_is_refused_then_the_right_one_signs_in(page):
    sign_in(page, "not-the-token")
    page.get_by_role("alert").filter(has_text="Refused").wait_for()
    assert page.locator("#main").is_hidden()
    token = page.get_by_label("Admin token")
    assert token.evaluate("e => e === document.activeElement")   # back in the field, for the keyboard
    token.fill(TOKEN)
    page.keyboard.press("Enter")
    page.locator("#main").wait_for()
    assert page.locator("#login").is_hidden()
    page.get_by_role("table", name="Targets of route main").get_by_text("95 %").first.wait_for()
    assert page.get_by_role("status").filter(has_text="live").inner_text() == "live"


@pytest.fixture(scope="module")
def wide_gateway(tmp_path_factory):
    """Three routes whose targets are mostly unavailable for a long reason (an unset key: the environment variable
    is named in the card), as in config.example.yaml without keys."""
    ups = {n: FaultInjectorUpstream(n).start() for n in ("primary", "deepseek", "holysheep")}
    routes = ("  local-first:\n    targets: [{backend: primary, weight: 95}, {backend: holysheep, weight: 5}]\n"
              "    fallbacks: [{backend: holysheep}]\n"
              "  aggregator:\n    targets: [{backend: deepseek, weight: 50}, {backend: holysheep, weight: 50}]\n"
              "  cheapest:\n    select: cheapest\n    targets: [{backend: deepseek}, {backend: holysheep}]\n")
    text = upstream_config(ups, routes, key_env="TANDEM_CONSOLE_LAYOUT_UNSET_API_KEY",
                           default_route="local-first")
    text = text.replace("TANDEM_CONSOLE_LAYOUT_UNSET_API_KEY", "TEST_UPSTREAM_KEY", 1)   # primary's key is set
    try:
        yield from gateway_on(tmp_path_factory, "console-wide", text, env=ENV)
    finally:
        for u in ups.values():
            u.stop()


def test_a_phone_wide_view_scrolls_its_tables_not_the_page(browser, wide_gateway):
    """At 390 px a trial's page was 787 px wide (the tenants' and routes' tables widened every card) and the
    explain result printed "[object HTMLParagraphElement]" for each unavailable backend."""
    page = signed_in(browser, wide_gateway.url, {"width": 390, "height": 800})
    page.get_by_role("table", name="Targets of route cheapest").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 391
    # and a table scrolls in its box with readable columns: squeezed to the screen, an unavailable target's
    # reason ran a word fragment a line (a trial's row was 1,004 px tall)
    rows = page.evaluate("[...document.querySelectorAll('.route tbody tr')].map(r => r.getBoundingClientRect().height)")
    assert rows and max(rows) < 300, rows
    page.get_by_role("textbox", name="Tenant").fill("acme")
    page.get_by_role("button", name="Explain").click()
    page.locator("#explain-result .chosen").wait_for()
    result = page.locator("#explain-result").inner_text()
    assert "Unavailable deepseek:" in result and "[object" not in result, result
    page.close()


@pytest.mark.parametrize("width", [1400, 1920])
def test_route_cards_fit_their_column_on_wide_screens(browser, wide_gateway, width):
    """Wide viewports (three grid tracks of the 420 px minimum) squeezed a route's table and slider under its
    content's width (an unset key's variable name does not wrap): it ran into the next card. Each card holds its
    content and no two overlap."""
    page = signed_in(browser, wide_gateway.url, {"width": width, "height": 900})
    page.get_by_role("table", name="Targets of route cheapest").wait_for()
    cards = page.locator(".route")
    boxes = [cards.nth(i).bounding_box() for i in range(cards.count())]
    assert len(boxes) == 3
    for i in range(cards.count()):
        over = cards.nth(i).evaluate("e => [...e.querySelectorAll('*')].filter(c => "
                                     "c.getBoundingClientRect().right > e.getBoundingClientRect().right + 1)"
                                     ".map(c => c.tagName + '.' + c.className)")
        assert over == [], over
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                     or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])
            assert apart, boxes
    page.close()


def test_canary_slider_sets_the_weight_then_rollback_restores_it(page, gateway):
    assert weights_of(gateway) == {"a": 95, "b": 5}
    sign_in(page)
    slider = page.locator("#canary-main")
    page.locator("#canary-target-main").select_option("b")
    assert slider.input_value() == "5"
    slider.focus()
    for _ in range(20):                           # keyboard only: 5 -> 25
        page.keyboard.press("ArrowRight")
    assert slider.input_value() == "25"
    page.wait_for_timeout(2500)                   # a poll in between keeps the operator's edit
    assert slider.input_value() == "25"
    page.get_by_role("button", name="Apply canary weight to route main").click()
    wait_until(lambda: weights_of(gateway) == {"a": 75, "b": 25})
    page.get_by_role("status").filter(has_text="b to 25 %: done").wait_for()
    page.get_by_role("table", name="Targets of route main").get_by_text("75 %").first.wait_for()
    page.get_by_text("Weights decided by operator").wait_for()    # the layer that decides, as tandem ctl status

    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))   # asked first: dismissed, nothing done
    page.get_by_role("button", name="Roll back to previous version").click()
    wait_until(lambda: asked)
    assert "Roll config version" in asked[0] and weights_of(gateway) == {"a": 75, "b": 25}
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Roll back to previous version").click()
    wait_until(lambda: weights_of(gateway) == {"a": 95, "b": 5})
    page.get_by_role("status").filter(has_text="Roll back: done").wait_for()
    # polled from here: page.wait_for_function's string predicate is evaluated with eval in the page, which the
    # console's CSP (script-src 'self') refuses, and the page fixture counts that as a CSP violation
    wait_until(lambda: slider.input_value() == "5")


def test_no_canary_slider_where_weights_do_not_steer(page):
    sign_in(page)
    card = page.get_by_role("article").filter(has=page.get_by_role("table", name="Targets of route cheap"))
    card.get_by_text("picks the cheapest among its targets").wait_for()
    assert page.locator("#canary-cheap").is_hidden() and page.locator("#canary-main").is_visible()
    # no share there: the cheaper target takes the traffic (an ops trial read the 50 % shown as a split)
    table = page.get_by_role("table", name="Targets of route cheap")
    assert table.get_by_text("choice").count() == 2 and table.get_by_text("50 %").count() == 0


def test_explain_shows_the_live_decision_and_the_refusal(page, gateway):
    sign_in(page)
    page.locator("#main").wait_for()
    box = page.get_by_label("Request body (JSON)")
    wait_until(lambda: '"m1"' in box.input_value())             # prefilled with a public model
    page.get_by_role("button", name="Explain").click()            # no key, no tenant: what such a request gets
    refused = page.get_by_role("alert").filter(has_text="Refused (401)")
    refused.wait_for()
    assert "Fill in Tenant" in refused.inner_text()               # what to do about it (an ops trial was stuck)
    page.get_by_role("textbox", name="Tenant").fill("acme")
    page.get_by_role("button", name="Explain").click()
    decision = page.locator("#explain-result .chosen")
    decision.wait_for()
    assert decision.inner_text() in ("a", "b")
    assert "route main" in page.locator("#explain-result").inner_text()
    box.fill('{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}')
    page.get_by_role("button", name="Explain").click()
    page.get_by_role("alert").filter(has_text="Refused (404)").wait_for()
    if SHOTS:
        box.fill('{"model": "m1", "messages": [{"role": "user", "content": "Summarise our Q3 numbers"}]}')
        page.get_by_role("button", name="Explain").click()
        decision.wait_for()
        shoot(page, "explain", "Route explain")


def test_tenants_spend_budget_and_limits(page, gateway):
    for _ in range(3):
        r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=10,
                       json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
    for up in gateway.upstreams.values():          # beta's one request: accepted, no backend answers it
        up.set_mode(status=500)
    try:
        r = httpx.post(gateway.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}-beta"},
                       timeout=10, json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code >= 500, r.text
    finally:
        for up in gateway.upstreams.values():
            up.set_mode()
    sign_in(page)
    table = page.get_by_role("table", name="Spend and limits per tenant")
    row = table.get_by_role("row", name="acme")
    row.wait_for()
    wait_until(lambda: row.locator("td").first.inner_text() == "3")
    beta = table.get_by_role("row", name="beta")
    wait_until(lambda: beta.locator("td").first.inner_text() == "1 (1 failed)")
    text = row.inner_text()
    assert "600 rpm" in text and "200,000 tpm" in text and "per key: 120 rpm" in text and "/ day" in text
    shoot(page, "tenants", "Spend and limits per tenant")
    meter = row.get_by_role("meter")
    assert float(meter.get_attribute("aria-valuenow")) > 0


# ---- rollouts: a real controller advancing on live traffic ------------------------------------------------------
ROLLOUT_CONFIG = """reload: {{watch: false}}
resilience:
  retry: {{max_attempts: 1}}
  health: {{interval_s: 0}}
observability:
  logs: {{requests: false}}
models:
  - name: m1
backends:
  stable: {{type: openai, base_url: '{stable}', prices: {{input: 1, output: 2}}}}
  cand: {{type: openai, base_url: '{cand}', prices: {{input: 1, output: 2}}}}
routes:
  main:
    targets: [{{backend: stable, weight: 100}}, {{backend: cand, weight: 0}}]
policy:
  default_route: main
"""
GATES = {"parity_min": 0.9, "error_rate_max": 0.2, "ttft_p50_ratio_max": 50, "min_compared": 2}


@pytest.fixture
def rollout_gateway(tmp_path_factory):
    """A gateway with route ``main`` over ``stable`` and ``cand`` (fault-injecting upstreams), and a client thread
    sending it a chat request every 50 ms (the traffic a rollout's gates judge)."""
    import threading

    from tests.gateway.fault_upstream import FaultUpstream

    with FaultUpstream("stable") as stable, FaultUpstream("cand") as cand:
        text = ROLLOUT_CONFIG.format(stable=stable.base_url, cand=cand.base_url)
        stop = threading.Event()
        for g in gateway_on(tmp_path_factory, "console-rollout", text, env=ENV):
            def traffic():
                with httpx.Client(base_url=g.url, timeout=10) as c:
                    while not stop.wait(0.05):
                        c.post("/v1/chat/completions", json={"model": "m1", "messages": [
                            {"role": "user", "content": "hi"}]})

            t = threading.Thread(target=traffic, daemon=True)
            t.start()
            try:
                yield g, cand
            finally:
                stop.set()
                t.join(10)


def rollout(g, name: str) -> dict:
    rs = httpx.get(g.url + "/admin/rollouts", headers=ADMIN, timeout=10).json()["rollouts"]
    return next(r for r in rs if r["name"] == name)


def open_start_form(page, name: str) -> None:
    """Open the page's start-a-rollout form with ``name``, route ``main`` and candidate ``cand`` filled in."""
    page.get_by_text("Start a rollout").click()
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Route", exact=True).select_option("main")
    page.get_by_label("Candidate target", exact=True).select_option("cand")


def start_rollout(g, name: str, hold_s: float) -> None:
    r = httpx.post(g.url + "/admin/rollouts", headers=ADMIN, timeout=10, json={
        "name": name, "route": "main", "candidate": "cand", "steps": [5, 25, 100], "hold_s": hold_s,
        "gates": GATES, "check_interval_s": 0.2})
    assert r.status_code == 201, r.text


def test_console_watches_a_rollout_advance_and_steers_it(browser, rollout_gateway):
    g, _ = rollout_gateway
    page = signed_in(browser, g.url)
    open_start_form(page, "cand-canary")                     # started from the page, as an operator would
    page.get_by_label("Hold each step (s)").fill("3")
    page.get_by_label("Parity at least (0–1)").fill(str(GATES["parity_min"]))
    page.get_by_label("Error rate at most (0–1)").fill(str(GATES["error_rate_max"]))
    page.get_by_label("TTFT p50 at most (× primary's)").fill(str(GATES["ttft_p50_ratio_max"]))
    page.get_by_label("Pairs before judging").fill(str(GATES["min_compared"]))
    page.get_by_role("button", name="Start rollout").click()
    page.get_by_role("status").filter(has_text="Start rollout cand-canary: done").wait_for()
    r = rollout(g, "cand-canary")
    assert (r["route"], r["candidate"], r["steps"], r["hold_s"]) == ("main", "cand", [5, 25, 100], 3)
    assert {k: v["limit"] for k, v in r["gates"].items()} == {k: v for k, v in GATES.items() if k != "min_compared"}
    card = page.get_by_role("article", name="Rollout cand-canary")
    card.wait_for()
    card.get_by_role("button", name="Pause").click()           # steer it: paused at its first step
    wait_until(lambda: rollout(g, "cand-canary")["state"] == "paused")
    card.locator(".badge", has_text="paused").wait_for()
    assert card.get_by_role("button", name="Pause").is_disabled()
    page.get_by_text("Rollout cand-canary is paused: the weights are yours").wait_for()   # on the route's card
    paused_at = rollout(g, "cand-canary")["weight"]
    page.wait_for_timeout(4000)                                  # longer than hold_s: a paused rollout stays put
    assert rollout(g, "cand-canary")["state"] == "paused" and rollout(g, "cand-canary")["weight"] == paused_at
    card.get_by_role("button", name="Resume").click()
    wait_until(lambda: rollout(g, "cand-canary")["state"] == "running")
    page.get_by_text("Rollout cand-canary (running) sets cand's weight here").wait_for()   # on the route's card

    card.locator(".rollout-weight", has_text="25 %").wait_for(timeout=60_000)   # gates held: 5 -> 25
    shoot(page, "rollout")
    card.locator(".badge", has_text="promoted").wait_for(timeout=60_000)       # then 25 -> 100
    r = rollout(g, "cand-canary")
    steps = [h["weight"] for h in r["history"]]
    assert [w for i, w in enumerate(steps) if i == 0 or w != steps[i - 1]] == [5, 25, 100], r["history"]
    assert [h["state"] for h in r["history"]][1:3] == ["paused", "running"] and r["weight"] == 100
    assert card.locator(".ladder li.done").count() == 2
    chart = card.locator("svg.chart").first.get_attribute("aria-label")   # the chart's text alternative
    assert chart.startswith("Candidate weight over time: 5 %") and chart.endswith("now 100 %"), chart
    assert card.get_by_role("button", name="Abort").is_disabled()               # over: only a release is left
    # released from the page (a trial's promoted rollout had every button disabled: no Release)
    page.on("dialog", lambda d: d.accept())
    card.get_by_role("button", name="Release").click()
    wait_until(lambda: rollout(g, "cand-canary")["state"] == "released")
    page.close()


def test_an_action_refused_far_down_the_page_is_shown_in_view(browser, rollout_gateway):
    """A trial's refused rollout start (a bad name) put its message at the top of the page, 3,000 px above the
    form: the start looked ignored. The outcome is shown fixed in the view, as an alert."""
    g, _ = rollout_gateway
    page = signed_in(browser, g.url, {"width": 1280, "height": 800})
    open_start_form(page, "bad name")
    page.get_by_role("button", name="Start rollout").click()
    alert = page.get_by_role("alert").filter(has_text="Start rollout bad name refused")
    alert.wait_for()
    box = alert.bounding_box()
    assert 0 <= box["y"] and box["y"] + box["height"] <= 800, box
    assert page.evaluate("window.scrollY") > 0          # the form is down the page: the view did not move to it
    # a config file edit the gateway refuses is said on the page, as tandem ctl status says it (a trial saw
    # nothing there while /admin/config reported it)
    path = Path(g.config_path)
    text = path.read_text()
    path.write_text(text + "\nbroken: [\n")
    try:
        page.get_by_text("file does not load (the running version is kept)").wait_for()
        assert page.locator("#file-status p").get_attribute("class") == "error"     # the file's refused flag
    finally:
        path.write_text(text)
    page.get_by_text("file does not load").wait_for(state="detached")
    page.close()


def test_a_change_names_its_own_warnings_not_the_standing_ones(browser, wide_gateway):
    """Without keys (as config.example.yaml ships) the aggregator routes' weight on keyless backends is a standing
    warning; a trial saw it repeated in the notice of every change. The page lists the standing warnings once;
    a change's notice names only the warnings it brought (here its own route's weight on a down backend)."""
    page = signed_in(browser, wide_gateway.url)
    summary = page.locator("#config-warnings summary")
    summary.wait_for()
    summary.click()
    assert "routes.aggregator:" in page.locator("#config-warnings").inner_text()
    page.locator("#canary-target-local-first").select_option("holysheep")
    slider = page.locator("#canary-local-first")
    slider.focus()
    for _ in range(5):                            # 5 -> 10 % onto the keyless backend
        page.keyboard.press("ArrowRight")
    page.get_by_role("button", name="Apply canary weight to route local-first").click()
    status = page.get_by_role("status").filter(has_text="holysheep to 10 %: done")
    status.wait_for()
    text = status.inner_text()
    assert "Warning: routes.local-first: 10.0 %" in text and "routes.aggregator" not in text, text
    assert "standing config warning" in text, text
    page.once("dialog", lambda d: d.accept())     # the module's gateway as it was
    page.get_by_role("button", name="Roll back to previous version").click()
    page.get_by_role("status").filter(has_text="Roll back: done").wait_for()
    page.close()


def test_a_rollout_started_onto_a_down_candidate_is_started_with_a_warning(browser, tmp_path_factory):
    """The candidate's backend refuses connections (its health probe found it down): the page's start says so."""
    import socket

    from tests.gateway.fault_upstream import FaultUpstream

    # the port stays bound, never listening: connections are refused and no other test's server can take it (a
    # full run's candidate answered: the port had been freed and reused)
    with socket.socket() as s, FaultUpstream("stable") as stable:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        text = ROLLOUT_CONFIG.format(stable=stable.base_url, cand=dead).replace("interval_s: 0}", "interval_s: 0.2}")
        for g in gateway_on(tmp_path_factory, "console-down", text, env=ENV):
            wait_until(lambda: not httpx.get(g.url + "/admin/config", headers=ADMIN, timeout=10)
                       .json()["backends"]["cand"]["available"])
            page = signed_in(browser, g.url)
            open_start_form(page, "dead-canary")
            page.get_by_role("button", name="Start rollout").click()
            status = page.get_by_role("status").filter(has_text="Start rollout dead-canary: done")
            status.wait_for()
            text = status.inner_text()
            assert "Warning: rollouts.dead-canary: its candidate 'cand' is on backend 'cand', found down now" in text
            assert "notice warn" == status.get_attribute("class")
            page.close()


def test_console_shows_a_failing_candidate_rolled_back(browser, rollout_gateway):
    g, cand = rollout_gateway
    cand.set_default({"status": 500})
    page = signed_in(browser, g.url)
    start_rollout(g, "bad-canary", hold_s=30)
    card = page.get_by_role("article", name="Rollout bad-canary")
    card.locator(".badge", has_text="rolled back").wait_for(timeout=60_000)
    r = rollout(g, "bad-canary")
    assert "error_rate_max" in r["reason"] and card.locator(".reason").inner_text() == r["reason"]
    card.locator(".rollout-weight", has_text=f"{r['weight']:g} %").wait_for()
    assert weights_of(g)["cand"] == r["weight"]           # the route's live weight is the rollout's
    assert card.locator(".ladder li.current").count() == (r["weight"] in r["steps"])
    # the actions the server allows a rolled-back rollout, from its own list (the page had its own table, which
    # left Resume and Abort disabled: a trial could not try again or end it from the page)
    assert set(r["actions"]) == {"resume", "promote", "abort"}
    for name in ("Resume", "Promote", "Abort"):
        assert card.get_by_role("button", name=name).is_enabled()
    assert card.get_by_role("button", name="Pause").is_disabled()
    shoot(page, "rollout-rolled-back")
    page.close()


def test_the_console_keeps_showing_routes_while_redis_is_unreachable(browser, redis_server, tmp_path_factory):
    # rollouts live in Redis and answer 503 meanwhile; the page read them with everything else in one go, so a
    # trial's console went blank (routes, health, tenants) and then froze for the whole outage
    a = FaultInjectorUpstream("a").start()
    text = upstream_config({"a": a}, "  main:\n    targets: [{backend: a}]\n",
                           extra=f"state: {{redis_url: '{redis_server.url}', socket_timeout_s: 0.5}}\n")
    try:
        for g in gateway_on(tmp_path_factory, "console-redis", text, env=ENV):
            page = signed_in(browser, g.url)
            table = page.get_by_role("table", name="Targets of route main")
            table.wait_for()
            redis_server.stop()
            wait_until(lambda: httpx.get(g.url + "/admin/rollouts", headers=ADMIN, timeout=10).status_code == 503)
            page.get_by_text("Rollouts cannot be read now").wait_for(timeout=30_000)
            assert table.is_visible() and page.locator("#live").inner_text() == "live"   # the rest still renders
            # the usage is this replica's in-process counts meanwhile, and says so (a trial read $0 without a word)
            usage = httpx.get(g.url + "/admin/usage", headers=ADMIN, timeout=10).json()
            assert usage["partial"].startswith("Redis is unreachable"), usage
            page.locator("#usage-span", has_text="partial: Redis is unreachable").wait_for(timeout=30_000)
            before = page.locator("#updated").inner_text()
            wait_until(lambda: page.locator("#updated").inner_text() != before)   # and keeps being read
            page.close()
    finally:
        a.stop()


def test_the_header_says_when_no_route_can_serve(browser, tmp_path_factory):
    # /health/ready said degraded while the console's header stayed a green "live" and nothing else said so
    a = FaultInjectorUpstream("a").start()
    path = tmp_path_factory.mktemp("console-degraded") / "config.yaml"
    path.write_text(upstream_config({"a": a}, "  main:\n    targets: [{backend: a}]\n", key_env="A_KEY_UNSET"))
    g = GatewayProcess(path, env=ENV).start(wait_ready=False)     # never ready: its one backend has no key
    try:
        wait_until(lambda: httpx.get(g.url + "/health/ready", timeout=10).json()["status"] == "degraded")
        page = signed_in(browser, g.url)
        page.locator("#version", has_text="degraded: no route can serve").wait_for()
        page.close()
    finally:
        g.stop()
        a.stop()
