"""One line saying what changed between two config versions (the log line of every applied version)."""

from __future__ import annotations

import yaml

from gateway.config.compile import Compiled
from gateway.config.schema import READ_AT_START, GatewayConfig
from policies import Target


def describe_changes(old: Compiled | None, new: Compiled) -> str:
    """What changed between two versions, in one line: ``route local-first: deepseek 5 -> 25, local 95 -> 75``
    (the weights in effect, overrides included), a route whose weights only the text changed under an override
    (``route chat: canary 5 -> 10, stable 95 -> 90 in the config text, not in effect (an override holds the
    route)``), routes added or removed, then the config's own key paths added, removed or changed
    (``routes.main.shadow added``); ``no change`` when nothing did (``old`` None: a start, which may adopt a
    version the shared state already had)."""
    if old is None:
        return "the first version this process runs"
    parts = []
    file_old, file_new = _file_weights(old.config), _file_weights(new.config)
    for name in sorted(set(old.policy.routes) | set(new.policy.routes)):
        a, b = old.policy.routes.get(name), new.policy.routes.get(name)
        if a is None or b is None:
            parts.append(f"route {name} {'added' if a is None else 'removed'}")
            continue
        moved = _moved({t.id: t.weight for t in a.targets}, {t.id: t.weight for t in b.targets})
        if moved:
            parts.append(f"route {name}: {moved}")
        elif (moved := _moved(file_old.get(name, {}), file_new.get(name, {}))) and name in new.overrides:
            parts.append(f"route {name}: {moved} in the config text, not in effect (an override holds the route)")
        elif moved:     # the file now decides, with the weights the override it replaced had (a trial's log
            parts.append(f"route {name}: {moved} in the config text, which now decides it (the same weights "
                         "as the override it replaces)")   # said an override held it while ctl status said [file])
    if old.text != new.text:   # the weights are the routes' part above
        parts += key_changes(_load(old.text), _load(new.text))
    return "; ".join(parts) or "no change"


def _file_weights(cfg: GatewayConfig) -> dict[str, dict[str, float]]:
    """route -> {target id: weight} as a config's text says (under no override)."""
    return {name: {Target(t.backend, t.model, id=t.id).id: t.weight for t in r.targets}
            for name, r in cfg.routes.items()}


def _moved(a: dict[str, float], b: dict[str, float]) -> str:
    """``cand 0 -> 5, stable 100 -> 95``: the targets whose weight differs between ``a`` and ``b``."""
    return ", ".join(f"{t} {a.get(t, 0):g} -> {b.get(t, 0):g}" for t in sorted(set(a) | set(b)) if a.get(t) != b.get(t))


def _load(text: str):
    """A config text parsed, the routes' target weights left out (``describe_changes`` reports those as they take
    effect: a text whose weights an override replaces changes nothing there)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return {}
    routes = doc.get("routes") if isinstance(doc, dict) else None
    for route in routes.values() if isinstance(routes, dict) else ():
        targets = route.get("targets") if isinstance(route, dict) else None
        for t in targets if isinstance(targets, list) else ():
            if isinstance(t, dict):
                t.pop("weight", None)
    return doc


def key_changes(old, new, path: str = "", depth: int = 3) -> list[str]:
    """Key paths (``routes.main.shadow``) added, removed or changed between two parsed configs, followed to
    ``depth`` levels (a change deeper is reported at that level); comments and formatting are not changes. A key
    the gateway reads at start (``schema.READ_AT_START``) says so: ``state.redis_url changed (read at start: a
    restart applies it)`` (a trial's fail_closed_limits change was logged as applied, and was not)."""
    if old == new:
        return []
    if not (isinstance(old, dict) and isinstance(new, dict)) or depth == 0:
        return [f"{path or 'config'} changed"]
    out = []
    for k in list(old) + [k for k in new if k not in old]:
        sub = f"{path}.{k}" if path else str(k)
        if k not in new:
            out.append(f"{sub} removed{_at_start(sub)}")
        elif k not in old:
            out.append(f"{sub} added{_at_start(sub)}")
        elif sub in READ_AT_START and old[k] != new[k]:
            out.append(f"{sub} changed{_at_start(sub)}")
        else:
            out += key_changes(old[k], new[k], sub, depth - 1)
    return out


def _at_start(path: str) -> str:
    return " (read at start: a restart applies it)" if path in READ_AT_START else ""
