"""Policy unit tests: each match kind, rule order, canary split and
stickiness, explanations, and config validation naming key paths."""

from __future__ import annotations

import pytest

from gateway.config.compile import load_config_text
from gateway.config.schema import ConfigError
from policies import (Condition, Match, Policy, RequestFeatures, Route, Rule, Signals, Target, decide, hash_unit,
                      parse_priority, pick_target, with_weights)
from policies.rules import evaluate

ROUTES = {
    "local": Route("local", (Target("local"),), (Target("agg"),)),
    "agg": Route("agg", (Target("agg"),), (Target("local"),)),
}


def policy(*rules: Rule) -> Policy:
    return Policy(tuple(rules), ROUTES, "local")


def cond(field, op, value) -> Match:
    return Match((Condition(field, op, value),))


def route_of(p: Policy, f: RequestFeatures, s: Signals | None = None) -> str:
    return decide(p, f, s or Signals()).route


@pytest.mark.parametrize("field,op,value,features,signals,expected", [
    ("model", "eq", "m1", dict(model="m1"), {}, True),
    ("model", "eq", "m1", dict(model="m2"), {}, False),
    ("model", "in", ["m2", "m3"], dict(model="m3"), {}, True),
    ("priority", "eq", "low", dict(priority=1), {}, True),
    ("priority", "eq", "high", dict(priority=0), {}, False),
    ("priority", "gte", "low", dict(priority=5), {}, True),
    ("priority", "lt", 0, dict(priority=-1), {}, True),
    ("priority", "in", ["high", "normal"], dict(priority=1), {}, False),
    ("prompt_tokens", "gt", 100, dict(prompt_tokens=101), {}, True),
    ("prompt_tokens", "gt", 100, dict(prompt_tokens=100), {}, False),
    ("prompt_tokens", "gte", 100, dict(prompt_tokens=100), {}, True),
    ("prompt_tokens", "lte", 100, dict(prompt_tokens=None), {}, False),
    ("tenant", "eq", "search", dict(tenant="search"), {}, True),
    ("tenant", "in", ["a", "b"], dict(tenant="c"), {}, False),
    ("tools", "eq", True, dict(has_tools=True), {}, True),
    ("tools", "eq", True, dict(has_tools=False), {}, False),
    ("response_format", "eq", True, dict(has_response_format=True), {}, True),
    ("local.serves", "eq", False, dict(local_serves=False), {}, True),
    ("local.serves", "eq", False, dict(local_serves=True), {}, False),
    ("local.waiting", "gt", 32, {}, dict(local_waiting=33), True),
    ("local.waiting", "gt", 32, {}, dict(local_waiting=32), False),
    ("local.running", "gte", 8, {}, dict(local_running=8), True),
    ("local.kv_usage", "gte", 90, {}, dict(local_kv_usage=89.9), False),
    ("local.kv_usage", "lt", 90, {}, dict(local_kv_usage=10.0), True),
    ("header.x-batch", "eq", "true", dict(headers={"x-batch": "true"}), {}, True),
    ("header.x-batch", "eq", True, dict(headers={"x-batch": "TRUE"}), {}, True),
    ("header.x-batch", "eq", "true", dict(headers={}), {}, False),
    ("header.x-team", "exists", True, dict(headers={"x-team": "a"}), {}, True),
    ("metadata.job", "eq", "nightly", dict(metadata={"job": "nightly"}), {}, True),
    ("metadata.size", "gt", 10, dict(metadata={"size": "11"}), {}, True),
    ("metadata.size", "gt", 10, dict(metadata={"size": "big"}), {}, False),
    ("stream", "eq", True, dict(stream=True), {}, True),
    ("max_tokens", "lte", 16, dict(max_tokens=8), {}, True),
    ("user", "ne", "bob", dict(user="alice"), {}, True),
    # a policy trial: user exists held for every request (an absent user is ""), and "anonymous" never matched
    ("user", "exists", True, dict(user=""), {}, False),
    ("user", "exists", False, dict(), {}, True),
    ("user", "exists", True, dict(user="u-12"), {}, True),
    ("tenant", "eq", "anonymous", dict(tenant=""), {}, True),
])
def test_each_match_kind(field, op, value, features, signals, expected):
    f = RequestFeatures(**{"model": "m1", **features})
    ok, _ = evaluate(Condition(field, op, value), f, Signals(**signals))
    assert ok is expected
    p = policy(Rule("r", "agg", cond(field, op, value)))
    assert route_of(p, f, Signals(**signals)) == ("agg" if expected else "local")


def test_rule_order_first_match_wins():
    p = policy(Rule("first", "agg", cond("priority", "eq", "low")),
               Rule("second", "local", cond("priority", "gte", 0)))
    d = decide(p, RequestFeatures("m1", priority=1), Signals())
    assert (d.rule, d.route) == ("first", "agg")
    d = decide(p, RequestFeatures("m1", priority=0), Signals())
    assert (d.rule, d.route) == ("second", "local")
    d = decide(p, RequestFeatures("m1", priority=-1), Signals())
    assert (d.rule, d.route) == ("default", "local")


def test_all_and_any_groups():
    m = Match((Condition("model", "eq", "m1"),),
              ((Match((Condition("priority", "eq", "low"),)), Match((Condition("header.x-batch", "eq", "1"),))),))
    p = policy(Rule("batch", "agg", m))
    assert route_of(p, RequestFeatures("m1", priority=1)) == "agg"
    assert route_of(p, RequestFeatures("m1", headers={"x-batch": "1"})) == "agg"
    assert route_of(p, RequestFeatures("m1")) == "local"
    assert route_of(p, RequestFeatures("m2", priority=1)) == "local"


def test_priority_parsing():
    assert [parse_priority(v) for v in ("high", "normal", "LOW", 7, "-3")] == [-1, 0, 1, 7, -3]
    for bad in ("urgent", 1.5, True, None):
        with pytest.raises(ValueError, match="priority"):
            parse_priority(bad)


def canary_route(pct: float) -> Route:
    return Route("r", (Target("local", weight=100 - pct), Target("agg", weight=pct)))


@pytest.mark.parametrize("pct", [5, 25, 100])
def test_canary_split_over_10000_users(pct):
    route = canary_route(pct)
    hits = sum(pick_target(route, f"user:{i}", {}).target.backend == "agg" for i in range(10_000))
    assert abs(hits / 100 - pct) <= 1.0


def test_canary_is_sticky_and_only_moves_users_forward():
    users = [f"user:{i}" for i in range(10_000)]
    prev_on_canary: set[str] = set()
    for pct in (5, 25, 60, 100):
        route = canary_route(pct)
        on = {u for u in users if pick_target(route, u, {}).target.backend == "agg"}
        assert prev_on_canary <= on          # nobody moves back when the weight grows
        again = {u for u in users if pick_target(route, u, {}).target.backend == "agg"}
        assert on == again                   # same weights: same arm, every time
        prev_on_canary = on
    assert len(prev_on_canary) == 10_000


def test_three_arm_growth_moves_users_only_to_grown_arm():
    users = [f"u{i}" for i in range(3000)]
    before = Route("r", (Target("a", weight=80), Target("b", weight=10), Target("c", weight=10)))
    after = with_weights(before, {"c": 30})     # others keep their weights
    for u in users:
        x, y = pick_target(before, u, {}).target.id, pick_target(after, u, {}).target.id
        assert x == y or y == "c"


def test_canary_key_user_header_and_request_id():
    routes = {"r": canary_route(50)}
    f_user = RequestFeatures("m1", user="alice", request_id="req-1")
    assert decide(Policy((), routes, "r", "user"), f_user, Signals()).canary_key == "user:alice"
    f_hdr = RequestFeatures("m1", headers={"x-session": "s9"}, request_id="req-1")
    assert decide(Policy((), routes, "r", "header:x-session"), f_hdr, Signals()).canary_key == "header:s9"
    assert decide(Policy((), routes, "r", "user"), RequestFeatures("m1", request_id="q"), Signals()).canary_key \
        == "request:q"


def test_hash_unit_is_uniform_and_stable():
    xs = [hash_unit(f"k{i}", "t") for i in range(20_000)]
    assert all(0 < x < 1 for x in xs)
    assert abs(sum(xs) / len(xs) - 0.5) < 0.01
    assert hash_unit("k1", "t") == hash_unit("k1", "t") != hash_unit("k1", "u")


def test_unavailable_targets_are_skipped_and_explained():
    route = Route("r", (Target("local", weight=95), Target("agg", weight=5)),
                  (Target("agg"), Target("other"), Target("local")))
    p = Policy((), {"r": route}, "r")
    d = decide(p, RequestFeatures("m1", user="u"), Signals(unavailable={"agg": "key unset"}), explain=True)
    assert [t.id for t in d.attempts] == ["local", "other"]
    assert d.pick.skipped["agg"] == "key unset"
    text = d.explain()
    assert "skipped agg: key unset" in text and "attempts: local -> other" in text
    d = decide(p, RequestFeatures("m1"), Signals(unavailable={"agg": "x", "local": "y", "other": "z"}))
    assert d.attempts == [] and d.pick.target is None


def test_cheapest_select():
    route = Route("c", (Target("a", input_price=1, output_price=2), Target("b", input_price=0.1, output_price=0.2),
                        Target("c", input_price=0.5, output_price=0.5)), select="cheapest")
    assert pick_target(route, "k", {}).target.id == "b"
    assert pick_target(route, "k", {"b": "down"}).target.id == "c"


def test_explain_names_rule_weights_and_choice():
    p = Policy((Rule("long", "agg", cond("prompt_tokens", "gt", 10)),), {"agg": ROUTES["agg"], "r": canary_route(5)},
               "r")
    d = decide(p, RequestFeatures("m1", prompt_tokens=3, user="bob"), Signals(), explain=True)
    text = d.explain()
    assert "long: no [prompt_tokens gt 10: no (actual 3)]" in text
    assert "matched rule: default -> route r" in text and "weight" in text
    assert d.to_dict()["chosen"] in ("local", "agg")


def test_with_weights_rejects_unknown_target():
    with pytest.raises(ValueError, match="no target 'nope'"):
        with_weights(canary_route(5), {"nope": 3})


def test_bad_condition_and_route_definitions():
    with pytest.raises(ValueError, match="unknown match field"):
        Condition("colour", "eq", 1)
    with pytest.raises(ValueError, match="unknown operator"):
        Condition("model", "like", "x")
    with pytest.raises(ValueError, match="needs a list"):
        Condition("model", "in", "x")
    with pytest.raises(ValueError, match="needs a number"):
        Condition("prompt_tokens", "gt", "many")
    with pytest.raises(ValueError, match="at least one target"):
        Route("r", ())
    with pytest.raises(ValueError, match="unknown route"):
        Policy((Rule("x", "nope"),), ROUTES, "local")


BASE = """
models: [{name: m1, aliases: [a1]}]
backends:
  local: {type: local}
  up: {type: openai, base_url: "http://127.0.0.1:1/v1", api_key_env: UP_KEY, prices: {input: 1, output: 2}}
routes:
  main: {targets: [{backend: local, weight: 90}, {backend: up, weight: 10}], fallbacks: [{backend: up}]}
policy:
  default_route: main
  rules:
    - {name: low, match: {priority: low}, route: main}
"""


def test_config_compiles_to_policy():
    c = load_config_text(BASE, environ={})
    assert c.model_names == {"m1": "m1", "a1": "m1"}
    # a rule naming an alias matches the model's requests (a request's model is its public name)
    aliased = load_config_text(BASE.replace("match: {priority: low}", "match: {model: a1}"), environ={})
    assert decide(aliased.policy, RequestFeatures(model="m1"), Signals()).rule == "low"
    assert aliased.policy.rules[0].match.all[0].value == "m1"
    route = c.policy.routes["main"]
    assert [t.weight for t in route.targets] == [90, 10]
    assert route.targets[1].input_price == 1 and route.targets[1].output_price == 2
    c2 = load_config_text(BASE, overrides={"main": {"up": 50}}, environ={})
    assert [t.weight for t in c2.policy.routes["main"].targets] == [90, 50]


@pytest.mark.parametrize("old,new,path", [
    ("base_url: \"http://127.0.0.1:1/v1\"", "base_url: \"ftp://x\"", "backends.up.base_url"),
    ("{backend: up, weight: 10}", "{backend: nowhere, weight: 10}", "routes.main.targets[1].backend"),
    ("{backend: up, weight: 10}", "{backend: up, weight: -1}", "routes.main.targets[1].weight"),
    ("match: {priority: low}", "match: {priority: {gtx: 1}}", "policy.rules[0].match.priority"),
    ("match: {priority: low}", "match: {colour: red}", "policy.rules[0].match.colour"),
    ("match: {priority: low}", "match: {priority: urgent}", "policy.rules[0].match.priority"),
    ("route: main}", "route: nope}", "policy.rules[0].route"),
    ("default_route: main", "default_route: nope", "policy.default_route"),
    ("local: {type: local}", "local: {type: local, engine: {dtype: 3}}", "backends.local.engine.dtype"),
    ("local: {type: local}", "local: {type: local, engine: {dtype: float8}}", "backends.local.engine.dtype"),
    ("local: {type: local}", "local: {type: local, engine: {block_size: 24}}", "backends.local.engine.block_size"),
    ("local: {type: local}", "local: {type: lokal}", "backends.local"),
    ("models: [{name: m1, aliases: [a1]}]", "models: [{name: m1, alias: [a1]}]", "models[0].alias"),
    ("main: {targets:", "main: {select: prefix_affinity, targets:", "routes.main.targets[0].backend"),
    ("weight: 90}, {backend: up, weight: 10}", "weight: 0}, {backend: up, weight: 0}", "routes.main.targets"),
    # a policy trial's mistakes that loaded and matched every request, or none
    ("match: {priority: low}", "match: {tenant: {}}", "policy.rules[0].match.tenant"),
    ("match: {priority: low}", "match: {user: {exists: 'no'}}", "policy.rules[0].match.user.exists"),
    ("match: {priority: low}", "match: {any: [{model: gpt-4o}, {priority: low}]}", "policy.rules[0].match.any.model"),
    ("- {name: low, match: {priority: low}, route: main}",
     "- {name: low, match: {priority: low}, route: main}\n    - {name: low, match: {stream: true}, route: main}",
     "policy.rules[1].name"),
    ("- {name: low, match: {priority: low}, route: main}",
     "- {name: all, match: {}, route: main}\n    - {name: low, match: {priority: low}, route: main}",
     "policy.rules[1]"),
])
def test_config_errors_name_the_key_path(old, new, path):
    assert old in BASE
    with pytest.raises(ConfigError) as e:
        load_config_text(BASE.replace(old, new), environ={})
    assert any(p == path for p, _ in e.value.errors), e.value.errors
    assert path in str(e.value)


def test_example_config_is_valid_and_routes_as_documented():
    from pathlib import Path

    c = load_config_text((Path(__file__).parents[2] / "config.example.yaml").read_text(), environ={})
    p = c.policy
    up = Signals(unavailable={})
    assert decide(p, RequestFeatures("smollm2", priority=1), up).route == "cheapest"
    assert decide(p, RequestFeatures("smollm2", priority=1), up).attempts[0].backend == "deepseek"
    assert decide(p, RequestFeatures("smollm2", headers={"x-tandem-batch": "true"}), up).route == "cheapest"
    assert decide(p, RequestFeatures("smollm2", prompt_tokens=5000), up).route == "aggregator"
    assert decide(p, RequestFeatures("smollm2", prompt_tokens=10), Signals(local_waiting=50)).route == "aggregator"
    assert decide(p, RequestFeatures("smollm2", prompt_tokens=10), Signals(local_kv_usage=95)).route == "aggregator"
    # Tools stay local while the local engine serves them; a field it does not serve goes upstream.
    tools = decide(p, RequestFeatures("smollm2", prompt_tokens=10, has_tools=True, user="u1"), up)
    assert tools.route == "local-first" and [t.backend for t in tools.attempts][-2:] == ["deepseek", "holysheep"]
    assert decide(p, RequestFeatures("smollm2", has_tools=True, local_serves=False), up).route == "aggregator"
    d = decide(p, RequestFeatures("smollm2", prompt_tokens=10), up)
    assert d.route == "local-first"
    canary = sum(decide(p, RequestFeatures("smollm2", prompt_tokens=10, user=f"u{i}"), up).attempts[0].backend
                 == "local-f32" for i in range(4000))
    assert 0.035 < canary / 4000 < 0.065
    # With the aggregators' keys unset, everything lands on the local engine.
    down = Signals(unavailable={"deepseek": "unset", "holysheep": "unset"})
    assert [t.backend for t in decide(p, RequestFeatures("smollm2", priority=1), down).attempts] == ["local"]


def test_policies_are_pure():
    """policies/ imports only the standard library and itself: no I/O layers."""
    import ast
    import sys
    from pathlib import Path

    allowed = set(sys.stdlib_module_names) | {"policies", "__future__"}
    for path in (Path(__file__).parents[2] / "policies").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
            for name in names:
                assert name.split(".")[0] not in ("socket", "asyncio", "http", "urllib", "os"), \
                    f"{path.name} imports {name}"


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read it"),
    ("{not json", "not valid JSON: "),
    ("[1, 2]", "must hold one JSON object"),
])
def test_route_explain_names_a_bad_request_file(tmp_path, content, expected):
    """`tandem route explain` on a missing or malformed --request file: one clear line, exit 2, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    request = tmp_path / "req.json"
    if content is not None:
        request.write_text(content)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "route", "explain", "--config",
                          str(root / "config.example.yaml"), "--request", str(request)],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and str(request) in out.stderr
    assert "Traceback" not in out.stderr


def test_route_explain_says_when_given_predictions_have_no_slo_to_meet(tmp_path):
    """`--ttft` with a config that has no `slo:` (the example's SLO route is commented out) changed nothing and
    said nothing (found by a new user); it says so now, on stderr (stdout stays the decision)."""
    import subprocess
    import sys
    from pathlib import Path

    request = tmp_path / "req.json"
    request.write_text('{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}')
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "route", "explain", "--config",
                          str(root / "config.example.yaml"), "--request", str(request), "--ttft", "local=2.4"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "--ttft is read by routes and rules with `slo:` only" in out.stderr
    assert "matched rule:" in out.stdout


def test_route_targets_fail_over_to_each_other_by_rank():
    """The pick first, then the route's other live targets (weight > 0) by rank, then its targets of weight 0
    (no share, but the failover before any fallback), then the fallbacks; an unavailable one is skipped."""
    route = Route("r", (Target("a", weight=200), Target("b", weight=1), Target("z", weight=0)), (Target("f"),))
    d = decide(Policy((), {"r": route}, "r"), RequestFeatures("m1", user="u"), Signals())
    assert [t.id for t in d.attempts][1:] in (["b", "z", "f"], ["a", "z", "f"]) and len(d.attempts) == 4
    down = decide(Policy((), {"r": route}, "r"), RequestFeatures("m1", user="u"), Signals(unavailable={"a": "k"}))
    assert [t.id for t in down.attempts] == ["b", "z", "f"]
    promoted = Route("p", (Target("z", weight=0), Target("a", weight=100)), (Target("f"), Target("z")))
    d = decide(Policy((), {"p": promoted}, "p"), RequestFeatures("m1"), Signals(unavailable={"a": "k"}))
    assert d.pick.target is None and [t.id for t in d.attempts] == ["z", "f"]   # z once, before the fallback
    assert "chosen: no target (no available target with weight > 0); z serves it" in d.explain()
    cheap = Route("c", (Target("x", input_price=3), Target("y", input_price=1), Target("w", input_price=2)),
                  select="cheapest")
    assert [t.id for t in decide(Policy((), {"c": cheap}, "c"), RequestFeatures("m1"), Signals()).attempts] == \
        ["y", "w", "x"]


EXPLAINED = BASE.replace("routes:\n", "auth: {keys: [{tenant: gold, sha256: %s}]}\nroutes:\n" % (
    __import__("hashlib").sha256(b"sk-gold").hexdigest())).replace(
    "    - {name: low, match: {priority: low}, route: main}",
    "    - {name: gold, match: {tenant: gold}, route: main}\n"
    "    - {name: identified, match: {user: {exists: true}}, route: main}\n"
    "    - {name: long, match: {prompt_tokens: {gt: 100}}, route: main}")


@pytest.mark.parametrize("endpoint, body, args, rule", [
    # a policy trial: embeddings and Responses bodies were refused ("missing required parameter 'prompt'"),
    # a Messages body explained as chat (its metadata.user_id unread), the key in --header unread
    (None, {"model": "m1", "input": "x" * 800}, [], "long"),
    ("responses", {"model": "m1", "input": "x" * 800}, [], "long"),
    ("messages", {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                  "metadata": {"user_id": "u-12"}}, [], "identified"),
    (None, {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}, ["--header", "authorization=Bearer sk-gold"],
     "gold"),
    (None, {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}, [], "default"),
])
def test_route_explain_reads_each_endpoints_body_as_the_gateway_routes_it(tmp_path, capsys, endpoint, body, args,
                                                                          rule):
    import json

    from gateway.cli import main

    (tmp_path / "c.yaml").write_text(EXPLAINED)
    (tmp_path / "req.json").write_text(json.dumps(body))
    argv = ["route", "explain", "--config", str(tmp_path / "c.yaml"), "--request", str(tmp_path / "req.json"),
            "--json", *args] + (["--endpoint", endpoint] if endpoint else [])
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["rule"] == rule
