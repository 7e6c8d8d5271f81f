"""The JSON-schema subset that structured outputs enforce, written down once.

``KEYWORDS`` is the table: each keyword the grammar enforces, the form its
value must have, the instance type it constrains and the limit of our
enforcement. ``UNSUPPORTED`` names the JSON-Schema keywords a grammar cannot
enforce (xgrammar would drop them silently: the output would break the
schema), ``ANNOTATIONS`` the keywords that constrain nothing. Validation
(``check_json_schema``) and the docs' table (``markdown_table``, pinned by
a test) both read these, so the promise and the check cannot drift apart.

Integer bounds: a fractional bound on ``type: integer`` is refused, naming the whole bound of the same
meaning to write instead (``minimum: 0.5`` is ``minimum: 1``; ``exclusiveMinimum: 2.5`` is ``minimum: 3``;
``maximum: 1.5`` is ``maximum: 1``), not rewritten, so the grammar enforces the schema as sent; beside
``number`` in a type list it is refused too, and a bound on an integer outside [-2^63, 2^63) (xgrammar's
int64) likewise (``json_schema_combinations``).

Anything outside the subset is refused with the keyword and its path
(``response_format.json_schema.schema.properties.tags: unsupported schema
feature 'contains' ...``) before any compile; anything inside is enforced
(``tests/engine/test_json_schema_subset.py`` samples random schemas of the
subset and validates every output with ``jsonschema``).

The check is one walk over the schema in plain Python (no meta-schema
validation: the value checks below cover the supported keywords), so that a
400 KB schema costs milliseconds, not the seconds of ``jsonschema``'s
``check_schema``. It runs in the grammar compile pool, never on an event loop.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass
from fractions import Fraction

from engine.worker.json_schema_combinations import check_node_combination, check_one_of

MAX_DEPTH = 64  # nesting of subschemas; deeper is refused (the walk and xgrammar's compiler recurse)


@dataclass(frozen=True)
class Keyword:
    """One supported keyword.

    Attributes:
        name: the keyword.
        value: the form of its value (``schema``, ``schemas``, ``schema map``,
            ``schema or bool``, ``count``, ``number``, ``regex``, ``format``,
            ``type``, ``names``, ``values``, ``any``, ``local ref``).
        applies_to: the instance type it constrains (``any`` for all).
        limit: what we do not enforce or refuse around it ('' when none).
    """

    name: str
    value: str
    applies_to: str
    limit: str = ""


KEYWORDS: tuple[Keyword, ...] = (
    Keyword("type", "type", "any", "one type or a list of types"),
    Keyword("enum", "values", "any", "every value passes the node's other keywords"),
    Keyword("const", "any", "any", "passes the node's other keywords"),
    Keyword("anyOf", "schemas", "any"),
    Keyword("oneOf", "schemas", "any", "branches disjoint by type, by const/enum values, or by a required "
            "property's const/enum values (a discriminated union; else it would be anyOf)"),
    Keyword("allOf", "schemas", "any", "one schema only"),
    Keyword("$ref", "local ref", "any", "# or a pointer #/... that resolves (no $anchor names); $ref, anyOf, "
            "oneOf, allOf: no other assertion beside them"),
    Keyword("$defs", "schema map", "any"),
    Keyword("definitions", "schema map", "any"),
    Keyword("properties", "schema map", "object"),
    Keyword("required", "names", "object", "every name must be in properties"),
    Keyword("additionalProperties", "schema or bool", "object",
            "absent means false where `properties` is given (strict, as OpenAI); an object with no `properties` "
            "(`{}`, `{\"type\": \"object\"}`) takes any keys, as json_object"),
    Keyword("patternProperties", "schema map", "object", "one regex, matching no name of properties; no lookaround, "
            "no backreference"),
    Keyword("minProperties", "count", "object", "at most the required count where other keys are allowed"),
    Keyword("maxProperties", "count", "object", "at least the required count"),
    Keyword("items", "schema or bool", "array"),
    Keyword("prefixItems", "schemas", "array"),
    Keyword("minItems", "count", "array", "at most the prefixItems count where items is absent or false"),
    Keyword("maxItems", "count", "array"),
    Keyword("minLength", "count", "string", "not beside pattern or format; string keywords need a type"),
    Keyword("maxLength", "count", "string", "not beside pattern or format"),
    Keyword("pattern", "regex", "string", "no lookaround, no backreference, no literal quote, backslash or "
            "control character (classes and ranges over them are fine); matched as a whole (^ and $ only at its "
            "ends or beside a top-level alternation; no \\A, \\Z, \\b, \\B); read by Python's re too; not "
            "beside format"),
    Keyword("format", "format", "string", "email, uuid, ipv6 (xgrammar's date admits Sep 31, its ipv4 leading "
            "zeros: use a pattern)"),
    Keyword("minimum", "number", "number", "number keywords need a type; bounds at most 6 decimals; on an integer "
            "whole, within +-2^63"),
    Keyword("maximum", "number", "number"),
    Keyword("exclusiveMinimum", "number", "number"),
    Keyword("exclusiveMaximum", "number", "number"),
    Keyword("multipleOf", "number", "number", "integers only (type: integer), not beside a minimum or maximum"),
)
SUPPORTED = {k.name: k for k in KEYWORDS}

UNSUPPORTED: dict[str, str] = {
    "not": "a grammar cannot exclude a language",
    "if": "conditional schemas", "then": "conditional schemas", "else": "conditional schemas",
    "contains": "a grammar cannot count matching items",
    "minContains": "a grammar cannot count matching items",
    "maxContains": "a grammar cannot count matching items",
    "uniqueItems": "a grammar cannot compare items",
    "dependentRequired": "conditional properties", "dependentSchemas": "conditional properties",
    "dependencies": "conditional properties",
    "propertyNames": "not enforced by the grammar",
    "unevaluatedItems": "not enforced by the grammar", "unevaluatedProperties": "not enforced by the grammar",
    "contentEncoding": "not enforced by the grammar", "contentMediaType": "not enforced by the grammar",
    "contentSchema": "not enforced by the grammar",
    "$dynamicRef": "dynamic references", "$recursiveRef": "dynamic references",
}

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$vocabulary", "$dynamicAnchor",
                         "$recursiveAnchor",
                         "discriminator"})   # OpenAPI's (Pydantic writes it beside oneOf); the oneOf validates

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# The formats whose grammar matches the format exactly (checked against jsonschema's format checker).
FORMATS = frozenset({"email", "uuid", "ipv6"})
# Lookaround, backreferences (numbered and named): a regular grammar cannot express them.
_NON_REGULAR = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")


def check_json_schema(schema: object, where: str = "schema") -> None:
    """Refuse a schema that is malformed or outside the supported subset.

    Args:
        schema: the decoded schema (an object or a boolean).
        where: the path to name in messages (e.g.
            ``response_format.json_schema.schema``).

    Raises:
        ValueError: ``"<where><path>: invalid JSON schema: <problem>"`` or
            ``"<where><path>: unsupported schema feature '<keyword>' (<why>)"``.
    """
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where}: invalid JSON schema: must be an object or a boolean, "
                         f"got {type(schema).__name__}")
    if schema is False:
        raise _invalid(where, "the schema false admits no value")
    _check_node(schema, where, 0)
    for path, ref in _keyword_values(schema, where, "local ref"):
        _check_ref(schema, ref, path)
    for path, branches in _keyword_values(schema, where, "schemas", "oneOf"):
        if any(isinstance(b, dict) and "$ref" in b for b in branches):
            check_one_of([_dereferenced(schema, b, path) for b in branches], path)


def _dereferenced(root: object, node: object, path: str) -> object:
    """``node`` with its chain of ``$ref`` followed (each checked by ``_check_ref``)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        node = _resolve(root, node["$ref"], path)
    return node


def regex_values(schema: object, where: str = "schema"):
    """(path, regex) of every regex of a schema that ``check_json_schema`` passed: each ``pattern``, and each
    name of ``patternProperties`` (path as ``check_json_schema`` names it). Where a compile refuses a regex, the
    compile tries them one by one to name the one at fault."""
    yield from _keyword_values(schema, where, "regex")
    for path, names in _keyword_values(schema, where, "schema map", "patternProperties"):
        for name in names:
            yield f"{path}.{name}", name


def _keyword_values(node: object, path: str, form: str, name: str | None = None):
    """(path, value) of the keywords of ``form`` (and ``name``) at any depth of a checked schema: keywords are
    told from property names by the table, as ``_check_node`` walks."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        kw = SUPPORTED.get(key)
        if kw is None:
            continue
        if kw.value == form and name in (None, key):
            yield f"{path}.{key}", value
        if kw.value in ("schema", "schema or bool"):
            yield from _keyword_values(value, f"{path}.{key}", form, name)
        elif kw.value == "schemas":
            for i, sub in enumerate(value):
                yield from _keyword_values(sub, f"{path}.{key}[{i}]", form, name)
        elif kw.value == "schema map":
            for sub_name, sub in value.items():
                yield from _keyword_values(sub, f"{path}.{key}.{sub_name}", form, name)


def _check_ref(root: object, ref: str, path: str) -> None:
    """A local ``$ref`` must point into the schema: ``#`` or a JSON pointer ``#/...`` (RFC 6901: ``~1`` is
    ``/``, ``~0`` is ``~``; percent-escapes of the URI fragment decoded) that resolves, and not only to
    references that come back to it (``{"$ref": "#"}``: no schema content; a ``$ref`` has no sibling
    assertion, ``check_node_combination``)."""
    seen = []
    node = _resolve(root, ref, path)
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if ref in seen:
            raise _invalid(path, f"reference {seen[0]!r} leads only to references back to itself "
                                 f"({' -> '.join(seen + [ref])}): no schema content")
        seen.append(ref)
        ref = node["$ref"]
        node = _resolve(root, ref, path)


def _resolve(root: object, ref: str, path: str) -> object:
    """The subschema ``ref`` points to (checked as ``_check_ref`` says)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise ValueError(f"{path}: unsupported schema feature: reference {ref!r} (only '#' and JSON pointers "
                         "'#/...' into this schema)")
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _invalid(path, f"reference {ref!r} points to nothing in this schema (no {part!r})")
    if not isinstance(node, (dict, bool)):
        raise _invalid(path, f"reference {ref!r} points to a {type(node).__name__}, not a schema")
    return node


def _invalid(path: str, problem: str) -> ValueError:
    return ValueError(f"{path}: invalid JSON schema: {problem}")


def _check_node(node: object, path: str, depth: int) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise _invalid(path, f"a schema must be an object or a boolean, got {type(node).__name__}")
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: unsupported schema: nested deeper than {MAX_DEPTH} levels")
    asserted = set()
    for key, value in node.items():
        if key in ANNOTATIONS:
            continue
        if key in UNSUPPORTED:
            if key == "uniqueItems" and value is False:
                continue  # the default: constrains nothing
            raise ValueError(f"{path}: unsupported schema feature '{key}' ({UNSUPPORTED[key]})")
        kw = SUPPORTED.get(key)
        if kw is None:
            raise ValueError(f"{path}: unsupported schema feature '{key}' (not a keyword of the supported subset)")
        _check_value(kw, value, f"{path}.{key}", depth)
        asserted.add(key)
    _check_combination(node, path)
    check_node_combination(node, path, frozenset(asserted))


def _check_boolean(sub: object, path: str, any_bool: bool = False) -> None:
    """A boolean schema where the grammar takes none (xgrammar refused it naming no path): ``false`` anywhere but
    ``items`` and ``additionalProperties`` (and at the root), either boolean as a ``prefixItems`` entry."""
    if sub is False or any_bool and isinstance(sub, bool):
        raise ValueError(f"{path}: unsupported schema feature: the boolean schema {json.dumps(sub)} here (the "
                         "grammar takes false only as items or additionalProperties; leave the property or branch "
                         "out, or write {} for any value)")


def _check_value(kw: Keyword, value: object, path: str, depth: int) -> None:  # noqa: C901 - one case per form
    form = kw.value
    if form == "schema or bool" or form == "schema":
        _check_node(value, path, depth + 1)
    elif form == "schemas":
        if not isinstance(value, list) or not value:
            raise _invalid(path, "must be a non-empty array of schemas")
        if kw.name == "allOf" and len(value) > 1:
            raise ValueError(f"{path}: unsupported schema feature 'allOf' with more than one schema")
        for i, sub in enumerate(value):
            _check_boolean(sub, f"{path}[{i}]", kw.name == "prefixItems")
            _check_node(sub, f"{path}[{i}]", depth + 1)
    elif form == "schema map":
        if not isinstance(value, dict):
            raise _invalid(path, "must be an object of schemas")
        for name, sub in value.items():
            if kw.name == "patternProperties":
                _check_regex(name, f"{path}.{name}")
            _check_boolean(sub, f"{path}.{name}")
            _check_node(sub, f"{path}.{name}", depth + 1)
    elif form == "count":
        if not _is_int(value) or value < 0:
            raise _invalid(path, f"must be a non-negative integer, got {value!r}")
    elif form == "number":
        if not _is_number(value):
            raise _invalid(path, f"must be a number, got {value!r}")
        if kw.name == "multipleOf" and value <= 0:
            raise _invalid(path, f"must be greater than 0, got {value!r}")
    elif form == "regex":
        if not isinstance(value, str):
            raise _invalid(path, f"must be a string, got {value!r}")
        _check_regex(value, path)
    elif form == "format":
        if value not in FORMATS:
            raise ValueError(f"{path}: unsupported schema feature 'format' {value!r} (supported: "
                             f"{', '.join(sorted(FORMATS))}; use a pattern)")
    elif form == "type":
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(t, str) and t in TYPES for t in names):
            raise _invalid(path, f"must be one of {sorted(TYPES)} or a list of them, got {value!r}")
    elif form == "names":
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise _invalid(path, "must be an array of strings")
    elif form == "values":
        if not isinstance(value, list) or not value:
            raise _invalid(path, "must be a non-empty array")
    elif form == "local ref":
        if not isinstance(value, str):
            raise _invalid(path, f"must be a string, got {value!r}")
        if not value.startswith("#"):
            raise ValueError(f"{path}: unsupported schema feature: remote reference {value!r}")


def _check_combination(node: dict, path: str) -> None:
    """Rules between keywords of one schema (each a way xgrammar 0.2 would
    produce output that breaks the schema)."""
    for key in ("minLength", "maxLength"):
        for other in ("pattern", "format"):
            if key in node and other in node:
                raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' beside '{other}' "
                                 "(the grammar would ignore the length)")
    if "multipleOf" in node and node.get("type") != "integer":
        raise ValueError(f"{path}.multipleOf: unsupported schema feature 'multipleOf' on a non-integer "
                         "(needs type: integer)")
    step = node.get("multipleOf")
    if isinstance(step, float) and not step.is_integer() and step > 0:
        # the grammar ignores a fractional step on an integer: harmless when every integer is a multiple
        # (0.5, 1e-7: p/q with p = 1), else the integers it allows are the multiples of p (1.5 = 3/2: of 3)
        whole = Fraction(repr(step)).numerator
        if whole != 1:
            raise ValueError(f"{path}.multipleOf: unsupported schema feature 'multipleOf' {step!r} on an integer "
                             f"(the grammar ignores a fractional step; write multipleOf {whole}, the same meaning)")
    bound = next((k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node), None)
    if "multipleOf" in node and bound is not None:
        raise ValueError(f"{path}.multipleOf: unsupported schema feature 'multipleOf' beside '{bound}' "
                         "(the grammar would ignore multipleOf)")
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                      ("minProperties", "maxProperties")):
        if low in node and high in node and node[low] > node[high]:
            raise _invalid(f"{path}.{low}", f"{low} {node[low]!r} is greater than {high} {node[high]!r} "
                                            "(no value can match)")
    required = node.get("required") or []
    if "maxProperties" in node and node["maxProperties"] < len(set(required)):
        raise _invalid(f"{path}.maxProperties", f"maxProperties {node['maxProperties']!r} is less than the "
                                               f"{len(set(required))} required properties (no value can match)")
    props = node.get("properties") or {}
    for name in required:
        if name not in props:
            raise ValueError(f"{path}.required: unsupported schema: required property {name!r} is not in "
                             "properties (a strict grammar only writes listed properties)")


def _check_regex(pattern: str, path: str) -> None:
    found = _NON_REGULAR.search(pattern)
    if found:
        raise ValueError(f"{path}: unsupported schema feature 'pattern' with {found.group(0)!r} (lookaround and "
                         "backreferences are not regular: a grammar cannot enforce them)")
    if (unsafe := json_unsafe_literal(pattern)) is not None:
        raise ValueError(f"{path}: unsupported schema feature 'pattern' with {unsafe!r}: it names a character a "
                         "JSON string writes escaped (a quote, a backslash or a control character), which the "
                         "grammar matches unescaped, so no valid answer could be written (a class that excludes "
                         "it, or a range over it, is fine)")
    try:       # the answer check (engine/serving/answer_check.py) reads it with Python's re: it crashed on \z
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise ValueError(f"{path}: pattern {pattern!r} is not a regex Python's re reads ({e}), which checks each "
                         "finished answer") from None
    if (anchor := misplaced_anchor(pattern)) is not None:
        raise ValueError(f"{path}: unsupported schema feature 'pattern' with {anchor!r} there: the grammar matches "
                         "the pattern as a whole and reads no anchor inside it (^ only at its start and $ only at "
                         "its end, or beside a top-level |; no \\A, \\Z, \\b, \\B), so the answer check would "
                         "refuse every answer")


def misplaced_anchor(pattern: str) -> str | None:
    """The first anchor of ``pattern`` the grammar cannot enforce: ``\\A``, ``\\Z``, ``\\b``, ``\\B`` anywhere
    (xgrammar reads the letters), a ``^`` other than at the start or after a top-level ``|``, a ``$`` other than
    at the end or before one (xgrammar drops them; Python's re, which checks the answer, does not: ``ab$c`` matches
    nothing there). Inside a class or escaped they are characters. None when there is none."""
    i, n, depth, in_class = 0, len(pattern), 0, False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if not in_class and pattern[i + 1:i + 2] in ("A", "Z", "b", "B"):
                return pattern[i:i + 2]
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, i = True, i + 1 + (pattern[i + 1:i + 2] == "^")
            i += pattern[i:i + 1] == "]"          # a ] first in a class is a character
            continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "^" and not (i == 0 or depth == 0 and pattern[i - 1] == "|"):
            return "^"
        elif c == "$" and not (i == n - 1 or depth == 0 and pattern[i + 1:i + 2] == "|"):
            return "$"
        i += 1
    return None


# Escapes that name one character (code point): a JSON string writes " \ and U+0000-U+001F escaped.
_CHAR_ESCAPES = {'"': 0x22, "\\": 0x5C, "n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "a": 7, "e": 27, "0": 0}
_HEX_ESCAPE = re.compile(r"\\(?:x\{([0-9a-fA-F]+)\}|x([0-9a-fA-F]{2})|u\{([0-9a-fA-F]+)\}|u([0-9a-fA-F]{4})"
                         r"|c([A-Za-z]))")


def json_unsafe_literal(pattern: str) -> str | None:
    """The first piece of ``pattern`` that names, outside a negated class and not as a range's end, a character a
    JSON string writes escaped (``"``, ``\\`` or U+0000-U+001F: a literal, or an escape such as ``\\"``,
    ``\\n``, ``\\x01``); None when there is none. xgrammar (0.1.x) matches a pattern against the string's
    characters as written, so such a literal is written raw (``{"a": ""b""}``: invalid JSON, a trial's pattern
    ``^\\"[a-z]\\"$``); its ``.``, classes and ranges leave these characters out (tested in
    ``tests/engine/test_json_schema_subset.py``)."""
    i, n, in_class = 0, len(pattern), None   # in_class: None outside a class, else whether it is positive
    while i < n:
        c, size, code = pattern[i], 1, None
        if in_class is None and c == "[":
            negated = pattern[i + 1:i + 2] == "^"
            i += 2 + negated if pattern[i + 1 + negated:i + 2 + negated] == "]" else 1 + negated
            in_class = not negated
            continue
        if in_class is not None and c == "]":
            in_class, i = None, i + 1
            continue
        if c == "\\":
            hexed = _HEX_ESCAPE.match(pattern, i)
            if hexed:
                size = hexed.end() - i
                digits = next(g for g in hexed.groups() if g)
                code = ord(digits.upper()) % 32 if hexed.group(5) else int(digits, 16)
            else:
                size, code = 2, _CHAR_ESCAPES.get(pattern[i + 1:i + 2])
        elif in_class is None and c == '"' or ord(c) < 0x20:
            code = ord(c)
        ranged = in_class is not None and (pattern[i + size:i + size + 1] == "-" and pattern[i + size + 1:i + size + 2]
                                           not in ("", "]") or i > 1 and pattern[i - 1] == "-"
                                           and pattern[i - 2] not in "[^")
        if code is not None and (code < 0x20 or code in (0x22, 0x5C)) and in_class is not False and not ranged:
            return pattern[i:i + size]
        i += size
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def markdown_table() -> str:
    """The supported subset as the docs' markdown table (a test pins
    docs/app-teams/structured-outputs-reference.md's copy to this text)."""
    rows = ["| keyword | value | constrains | limit |", "|---|---|---|---|"]
    rows += [f"| `{k.name}` | {k.value} | {k.applies_to} | {k.limit} |" for k in KEYWORDS]
    refused = ", ".join(f"`{name}`" for name in UNSUPPORTED)
    rows.append("")
    rows.append(f"Refused with a 400 naming the keyword and its path: {refused}, any keyword not above "
                f"(annotations excepted: {', '.join(f'`{a}`' for a in sorted(ANNOTATIONS))}).")
    return "\n".join(rows)
