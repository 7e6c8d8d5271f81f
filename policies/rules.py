"""Rule matching: a rule's ``match`` is a conjunction of conditions on request
features and live signals, optionally with ``any`` groups (disjunctions).

Fields a condition may name:
  ``model``, ``priority``, ``prompt_tokens``, ``tenant``, ``tools``,
  ``response_format``, ``stream``, ``max_tokens``, ``user``,
  ``local.waiting``, ``local.running``, ``local.kv_usage`` (percent),
  ``local.serves`` (the local engine serves every field of the request),
  ``header.<name>`` (lower-cased), ``metadata.<key>``.
Operators: ``eq``, ``in``, ``gt``, ``gte``, ``lt``, ``lte`` (plus ``ne``,
``not_in`` and ``exists`` for convenience).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.features import RequestFeatures, Signals, parse_priority, tenant_label

OPERATORS = ("eq", "ne", "in", "not_in", "gt", "gte", "lt", "lte", "exists")
SIMPLE_FIELDS = ("model", "priority", "prompt_tokens", "tenant", "tools", "response_format",
                 "stream", "max_tokens", "user", "local.waiting", "local.running", "local.kv_usage",
                 "local.serves")
PREFIX_FIELDS = ("header.", "metadata.")


def check_field(name: str) -> None:
    """Raise ValueError unless ``name`` is a known condition field."""
    if name in SIMPLE_FIELDS:
        return
    if name.startswith(PREFIX_FIELDS) and len(name.split(".", 1)[1]) > 0:
        return
    raise ValueError(f"unknown match field {name!r}; expected one of {', '.join(SIMPLE_FIELDS)}, "
                     "header.<name> or metadata.<key>")


@dataclass(frozen=True)
class Condition:
    """``field op value``; ``value`` is a list for ``in``/``not_in``.
    Priority values may be names (high/normal/low): they are normalised to
    ints at construction."""

    field: str
    op: str
    value: object

    def __post_init__(self) -> None:
        check_field(self.field)
        if self.op not in OPERATORS:
            raise ValueError(f"unknown operator {self.op!r}; expected one of {', '.join(OPERATORS)}")
        if self.op in ("in", "not_in"):
            if not isinstance(self.value, (list, tuple)):
                raise ValueError(f"operator {self.op} needs a list, got {self.value!r}")
            value = tuple(self.value)
            if self.field == "priority":
                value = tuple(parse_priority(v) for v in value)
            object.__setattr__(self, "value", value)
        elif self.op in ("gt", "gte", "lt", "lte"):
            value = parse_priority(self.value) if self.field == "priority" else self.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"operator {self.op} needs a number, got {self.value!r}")
            object.__setattr__(self, "value", value)
        elif self.field == "priority" and self.op in ("eq", "ne"):
            object.__setattr__(self, "value", parse_priority(self.value))
        elif self.op == "exists" and not isinstance(self.value, bool):   # "no" was truthy: exists true
            raise ValueError(f"operator exists needs true or false, got {self.value!r}")

    def describe(self) -> str:
        return f"{self.field} {self.op} {self.value!r}"


@dataclass(frozen=True)
class Match:
    """All of ``all`` and, for each group in ``any``, at least one of its
    matches. An empty Match matches everything."""

    all: tuple[Condition, ...] = ()
    any: tuple[tuple["Match", ...], ...] = field(default=())

    def fields(self) -> set[str]:
        """Every field named in this match (to know what to compute)."""
        out = {c.field for c in self.all}
        for group in self.any:
            for m in group:
                out |= m.fields()
        return out


def feature_value(name: str, f: RequestFeatures, s: Signals) -> object:
    """The value of condition field ``name`` for this request (None = absent)."""
    if name == "model":
        return f.model
    if name == "priority":
        return f.priority
    if name == "prompt_tokens":   # a batch's prompts each fit a context alone: its longest is what a rule weighs
        return f.longest_prompt_tokens if f.longest_prompt_tokens is not None else f.prompt_tokens
    if name == "tenant":
        return tenant_label(f.tenant)
    if name == "tools":
        return f.has_tools
    if name == "response_format":
        return f.has_response_format
    if name == "stream":
        return f.stream
    if name == "max_tokens":
        return f.max_tokens
    if name == "user":       # absent or empty: None (exists false), as OpenAI reads an empty user
        return f.user or None
    if name == "local.serves":
        return f.local_serves
    if name == "local.waiting":
        return s.local_waiting
    if name == "local.running":
        return s.local_running
    if name == "local.kv_usage":
        return s.local_kv_usage
    if name.startswith("header."):
        return f.headers.get(name[7:].lower())
    if name.startswith("metadata."):
        return f.metadata.get(name[9:])
    raise ValueError(f"unknown match field {name!r}")


def _eq(actual: object, expected: object) -> bool:
    if actual == expected:
        return True
    # Header and metadata values are strings; compare "true" with True, "3" with 3.
    if isinstance(actual, str) and not isinstance(expected, str):
        return actual.strip().lower() == str(expected).lower()
    return False


def _num(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def evaluate(c: Condition, f: RequestFeatures, s: Signals) -> tuple[bool, object]:
    """(whether ``c`` holds, the actual value it was tested against)."""
    actual = feature_value(c.field, f, s)
    op = c.op
    if op == "exists":
        return (actual is not None and actual is not False) == bool(c.value), actual
    if op == "eq":
        return _eq(actual, c.value), actual
    if op == "ne":
        return not _eq(actual, c.value), actual
    if op == "in":
        return any(_eq(actual, v) for v in c.value), actual
    if op == "not_in":
        return not any(_eq(actual, v) for v in c.value), actual
    a = _num(actual)
    if a is None:
        return False, actual
    v = c.value
    ok = a > v if op == "gt" else a >= v if op == "gte" else a < v if op == "lt" else a <= v
    return ok, actual


def match(m: Match, f: RequestFeatures, s: Signals, why: list[str] | None = None) -> bool:
    """Whether ``m`` matches; appends human-readable reasons to ``why``."""
    for c in m.all:
        ok, actual = evaluate(c, f, s)
        if why is not None:
            why.append(f"{c.describe()}: {'yes' if ok else 'no'} (actual {actual!r})")
        if not ok:
            return False
    for group in m.any:
        sub: list[str] = []
        hit = False
        for alternative in group:
            if match(alternative, f, s, sub):
                hit = True
                break
        if why is not None:
            why.append(f"any of {len(group)}: {'yes' if hit else 'no'} [{'; '.join(sub)}]")
        if not hit:
            return False
    return True
