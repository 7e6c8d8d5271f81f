"""A number in the config is a finite number: YAML's true / false (which pydantic would read as 1 and 0) and
.inf / .nan are refused at load, naming the key (gateway/config/strict.py's StrictModel)."""

from __future__ import annotations

import pytest

from gateway.config.compile import load_config_text
from gateway.config.schema import ConfigError

BASE = ("{{reload: {{watch: false}}, models: [{{name: m}}], policy: {{default_route: r}}, "
        "backends: {{a: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}, "
        "b: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}}}, "
        "routes: {{r: {{targets: [{{backend: a, weight: {weight}}}, {{backend: b, weight: 1}}], slo: {slo}}}}}}}")


def load(weight: str = "1", slo: str = "{ttft_ms: 1500}"):
    return load_config_text(BASE.format(weight=weight, slo=slo))


def test_finite_numbers_load_as_written():
    route = load(weight="2.5", slo="{ttft_ms: 1500.5, tpot_ms: 40}").policy.routes["r"]
    assert [(t.id, t.weight) for t in route.targets] == [("a", 2.5), ("b", 1.0)]
    assert (route.slo.ttft_ms, route.slo.tpot_ms) == (1500.5, 40.0)


@pytest.mark.parametrize("slo,key,words", [
    ("{ttft_ms: true}", "routes.r.slo", "ttft_ms: a number is needed, not true"),
    ("{ttft_ms: 1500, tpot_ms: false}", "routes.r.slo", "tpot_ms: a number is needed, not false"),
    ("{ttft_ms: .inf}", "routes.r.slo.ttft_ms", "finite"),
    ("{ttft_ms: .nan}", "routes.r.slo.ttft_ms", "finite"),
])
def test_a_boolean_or_infinite_slo_is_refused_naming_its_key(slo, key, words):
    with pytest.raises(ConfigError) as exc:
        load(slo=slo)
    path, problem = exc.value.errors[0]
    assert path == key and words in problem, exc.value.errors


def test_a_boolean_weight_is_refused():
    with pytest.raises(ConfigError) as exc:
        load(weight="true")
    path, problem = exc.value.errors[0]
    assert path == "routes.r.targets[0]" and "weight: a number is needed, not true" in problem, exc.value.errors


def test_a_cache_mode_written_off_loads_as_off():
    """``mode: off``, as the docs write it: PyYAML (YAML 1.1) reads a bare ``off`` as false, which was refused with
    "Input should be 'off', 'exact' or 'best_effort'" (a docs trial); ``true`` is still refused."""
    text = BASE.format(weight="1", slo="{ttft_ms: 1500}").replace("slo: {ttft_ms: 1500}", "cache: {mode: %s}")
    assert load_config_text(text % "off").config.routes["r"].cache.mode == "off"
    with pytest.raises(ConfigError) as exc:
        load_config_text(text % "on")
    assert exc.value.errors[0][0] == "routes.r.cache.mode", exc.value.errors
