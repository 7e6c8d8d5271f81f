"""Routing policies: a pure function of (request features, live signals,
policy) -> ordered targets, with an explanation. No I/O; imports nothing from
``gateway`` or ``engine``."""

from policies.affinity import Affinity, ReplicaLoad, prefix_text
from policies.decide import Decision, Policy, Rule, canary_key, decide
from policies.features import PRIORITY_NAMES, RequestFeatures, Signals, parse_priority, tenant_label
from policies.routes import Pick, Route, Target, candidates, hash_unit, pick_target, spares, with_weights
from policies.slo import Slo, TTFTEstimate
from policies.rules import OPERATORS, Condition, Match, check_field, evaluate, match

__all__ = [
    "Affinity", "Condition", "Decision", "Match", "OPERATORS", "PRIORITY_NAMES", "Pick", "Policy", "ReplicaLoad",
    "RequestFeatures", "Route", "Slo", "TTFTEstimate", "prefix_text",
    "Rule", "Signals", "Target", "candidates", "canary_key", "check_field", "decide", "evaluate", "hash_unit", "match",
    "parse_priority", "pick_target", "spares", "with_weights",
]
