"""What each target of a route actually gets now (issue 47, item 4's console part): the configured share beside the
effective one after unavailable backends and open breakers, as ``GET /admin/config`` reports it to the console's
route cards. A backend without its key got "50 %" and a closed breaker on the card; it gets 0 % and says why."""

from __future__ import annotations

from gateway.config.compile import load_config_text
from gateway.config.status import describe
from gateway.runtime import Gateway

TEXT = """reload: {watch: false}
resilience:
  health: {interval_s: 0}
models:
  - name: m1
backends:
  keyed:
    type: openai
    base_url: http://127.0.0.1:9/v1
  keyless:
    type: openai
    base_url: http://127.0.0.1:9/v1
    api_key_env: TANDEM_TEST_UNSET_KEY_47
  third:
    type: openai
    base_url: http://127.0.0.1:9/v1
routes:
  main:
    targets: [{backend: keyed, weight: 50}, {backend: keyless, weight: 50}]
  three:
    targets: [{backend: keyed, weight: 60}, {backend: keyless, weight: 20}, {backend: third, weight: 20}]
  promoted:
    targets: [{backend: keyed, weight: 0}, {backend: keyless, weight: 100}, {backend: third, weight: 0}]
policy:
  default_route: main
"""


async def test_an_unavailable_backends_share_goes_to_the_routes_other_targets(monkeypatch):
    monkeypatch.delenv("TANDEM_TEST_UNSET_KEY_47", raising=False)
    gw = Gateway(None, load_config_text(TEXT), start_engine=False)
    await gw.start()
    try:
        routes = (await describe(gw))["routes"]
    finally:
        await gw.stop()
    main = {t["id"]: t for t in routes["main"]["targets"]}
    assert main["keyless"]["share_pct"] == 50 and main["keyless"]["effective_pct"] == 0
    assert main["keyless"]["out"] == "backend unavailable: environment variable TANDEM_TEST_UNSET_KEY_47 is unset"
    assert main["keyed"]["effective_pct"] == 100 and main["keyed"]["out"] == ""
    three = {t["id"]: t["effective_pct"] for t in routes["three"]["targets"]}
    assert three == {"keyed": 75.0, "keyless": 0.0, "third": 25.0}
    # every weighted target out: requests go to the first target of weight 0 (before any fallback), not nowhere
    promoted = {t["id"]: (t["effective_pct"], t["out"]) for t in routes["promoted"]["targets"]}
    assert promoted == {"keyed": (100.0, ""), "keyless": (0.0, main["keyless"]["out"]), "third": (0.0, "weight 0")}
