"""Compilation of a validated config into what the hot path uses: a ``policies.Policy``, an alias table, hashed
virtual keys (``Compiled``). ``load_config_text(text)`` -> ``Compiled``; any problem raises ``ConfigError``
whose message lists ``key.path: problem`` lines (schema: ``gateway/config/schema.py``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from engine.config import EngineArgs
from gateway.config.backend_schema import EngineConfig
from gateway.config.schema import ConfigError, GatewayConfig, TargetConfig
from gateway.config.weights import check_weights
from gateway.observability.otlp import otlp_unavailable
from gateway.rollouts.spec import config_problems
from policies import Affinity, Condition, Match, Policy, Route, Rule, Slo, Target, check_field, with_weights
from policies.rules import OPERATORS


@dataclass
class Compiled:
    """A validated config ready for the hot path.

    Attributes:
        config: the pydantic tree.
        policy: the compiled policy (weights overrides applied).
        model_names: public name or alias -> canonical public name.
        key_hashes: sha256 hex of a virtual key -> tenant.
        warnings: non-fatal problems (unset key env vars, ...).
        text: the YAML source; overrides: route -> {target id: weight}.
    """

    config: GatewayConfig
    policy: Policy
    model_names: dict[str, str]
    key_hashes: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    text: str = ""
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def public_models(self) -> list[str]:
        return [m.name for m in self.config.models]

    @property
    def local_serves(self) -> frozenset[str]:
        """Structured features the local backend serves (empty without one)."""
        return frozenset(f for b in self.config.backends.values() if b.type == "local"
                         for f in b.structured_outputs)


def validation_problems(e: ValidationError) -> list[tuple[str, str]]:
    """(key path, problem) of each error of a pydantic validation, its message without pydantic's "Value error, "
    prefix (a validator's own sentence); an unknown key's says which keys its place takes (``unknown_key``)."""
    out = []
    for err in e.errors():
        path = _loc(err["loc"])
        out.append((path, unknown_key(path) if err["type"] == "extra_forbidden" else
                    err["msg"].removeprefix("Value error, ")))
    return out


def unknown_key(path: str) -> str:
    """The problem of the unknown key at ``path``: the key it is closest to ("did you mean"; ``difflib``'s ratio
    of at least 0.6), else the keys its place takes (an ops trial's ``max_attemps`` read "Extra inputs are not
    permitted", nothing to act on)."""
    import difflib

    from gateway.config.reference import resolve, schema_tree   # the schema's tree: built only on an error

    parent, _, key = re.sub(r"\[\d+\]", "[]", path).rpartition(".")
    node = resolve(schema_tree(), parent) if parent else schema_tree()
    known = list(node.children) if node is not None else []
    if not known:
        return "unknown key"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown key: did you mean '{close[0]}'?"
    return "unknown key; " + (f"{parent} takes " if parent else "the top level takes ") + ", ".join(known)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("local", "openai") and out.startswith("backends."):
            continue  # pydantic's discriminator tag, not a key
        else:
            out += ("." if out else "") + str(part)
    return out


def _parse_match(raw: Any, path: str, errors: list[tuple[str, str]]) -> Match:
    if not isinstance(raw, dict):
        errors.append((path, f"must be a mapping of field: value or field: {{op: value}}, got {raw!r}"))
        return Match()
    conds: list[Condition] = []
    groups: list[tuple[Match, ...]] = []
    for key, spec in raw.items():
        kpath = f"{path}.{key}"
        if key == "any":
            if not isinstance(spec, list) or not spec:
                errors.append((kpath, "must be a non-empty list of matches"))
                continue
            groups.append(tuple(_parse_match(m, f"{kpath}[{i}]", errors) for i, m in enumerate(spec)))
            continue
        try:
            check_field(str(key))
        except ValueError as e:
            errors.append((kpath, str(e)))
            continue
        if isinstance(spec, dict) and not spec:      # no condition: it matched every request
            errors.append((kpath, "an empty operator map; give one, e.g. {eq: VALUE} or {exists: true}"))
            continue
        ops = spec if isinstance(spec, dict) else {"in" if isinstance(spec, list) else "eq": spec}
        for op, value in ops.items():
            try:
                conds.append(Condition(str(key), str(op), value))
            except ValueError as e:
                explicit = isinstance(spec, dict) and op in OPERATORS
                errors.append((f"{kpath}.{op}" if explicit else kpath, str(e)))
    return Match(tuple(conds), tuple(groups))


def _target(t: TargetConfig, cfg: GatewayConfig, path: str, errors: list[tuple[str, str]]) -> Target | None:
    backend = cfg.backends.get(t.backend)
    if backend is None:
        errors.append((f"{path}.backend", f"unknown backend {t.backend!r}; defined: {', '.join(cfg.backends)}"))
        return None
    return Target(t.backend, t.model, t.weight, backend.prices.input, backend.prices.output, t.id,
                  backend.prices.cached_input)


def _check_engine(name: str, engine: EngineConfig, errors: list[tuple[str, str]], warnings: list[str]) -> None:
    """Validate the local engine's settings with ``EngineArgs``' own checks
    (cheap: nothing is loaded). A missing model file is a warning (the
    backend will be unavailable), a bad value an error."""
    try:
        EngineArgs(**engine.engine_kwargs())
    except FileNotFoundError as e:
        warnings.append(f"backends.{name}.engine.model: {e}")
    except ValueError as e:
        field_name = str(e).split(" ", 1)[0].split(".", 1)[0].rstrip(":")   # speculative_config.k: its own
        path = f"backends.{name}.engine" + (f".{field_name}" if field_name in EngineConfig.model_fields else "")
        errors.append((path, str(e)))


def compile_config(cfg: GatewayConfig, overrides: dict[str, dict[str, float]] | None = None,
                   environ: dict[str, str] | None = None) -> Compiled:
    """Cross-check references and build the hot-path structures.

    Raises:
        ConfigError: unknown backends/routes/fields, duplicate model names,
            several local backends, bad overrides.
    """
    env = os.environ if environ is None else environ
    errors: list[tuple[str, str]] = []
    warnings: list[str] = []
    names = _model_names(cfg, errors)
    locals_ = [n for n, b in cfg.backends.items() if b.type == "local"]
    if len(locals_) > 1:
        errors.append(("backends", f"at most one local backend, got {', '.join(locals_)}"))
    for name in locals_:
        _check_engine(name, cfg.backends[name].engine, errors, warnings)
    routes = _routes(cfg, overrides or {}, errors)
    weight_errors, weight_warnings = check_weights(cfg, routes, overrides or {}, env)
    errors += weight_errors
    warnings += weight_warnings
    rules = _rules(cfg, names, errors)
    if cfg.policy.default_route not in cfg.routes:
        errors.append(("policy.default_route", f"unknown route {cfg.policy.default_route!r}"))
    key = cfg.policy.canary_key
    if not (key in ("user", "request_id") or (key.startswith("header:") and len(key) > 7)):
        errors.append(("policy.canary_key", f"must be user, request_id or header:<name>, got {key!r}"))
    if cfg.observability.tracing.exporter == "otlp" and (why := otlp_unavailable()):
        errors.append(("observability.tracing.exporter", why))
    errors += config_problems(cfg, routes)
    warnings += _cache_warnings(cfg) + _unserved_model_warnings(cfg)
    hashes = _key_hashes(cfg, env, warnings, errors)
    if errors:
        raise ConfigError(errors)
    policy = Policy(tuple(rules), routes, cfg.policy.default_route, cfg.policy.canary_key)
    return Compiled(cfg, policy, names, hashes, warnings, overrides=dict(overrides or {}))


def _cache_warnings(cfg: GatewayConfig) -> list[str]:
    """A route (or a model) whose cache is ``exact`` where no answer can be exact: exact mode keeps only the local
    engine's answers as a route's first target, so a route without the local backend among its targets (a config
    without one, for a model) bypasses the cache on every request (an ops trial saw only "cache changed" logged
    and ``x-tandem-cache: bypass`` for good)."""
    local = next((n for n, b in cfg.backends.items() if b.type == "local"), None)
    hint = "exact mode caches only the local engine's answers; every request bypasses the cache (mode: best_effort " \
           "caches any backend's)"
    out = [f"routes.{name}.cache: the route has no local target: {hint}" for name, r in cfg.routes.items()
           if r.cache.mode == "exact" and local not in {t.backend for t in r.targets}]
    if local is None:
        out += [f"models[{i}].cache: no local backend is configured: {hint}" for i, m in enumerate(cfg.models)
                if m.cache is not None and m.cache.mode == "exact"]
    return out


def _unserved_model_warnings(cfg: GatewayConfig) -> list[str]:
    """A public model no rule names, whose default route sends it to a backend that does not know it: the local
    engine serving another model (it answers any name), or an upstream with a ``models`` mapping without it (the
    name is sent as it is). A CLI trial's ``- name: llama3`` was answered by SmolLM2 under that name, silently."""
    route = cfg.routes.get(cfg.policy.default_route)
    named = json.dumps([r.match for r in cfg.policy.rules], default=str)
    out = []
    for i, m in enumerate(cfg.models):
        if route is None or any(f'"{n}"' in named for n in (m.name, *m.aliases)):
            continue                            # a rule routes it: the operator chose where it goes
        for t in route.targets:
            b = cfg.backends.get(t.backend)
            if b is None or t.model:
                continue
            if b.type == "local":
                served = b.engine.served_model_name
                if served and served not in (m.name, *m.aliases):
                    out.append(f"models[{i}] ({m.name}): the default route {cfg.policy.default_route!r} sends it to "
                               f"backend {t.backend!r}, the local engine serving {served!r} (under any name it is "
                               f"sent); add a rule routing it, or make it an alias of {served!r}")
            elif getattr(b, "models", None) and m.name not in b.models:
                out.append(f"models[{i}] ({m.name}): the default route {cfg.policy.default_route!r} sends it to "
                           f"backend {t.backend!r}, whose models mapping has no entry for it (sent as it is)")
    return out


def _model_names(cfg: GatewayConfig, errors: list) -> dict[str, str]:
    """Every public model name and alias -> its model's name (a name used twice is an error)."""
    names: dict[str, str] = {}
    for i, m in enumerate(cfg.models):
        for n in [m.name, *m.aliases]:
            if n in names:
                errors.append((f"models[{i}]", f"name or alias {n!r} is used twice"))
            names[n] = m.name
    return names


def _routes(cfg: GatewayConfig, overrides: dict[str, dict[str, float]], errors: list) -> dict[str, Route]:
    """The compiled routes, with the operators' weight ``overrides`` applied."""
    routes: dict[str, Route] = {}
    for rname, r in cfg.routes.items():
        targets = [_target(t, cfg, f"routes.{rname}.targets[{i}]", errors) for i, t in enumerate(r.targets)]
        fallbacks = [_target(t, cfg, f"routes.{rname}.fallbacks[{i}]", errors) for i, t in enumerate(r.fallbacks)]
        if None in targets or None in fallbacks:
            continue
        if r.select == "prefix_affinity":
            errors += [(f"routes.{rname}.targets[{i}].backend", "prefix_affinity targets are engine replicas: "
                        "openai backends (tandem engine serve or vLLM), not the local engine")
                       for i, t in enumerate(r.targets) if cfg.backends[t.backend].type != "openai"]
        try:
            aff = r.affinity
            routes[rname] = Route(rname, tuple(targets), tuple(fallbacks), r.select,
                                  Affinity(aff.prefix_blocks, aff.block_chars, aff.load_factor, aff.max_kv_usage),
                                  Slo(r.slo.ttft_ms, r.slo.tpot_ms) if r.slo else None, r.sticky)
        except ValueError as e:
            errors.append((f"routes.{rname}", str(e)))
    for rname, weights in overrides.items():
        if rname not in routes:
            errors.append((f"overrides.{rname}", f"unknown route {rname!r}"))
            continue
        try:
            routes[rname] = with_weights(routes[rname], weights)
        except ValueError as e:
            errors.append((f"overrides.{rname}", str(e)))
    return routes


def _rules(cfg: GatewayConfig, names: dict[str, str], errors: list) -> list[Rule]:
    """The policy's rules, their routes and the models they match checked."""
    rules = []
    for i, r in enumerate(cfg.policy.rules):
        path = f"policy.rules[{i}]"
        if r.route not in cfg.routes:
            errors.append((f"{path}.route", f"unknown route {r.route!r}; defined: {', '.join(cfg.routes)}"))
        m = _public_models(_parse_match(r.match, f"{path}.match", errors), names, f"{path}.match", errors)
        if r.name in [x.name for x in rules]:     # x-tandem-rule and explain name the rule that matched
            errors.append((f"{path}.name", f"rule name {r.name!r} is given twice: each rule names itself"))
        if rules and not rules[-1].match.all and not rules[-1].match.any:
            errors.append((path, f"unreachable: rule {rules[-1].name!r} before it matches every request"))
        rules.append(Rule(r.name, r.route, m, Slo(r.slo.ttft_ms, r.slo.tpot_ms) if r.slo else None))
    return rules


def _public_models(m: Match, names: dict[str, str], path: str, errors: list) -> Match:
    """``m`` with each model condition's aliases read as their public model (a request's ``model`` feature is
    its public name: a rule naming an alias loaded and never matched, a policy trial), in ``any`` groups too; a
    name that is no model's is an error."""
    conds = []
    for c in m.all:
        if c.field == "model" and c.op in ("eq", "ne", "in", "not_in"):
            values = c.value if isinstance(c.value, tuple) else (c.value,)
            for v in values:
                if v not in names:
                    errors.append((f"{path}.model", f"unknown model {v!r}; defined: {', '.join(names)}"))
            public = tuple(names.get(v, v) for v in values)
            c = Condition(c.field, c.op, public if isinstance(c.value, tuple) else public[0])
        conds.append(c)
    return Match(tuple(conds), tuple(tuple(_public_models(g, names, f"{path}.any", errors) for g in group)
                                     for group in m.any))


def _key_hashes(cfg: GatewayConfig, env, warnings: list[str], errors: list[tuple[str, str]]) -> dict[str, str]:
    """SHA-256 of each virtual key -> its tenant (a key whose environment variable is unset, or blank, is
    disabled; a variable's value is read without the blanks around it, as a secret file's trailing newline). One
    key under two tenants is an error: it was given to the last silently (a security trial)."""
    hashes: dict[str, str] = {}
    where: dict[str, int] = {}
    for i, k in enumerate(cfg.auth.keys):
        if k.sha256:
            digest = k.sha256
        elif value := env.get(k.env or "", "").strip():
            digest = hashlib.sha256(value.encode()).hexdigest()
        else:
            warnings.append(f"auth.keys[{i}]: environment variable {k.env} is unset; "
                            f"key of tenant {k.tenant!r} disabled")
            continue
        if hashes.get(digest, k.tenant) != k.tenant:
            errors.append((f"auth.keys[{i}]", f"the same key as auth.keys[{where[digest]}], of tenant "
                                              f"{hashes[digest]!r}: a key names one tenant"))
            continue
        hashes[digest], where[digest] = k.tenant, i
    return hashes


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping: PyYAML keeps the last one silently, so
    a second ``policy:`` block pasted at the end of a file dropped every rule of the first (an ops trial)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (list, dict)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {key!r} (first given on line {seen[key].line + 1})",
                        key_node.start_mark)
                if not isinstance(key, (list, dict)):
                    seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def load_config_text(text: str, overrides: dict[str, dict[str, float]] | None = None,
                     environ: dict[str, str] | None = None, source: str | None = None) -> Compiled:
    """Parse, validate and compile a YAML config; ``source`` (the file's path) is named in errors.

    Raises:
        ConfigError: YAML syntax error, schema error, or broken reference,
            each naming the key path (and the YAML error its line and column in ``source``).
    """
    stream = io.StringIO(text)
    stream.name = source or "<config>"      # PyYAML names it in "in <file>, line L, column C"
    try:
        raw = yaml.load(stream, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError([("", f"not valid YAML: {e}")], source) from None
    if not isinstance(raw, dict):
        raise ConfigError([("", "the config must be a YAML mapping")], source)
    try:
        cfg = GatewayConfig.model_validate(raw)
        compiled = compile_config(cfg, overrides, environ)
    except ValidationError as e:
        raise ConfigError(validation_problems(e), source) from None
    except ConfigError as e:
        raise ConfigError(e.errors, source) from None
    compiled.text = text
    return compiled


def load_config_file(path: str, overrides: dict[str, dict[str, float]] | None = None) -> Compiled:
    """``load_config_text`` of a file. Raises ConfigError naming ``path`` (also for I/O errors)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError([("", f"cannot read it: {e.strerror}")], path) from None
    return load_config_text(text, overrides, source=path)


def load_config_or_report(path: str, prefix: str = "") -> Compiled | None:
    """``load_config_file`` for the CLI: on ConfigError prints ``{prefix}{error}`` (it names ``path``) to stderr and
    returns None."""
    try:
        return load_config_file(path)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return None
