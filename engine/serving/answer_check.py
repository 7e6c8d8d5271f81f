"""The second line of structured outputs: each finished structured answer is validated with ``jsonschema``.

The first line is the grammar (with ``engine/worker/json_schema_subset.py`` refusing what it cannot enforce);
this one catches whatever still slips through. An answer that would end with ``finish_reason: "stop"`` (a
``json_schema`` / ``json_object`` response format) or ``"tool_calls"`` (arguments against their tool's
``parameters``) but does not validate is never returned as such: it ends with ``finish_reason: "length"``
(the answer is incomplete for the client's purpose, as a cut one is) and ``stop_reason: "schema_violation"``;
it is counted (``tandem_structured_output_invalid_total``) and logged with its schema's digest, never its
text. ``docs/app-teams/structured-outputs-reference.md`` says so to clients.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SCHEMA_VIOLATION = "schema_violation"   # the stop_reason of an answer the second line caught
VIOLATION_FINISH = "length"


def _digest(schema_text: str) -> str:
    return hashlib.sha256(schema_text.encode()).hexdigest()[:16]


def _schema_text(spec) -> str | None:
    """The JSON text of a ``StructuredOutputsParams``' schema (``json_object``: any object), or None."""
    if spec is None or (spec.json is None and not spec.json_object):
        return None
    return '{"type": "object"}' if spec.json_object else (
        spec.json if isinstance(spec.json, str) else json.dumps(spec.json))


def _validator(schema: object):
    import jsonschema  # lazy: only finished structured answers need it

    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@dataclass
class AnswerCheck:
    """The schemas one request's answers must satisfy.

    Attributes:
        schema: the response format's schema as JSON text (None: no response-format schema).
        digest: its digest in logs (the compiled grammar's when known).
        tools: each tool's ``parameters`` by function name (tool calls).
    """

    schema: str | None = None
    digest: str = ""
    tools: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, spec, tools: list[dict] | None, parse_tool_calls: bool, answer_format=None) -> "AnswerCheck | None":
        """The check of a request: ``spec`` its ``StructuredOutputsParams`` (or None), ``tools`` its tools when
        the answer is parsed for tool calls, ``answer_format`` the response format a text answer beside tools
        follows (``ChatPlan.answer_format``). None when there is nothing to check."""
        source = answer_format if parse_tool_calls else spec
        text = _schema_text(source)
        if text is None and not parse_tool_calls:
            return None
        params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools or []
                  if isinstance(t, dict) and isinstance(t.get("function"), dict)} if parse_tool_calls else {}
        digest = "" if text is None else getattr(source, "digest", None) or _digest(text)
        return cls(schema=text, digest=digest, tools=params)

    def text_problem(self, text: str) -> str | None:
        """Why a finished response-format answer breaks its schema, or None."""
        if self.schema is None:
            return None
        return _problem(json.loads(self.schema), text, self.digest)

    def calls_problem(self, calls: list[dict]) -> str | None:
        """Why one of a finished answer's tool calls breaks its tool's parameters, or None."""
        for call in calls:
            fn = call.get("function") or {}
            name = fn.get("name")
            if name not in self.tools:
                return f"tool call to unknown function {name!r}"
            schema = self.tools[name]
            problem = _problem(schema, fn.get("arguments") or "", _digest(json.dumps(schema, sort_keys=True)))
            if problem:
                return problem
        return None


def _problem(schema: object, text: str, digest: str) -> str | None:
    """Why ``text`` is not a JSON value valid under ``schema``, or None. A check that cannot finish (an answer
    nested past Python's recursion limit, a schema ``jsonschema`` cannot read) is a problem too: the answer is
    not vouched for, and the request must end in an answer, not in the server's error (a trial's 500s opened
    the gateway's breaker)."""
    try:
        error = next(iter(_validator(schema).iter_errors(json.loads(text))), None)
    except json.JSONDecodeError as exc:
        problem = f"not JSON: {exc}"
    except RecursionError:       # json.loads or the validator, past Python's recursion limit
        problem = "not checked: the answer nests deeper than the checker reads"
    except Exception as exc:  # noqa: BLE001 -- the checker failing must not fail the request
        problem = f"not checked: the checker failed ({type(exc).__name__}: {exc})"
    else:
        problem = None if error is None else f"{error.json_path}: {error.message}"
    if problem is not None:
        logger.warning("a finished structured answer breaks its schema (digest %s): %s", digest, problem)
    return problem


def checked_finish(engine, check: AnswerCheck | None, finish_reason: str | None, stop_reason,
                   text: str = "", calls: list[dict] | None = None) -> tuple[str | None, object]:
    """(finish_reason, stop_reason) of a choice once the second line has seen it: an answer about to end with
    ``stop``/``tool_calls`` that breaks its schema ends with ``length`` and ``schema_violation`` instead, and
    is counted on ``engine`` (``AsyncEngine.count_invalid_structured_output``)."""
    if check is None or finish_reason not in ("stop", "tool_calls"):
        return finish_reason, stop_reason
    problem = check.calls_problem(calls) if calls else check.text_problem(text)
    if problem is None:
        return finish_reason, stop_reason
    engine.count_invalid_structured_output()
    return VIOLATION_FINISH, SCHEMA_VIOLATION
