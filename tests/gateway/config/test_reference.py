"""The configuration reference cannot rot (gateway/config/reference.py): the docs page is what the schema
generates, ``config.example.yaml`` shows every key of the schema and no key the schema lacks, and every config
key path the README and the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config.reference import EXAMPLE, example_keys, markdown, resolve, schema_tree, walk

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "operators" / "configuration.md"
TOPS = "server|admin|reload|state|auth|limits|resilience|observability|budgets|models|backends|routes|policy|rollouts"


def test_the_configuration_page_is_generated_from_the_schema():
    assert PAGE.read_text() == markdown(), "run `make docs` (python -m gateway.config.reference) and commit the page"


def _gaps(text: str | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    keys = example_keys(text)
    unknown = [(k.path, k.line) for k in keys if k.node is None]
    shown = {(k.node.owner, k.node.name) for k in keys if k.node is not None}
    missing = sorted(f"{n.owner}.{n.name} ({path})" for path, n in walk(schema_tree())
                     if (n.owner, n.name) not in shown)
    return unknown, missing


def test_the_example_shows_every_schema_key_and_no_other():
    unknown, missing = _gaps()
    assert unknown == [], f"config.example.yaml shows keys the schema does not have: {unknown}"
    assert missing == [], f"schema keys config.example.yaml does not show: {missing}"


def test_a_key_outside_the_schema_or_one_left_out_is_caught():
    """The check can fail both ways: a commented-out key the schema lacks, and a key removed from the example."""
    text = EXAMPLE.read_text()
    doctored = text.replace("  # resume_attempts: 2", "  # resume_attempt: 2")
    assert doctored != text
    unknown, missing = _gaps(doctored)
    assert [p for p, _ in unknown] == ["routes.<name>.resume_attempt"]
    assert missing == ["RouteConfig.resume_attempts (routes.<name>.resume_attempts)"]


def test_a_comment_wrapped_under_its_hash_is_the_keys_whole_comment():
    """A key's comment goes on, aligned under its ``#``, in force and in a commented-out block (a docs trial read
    "off | exact (local engine: greedy or seeded answers, keyed by the engine's" and nothing of ``best_effort``);
    a commented-out key or a comment at another column starts anew."""
    text = ("routes:\n  r:\n    select: weighted   # weighted |\n                       # cheapest\n"
            "    # cache:            # off by default\n    #   mode: exact     # off | exact\n"
            "    #                   # | best_effort\n    #   ttl_s: 60       # an entry expires\n"
            "    # a note of its own\n")
    comments = {k.path: k.comment for k in example_keys(text)}
    assert comments["routes.<name>.select"] == "weighted | cheapest"
    assert comments["routes.<name>.cache"] == "off by default"
    assert comments["routes.<name>.cache.mode"] == "off | exact | best_effort"
    assert comments["routes.<name>.cache.ttl_s"] == "an entry expires"
    page = PAGE.read_text()
    assert "prefix_affinity (engine replicas by prefix-cache affinity and load, below)" in page
    assert "| best_effort (any backend) |" in page
    assert not re.findall(r"\w {2,}\w", page), "a docstring's indentation in a cell"


def _named_paths() -> list[tuple[str, str]]:
    """Config key paths in backticks in the README, ARCHITECTURE.md and docs/ (`state.redis_url`,
    `routes.<name>.shadow: {...}`), with the file naming each."""
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pattern = re.compile(rf"`((?:{TOPS})(?:\.[\w<>-]+|\[\])+)(?=[`:= ])")
    out = []
    for f in files:
        if f == PAGE:
            continue
        for path in pattern.findall(f.read_text()):
            if not path.endswith((".py", ".md", ".yaml", ".json")):
                out.append((path, str(f.relative_to(ROOT))))
    return out


def test_every_config_key_the_docs_name_exists():
    named = _named_paths()
    assert len(named) > 20                          # the docs do name keys: the scan finds them
    tree = schema_tree()
    assert resolve(tree, "state.no_such_key") is None and resolve(tree, "backends.local.engine.dtype") is not None
    wrong = sorted({(p, f) for p, f in named if resolve(tree, p) is None})
    assert wrong == [], f"key paths the docs name that the schema does not have: {wrong}"


def test_a_key_of_several_backend_types_is_told_per_type():
    """A docs trial: ``backends.<name>.type`` read ``Literal['local']``, "the engine in this process", and
    ``base_url`` "required", "POST base_url/messages", for every type: the first type's row stood for all."""
    rows = {line.split("|")[1].strip(" `"): line for line in markdown().splitlines() if line.startswith("| `")}
    assert "`Literal['local', 'openai', 'anthropic']`" in rows["backends.<name>.type"]
    assert "required (openai); https://api.anthropic.com/v1 (anthropic)" in rows["backends.<name>.base_url"]
    assert "(local);" in rows["backends.<name>.rpm"] and "(openai, anthropic)" in rows["backends.<name>.rpm"]
    assert "(read at start" in rows["state.redis_url"] and "(read at start" not in rows["state.fail_closed_limits"]


def test_an_unknown_key_is_told_the_key_it_is_closest_to_or_what_its_place_takes():
    """An ops trial's ``resilience.retry.max_attemps`` read "Extra inputs are not permitted": nothing to act on."""
    import pytest

    from gateway.config.compile import load_config_text
    from gateway.config.schema import ConfigError

    text = ("resilience:\n  retry: {max_attemps: 3}\nmodels: [{name: m, bogus: 1}]\n"
            "backends:\n  a: {type: openai, base_url: 'http://x/v1', api_kye_env: K}\n"
            "routes: {r: {targets: [{backend: a}]}}\npolicy: {default_route: r}\nserverr: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    problems = dict(e.value.errors)
    assert problems["resilience.retry.max_attemps"] == "unknown key: did you mean 'max_attempts'?"
    assert problems["backends.a.api_kye_env"] == "unknown key: did you mean 'api_key_env'?"
    assert problems["serverr"] == "unknown key: did you mean 'server'?"
    assert problems["models[0].bogus"] == "unknown key; models[] takes name, aliases, cache, default_max_tokens"
