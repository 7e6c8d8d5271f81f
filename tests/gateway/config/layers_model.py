"""The reference model of a route's weights layers for ``test_layers_stateful.py``: the precedence rules of
docs/operators/desired-state.md written small (file < operator override < rollout (running, paused, promoted), an
ended rollout's split its own layer, the model's own version history for rollbacks), the config text the test
writes, and a log handler that collects the changes the gateway logs."""

from __future__ import annotations

import copy
import logging

HOLDING = ("running", "paused", "promoted")
ENDED = ("aborted", "rolled_back")     # an override such a rollout left is its layer (``owners``), not an operator's
STEPS = [25.0, 50.0]
KEEP = 10                    # reload.keep_versions (the default): the versions a rollback can go back through
PAIRS = 3                    # the gates' min_compared: the pairs an evidence rule writes
UNREACHABLE = "Redis is unreachable"


def config_text(prefix: str, redis_url: str, file: dict) -> str:
    """The config file: route ``ro`` (stable, and cand unless removed) and route ``other`` (stable)."""
    cand = f", {{backend: cand, weight: {file['cand']}}}" if file["cand"] is not None else ""
    return (f"state: {{redis_url: '{redis_url}', key_prefix: {prefix}, sync_interval_s: 0.02, socket_timeout_s: 1,"
            " reconnect_min_s: 0.02, reconnect_max_s: 0.1}\n"
            "reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            "observability:\n  logs: {requests: false}\n"
            "models:\n  - name: m1\n"
            "backends:\n  stable:\n    type: openai\n    base_url: http://127.0.0.1:9/v1\n"
            "  cand:\n    type: openai\n    base_url: http://127.0.0.1:9/v1\n"
            f"routes:\n  ro:\n    targets: [{{backend: stable, weight: {file['stable']}}}{cand}]\n"
            + ("    release: true\n" if file["release"] else "") +
            f"  other:\n    targets: [{{backend: stable, weight: {file['other']}}}]\n"
            "policy:\n  default_route: ro\n")


def file_weights(file: dict) -> dict[str, dict[str, float]]:
    ro = {"stable": float(file["stable"])}
    if file["cand"] is not None:
        ro["cand"] = float(file["cand"])
    return {"ro": ro, "other": {"stable": float(file["other"])}}


def split(cand: float) -> dict[str, float]:
    return {"cand": cand, "stable": 100.0 - cand}


class Model:
    """The precedence rules, written small: the file layer of the running version, an operator override per route,
    at most one rollout holding ``ro`` (name, state, step index, weight; ``every``: each one started, by name), the
    rollout whose split ``ro``'s override is (``owner``), and the versions a rollback goes back through (file,
    stored overrides: the operators' with the rollout's split on its route while it runs or is promoted, owner),
    oldest first."""

    def __init__(self, file: dict):
        self.file = file
        self.override: dict[str, dict[str, float]] = {}
        self.rollout: dict | None = None
        self.every: dict[str, dict] = {}
        self.owner: str | None = None
        self.versions: list[tuple[dict, dict, str | None]] = [(file, {}, None)]

    def holds(self, states=HOLDING) -> bool:
        return self.rollout is not None and self.rollout["state"] in states

    def stored(self) -> dict[str, dict[str, float]]:
        out = copy.deepcopy(self.override)
        if self.holds(("running", "promoted")):     # paused: the operator has its weights (``override``)
            out["ro"] = split(self.rollout["weight"])
        return out

    def effective(self) -> dict[str, dict[str, float]]:
        out = file_weights(self.file)
        for route, w in self.stored().items():
            out[route] = {**out[route], **w}
        return out

    def ended_owner(self) -> dict | None:
        """The ended rollout whose split ``ro``'s override is."""
        r = self.every.get(self.owner)
        return r if r is not None and r["state"] in ENDED and "ro" in self.override else None

    def left(self, weight: float) -> None:
        """The split an ending rollout leaves on ``ro``: none where it is the file's."""
        self.owner = self.rollout["name"]
        fw = file_weights(self.file)["ro"]
        if {**fw, **split(weight)} == fw:
            self.override.pop("ro", None)
        else:
            self.override["ro"] = split(weight)

    def record(self) -> None:
        """A new version when the state differs from the head (the ledger keeps one of equal content, recording
        the new owner on it)."""
        owner = self.rollout["name"] if self.holds(("running", "promoted")) else self.owner
        state = (self.file, self.stored())
        if self.versions[-1][:2] != state:
            self.versions = (self.versions + [(*state, owner)])[-KEEP:]
        else:
            self.versions[-1] = (*state, owner)

    def decided(self) -> dict[str, str]:
        """The layer a reload's answer must name for each route."""
        r, ended = self.rollout, self.ended_owner()
        ro = (f"rollout {r['name']} ({r['state']})" if self.holds() else
              f"rollout {ended['name']} ({ended['state']})" if ended else
              "operator" if "ro" in self.override else "file")
        return {"ro": ro, "other": "operator" if "other" in self.override else "file"}

    def reload(self, new: dict, abort: bool) -> str:
        """Apply a reload of ``new``: "" when applied, else what the refusal must name."""
        old_w, new_w = file_weights(self.file), file_weights(new)
        if self.holds():
            orphan = new["cand"] is None
            if not new["release"] and orphan and not abort:
                return f"rollout {self.rollout['name']}"
            if new["release"] or orphan:     # the file takes the route back: the rollout ends
                self.rollout["state"] = "released" if self.rollout["state"] == "promoted" else "aborted"
                self.override.pop("ro", None)
        if self.ended_owner() and {**new_w["ro"], **self.override["ro"]} == new_w["ro"]:
            del self.override["ro"]           # what the ended rollout left is what the file says
        for route in list(self.override):
            if not (self.holds() and route == "ro") and old_w[route] != new_w[route]:
                del self.override[route]      # the file changed that route: it is the newer decision
        self.file = new
        self.owner = self.rollout["name"] if self.holds() else self.owner if self.ended_owner() else None
        self.record()
        return ""

    def rollback(self) -> str:
        """Apply ``ctl rollback``: "" when applied, else what the refusal must name."""
        if len(self.versions) < 2:
            return "no previous config version"
        prev_file, prev_stored, prev_owner = copy.deepcopy(self.versions[-2])
        if self.holds() and prev_file["cand"] is None:
            return f"rollout {self.rollout['name']}"
        head_file, head_stored, head_owner = self.versions.pop()
        gone = self.every.get(prev_owner)
        now = {**file_weights(head_file)["ro"], **head_stored.get("ro", {})}     # what ro has at the head
        prev_fw = file_weights(prev_file)["ro"]
        if gone is not None and gone["state"] in ENDED and {**prev_fw, **prev_stored.get("ro", {})} != now:
            prev_stored.pop("ro", None)       # an ended rollout's split is not brought back: ro keeps its weights,
            if {**prev_fw, **now} != prev_fw:  # over the old file where they differ from it
                prev_stored["ro"] = now
            prev_owner = head_owner if "ro" in prev_stored else None
        self.file, self.override, self.owner = prev_file, prev_stored, prev_owner
        self.record()                         # a running or promoted rollout's split is set again on top
        return ""


class Changes(logging.Handler):
    """The descriptions of the config versions applied (``Gateway._apply``'s log line)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("config version") and " applied " in msg:
            self.lines.append(msg)
