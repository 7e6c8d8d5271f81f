"""The local backend's ``engine:`` block takes what ``tandem engine serve`` takes for a deployment (a trial:
``speculative_config`` was "Extra inputs are not permitted" while ``tensor_parallel_size`` and ``quantization``
were there), checked by the engine's own rules at load, a bad value named by its key."""

from __future__ import annotations

import pytest

from gateway.config.compile import load_config_text
from gateway.config.schema import ConfigError

BASE = ("{{reload: {{watch: false}}, models: [{{name: m}}], policy: {{default_route: r}}, "
        "backends: {{local: {{type: local, engine: {{speculative_config: {spec}}}}}}}, "
        "routes: {{r: {{targets: [{{backend: local}}]}}}}}}")


def test_speculative_config_reaches_the_engine_args():
    compiled = load_config_text(BASE.format(spec="{method: ngram, num_speculative_tokens: 3}"))
    kwargs = compiled.config.backends["local"].engine.engine_kwargs()
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("spec, words", [("{num_speculative_tokens: 0}", "must be an integer >= 1"),
                                         ("{frobnicate: 1}", "unknown key(s) frobnicate")])
def test_a_bad_speculative_config_is_refused_naming_it(spec, words):
    with pytest.raises(ConfigError) as e:
        load_config_text(BASE.format(spec=spec))
    assert [p for p, m in e.value.errors if words in m] == ["backends.local.engine.speculative_config"], \
        e.value.errors


def test_a_model_no_backend_knows_is_warned_of():
    """A CLI trial added ``- name: llama3`` to ``models:``: the default route's local engine answered it with
    SmolLM2 under that name, and the load said nothing. A model no rule routes, which the default route sends to
    a backend that does not know it, is warned of; the shipped example warns of none."""
    from pathlib import Path

    from gateway.config.compile import load_config_text

    example = (Path(__file__).parents[3] / "config.example.yaml").read_text()
    assert not [w for w in load_config_text(example).warnings if w.startswith("models[")]
    added = example.replace("  - name: smollm2\n", "  - name: llama3\n  - name: smollm2\n", 1)
    warned = [w for w in load_config_text(added).warnings if w.startswith("models[")]
    assert warned and all(w.startswith("models[0] (llama3): the default route") for w in warned), warned
    assert "the local engine serving 'smollm2'" in warned[0]
    rules = "  rules:                     # first match wins."
    ruled = added.replace(rules, "  rules:\n    - {name: llama, match: {model: llama3}, route: local-first}\n    #", 1)
    assert ruled != added           # a rule routing it: the operator chose, nothing is said
    assert not [w for w in load_config_text(ruled).warnings if w.startswith("models[")]
