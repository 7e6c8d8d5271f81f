"""Route weights mean what an operator reads (gateway/config/weights.py): every form the schema accepts gives the
documented split, pinned on the compiled policy's picks over many canary keys, and the ambiguous form (some
targets weighted, others not) is refused at load naming the target."""

from __future__ import annotations

import pytest

from gateway.config.compile import load_config_text
from gateway.config.schema import ConfigError
from policies import RequestFeatures, Signals, decide

BASE = """
reload: {{watch: false}}
models: [{{name: m}}]
backends:
  a: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}
  b: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}
  c: {{type: openai, base_url: 'http://127.0.0.1:9/v1'}}
routes:
  r: {{targets: {targets}}}
policy: {{default_route: r}}
"""


def split(targets: str, n: int = 4000) -> dict[str, float]:
    """The share of ``n`` canary keys each target gets first, as the compiled policy picks."""
    policy = load_config_text(BASE.format(targets=targets)).policy
    counts: dict[str, int] = {}
    for i in range(n):
        f = RequestFeatures(model="m", user=f"user-{i}", request_id=f"r{i}")
        pick = decide(policy, f, Signals()).attempts[0].id
        counts[pick] = counts.get(pick, 0) + 1
    return {k: v / n for k, v in counts.items()}


@pytest.mark.parametrize("targets,shares", [
    ("[{backend: a}]", {"a": 1.0}),
    ("[{backend: a}, {backend: b}]", {"a": 0.5, "b": 0.5}),                       # no weights: equal
    ("[{backend: a, weight: 95}, {backend: b, weight: 5}]", {"a": 0.95, "b": 0.05}),
    ("[{backend: a, weight: 1}, {backend: b, weight: 3}]", {"a": 0.25, "b": 0.75}),   # relative
    ("[{backend: a, weight: 100}, {backend: b, weight: 0}, {backend: c, weight: 0}]", {"a": 1.0}),
])
def test_every_accepted_form_gives_its_documented_split(targets, shares):
    got = split(targets)
    assert set(got) == set(shares)
    for k, share in shares.items():
        assert got[k] == pytest.approx(share, abs=0.03), got


def test_some_targets_weighted_and_others_not_is_refused_naming_the_target():
    with pytest.raises(ConfigError) as exc:
        load_config_text(BASE.format(targets="[{backend: a, weight: 5}, {backend: b}, {backend: c, weight: 5}]"))
    path, problem = exc.value.errors[0]
    assert path == "routes.r.targets[1].weight" and "'b'" in problem
