"""``make demo`` (loadtests/demo.py) and the example config's canary: the canary arm of ``config.example.yaml``
needs no key (a second local engine, float32), and the demo's config is the example's with that arm on the
demo's engine and the embedded Redis. The walk itself runs in ``make demo`` (two engines: too long here)."""

from __future__ import annotations

from pathlib import Path

from gateway.config.compile import load_config_text
from loadtests.demo import CANARY, ROUTE, STABLE, demo_config

EXAMPLE = (Path(__file__).resolve().parent.parent / "config.example.yaml").read_text()


def test_the_example_canary_arm_needs_no_key():
    compiled = load_config_text(EXAMPLE, environ={})       # no key of any kind set
    route = compiled.config.routes[ROUTE]
    assert {t.id or t.backend: t.weight for t in route.targets} == {STABLE: 95, CANARY: 5}
    arm = compiled.config.backends[CANARY]
    assert arm.type == "openai" and arm.api_key_env is None and arm.base_url.startswith("http://127.0.0.1:")
    assert not any(CANARY in w for w in compiled.warnings)   # nothing unset: only the aggregators' keys warn


def test_the_demo_config_points_the_arm_at_its_engine_with_the_embedded_redis(tmp_path):
    cfg = load_config_text(demo_config(EXAMPLE, 45678, tmp_path / "data"), environ={}).config
    assert cfg.backends[CANARY].base_url == "http://127.0.0.1:45678/v1"
    assert cfg.state.redis == "embedded" and cfg.state.data_dir == str(tmp_path / "data")
