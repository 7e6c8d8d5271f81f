"""What a version rollback returns to: the previous version, less the splits of rollouts that have ended.

A rollback undoes a config change (the file's, an operator's), not a rollout (docs/operators/desired-state.md). The
previous version may hold, on a route, the split of a rollout that has ended since (aborted, rolled back by its
gates), taken while it ran: returned to as stored, its candidate would get traffic again although its rollout is
over. (The split it left when it ended is not such a split: returning to it undoes what came after.) Such a route
keeps the weights it has now (the head's override of it, else the head's file weights for it: put over the previous
version's file where they differ from it), and the rollback's answer says so.

Nor does a rollback bring back, unasked, a virtual key the change it undoes removed (a revoked key working again
would be a security incident): it is refused naming the tenants (``KeysRestored``) unless the operator says
``restore_keys``.
"""

from __future__ import annotations

from gateway.config.compile import load_config_text
from gateway.config.layers import (RolloutConflict, ended_owner, holds_split, orphaned, rollout_weights,
                                   route_weights, same_as_file)
from gateway.config.versions import ConfigState


def _fmt(weights: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in weights.items()) if weights else "the file's weights"


def _file_weights(state: ConfigState) -> dict[str, dict[str, float]]:
    """route -> {target id: weight} of ``state``'s config text (no overrides)."""
    return route_weights(load_config_text(state.text, {}).policy)


def _left_by(r: dict, weights: dict[str, float]) -> bool:
    """Whether ``weights`` (a route's) are the split rollout ``r`` left when it ended (0 % after an abort, the last
    good step after its gates rolled it back): returning to them undoes what came after, it brings nothing of the
    rollout back (a trial's rollback after abort -> operator weights could not undo the operator's change)."""
    return all(weights.get(k) == v for k, v in rollout_weights(r).items())


def without_ended(head: ConfigState, prev: ConfigState, rollouts: list[dict]) -> tuple[ConfigState | None, list[str]]:
    """The state a rollback from ``head`` to ``prev`` installs, and one warning per route it kept.

    Args:
        head: the version the rollback undoes (the ledger's head).
        prev: the version before it.
        rollouts: every rollout (the store's dicts).

    Returns:
        (None, []) when ``prev`` holds no ended rollout's split (the ledger installs it as stored); else
        ``prev`` with those routes set to the weights they have at ``head`` (an override over ``prev``'s file where
        they differ from it, owned as at ``head``; ``file_digest``: the head's, the file last applied), and a
        warning naming each route, rollout and the weights kept.
    """
    overrides, owners = {r: dict(w) for r, w in prev.overrides.items()}, dict(prev.owners)
    head_file, prev_file = _file_weights(head), _file_weights(prev)
    warnings = []
    for route in sorted(prev.owners):
        r = ended_owner(rollouts, prev.owners, route)
        if r is None:
            continue
        now = {**head_file.get(route, {}), **head.overrides.get(route, {})}    # what the route has now
        back = {**prev_file.get(route, {}), **prev.overrides.get(route, {})}   # what returning as stored gives it
        if not now or now == back or _left_by(r, back):
            continue
        overrides.pop(route, None)
        owners.pop(route, None)
        if not same_as_file(prev_file.get(route), now):
            overrides[route] = now
            if route in head.owners:
                owners[route] = head.owners[route]
        warnings.append(f"route {route}: the version rolled back to holds rollout {r['name']}'s split "
                        f"({_fmt(prev.overrides.get(route))}), which is not brought back: the rollout is "
                        f"{r['state']}; the route keeps {_fmt(now)}")
    if not warnings:
        return None, []
    return ConfigState(prev.text, overrides, "rollback", created=prev.created, file_digest=head.file_digest,
                       owners=owners), warnings


def with_promoted(head: ConfigState, state: ConfigState, rollouts: list[dict]) -> ConfigState | None:
    """``state`` (what a rollback from ``head`` installs) with each promoted rollout's split on its route where it
    holds another (the version returned to is from before the promotion), owned by the rollout: the one version a
    rollback installs routes as the rollout says at once (an ops trial saw the older split served ~0.3 s, until
    ``RolloutController.reassert`` set it again in a version of its own). None when no route changes."""
    file = _file_weights(state)
    overrides, owners = {r: dict(w) for r, w in state.overrides.items()}, dict(state.owners)
    for r in rollouts:
        route = r["route"]
        if r["state"] != "promoted" or route not in file \
                or holds_split({**file[route], **overrides.get(route, {})}, rollout_weights(r)):
            continue
        overrides.setdefault(route, {}).update(rollout_weights(r))
        owners[route] = r["name"]
    if overrides == state.overrides:
        return None
    return ConfigState(state.text, overrides, "rollback", created=state.created, file_digest=head.file_digest,
                       owners=owners)


def returns_to(head: ConfigState, prev: ConfigState, rollouts: list[dict]) -> tuple[ConfigState | None, list[str]]:
    """What a rollback from ``head`` to ``prev`` installs (None: ``prev`` as stored) and its warnings:
    ``without_ended``, then ``with_promoted``, after checking that ``prev`` orphans no rollout (removes a target one
    in ``HOLDING_STATES`` steers: refused, as such a reload is; the rollout is ended first).

    Raises:
        RolloutConflict: ``prev`` would orphan a rollout (naming it)."""
    problems = orphaned(route_weights(load_config_text(prev.text, {}).policy), rollouts, "the version it returns to")
    if problems:
        raise RolloutConflict(problems, ". End it first (tandem ctl rollout abort NAME, or release NAME when "
                                        "promoted), then roll back")
    state, warnings = without_ended(head, prev, rollouts)
    return with_promoted(head, state or prev, rollouts) or state, warnings + running_warnings(head, prev, rollouts)


def running_warnings(head: ConfigState, prev: ConfigState, rollouts: list[dict]) -> list[str]:
    """One warning per running rollout whose route's split the rollback from ``head`` to ``prev`` changes: its
    controller sets its step's split again at its next tick (a security trial's console said "Roll back: done" and
    the split came back a second later, without a word)."""
    running = [r for r in rollouts if r["state"] == "running"]
    if not running:
        return []
    before = route_weights(load_config_text(head.text, head.overrides).policy)
    after = route_weights(load_config_text(prev.text, prev.overrides).policy)
    return [f"rollout {r['name']} (running) steers route {r['route']!r}: its controller sets its step's split "
            f"again at its next tick; to return the route to its baseline, abort it (tandem ctl rollout abort "
            f"{r['name']})" for r in running if before.get(r["route"]) != after.get(r["route"])]


class KeysRestored(Exception):
    """A rollback would bring back virtual keys (``auth.keys``) the version it undoes does not have."""


def keys_brought_back(head: ConfigState, prev: ConfigState) -> list[str]:
    """The tenants (sorted, once each) of the virtual keys ``prev``'s config loads and ``head``'s does not (compared
    by their sha256; keys from environment variables as this process sees them)."""
    now = load_config_text(head.text, {}).key_hashes
    return sorted({tenant for digest, tenant in load_config_text(prev.text, {}).key_hashes.items() if digest not in now})


def check_keys(head: ConfigState, prev: ConfigState, restore_keys: bool) -> None:
    """Refuse a rollback from ``head`` to ``prev`` that brings back removed keys, unless ``restore_keys``.

    Raises:
        KeysRestored: naming the tenants and how to roll back anyway."""
    if not restore_keys and (tenants := keys_brought_back(head, prev)):
        raise KeysRestored(f"the version it returns to has virtual keys (auth.keys) that version {head.version} "
                           f"removed, of tenant(s) {', '.join(tenants)}: a revoked key would work again. Roll back "
                           "anyway with restore_keys (tandem ctl rollback --restore-keys), or edit the file")
