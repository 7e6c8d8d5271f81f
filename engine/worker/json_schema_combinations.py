"""Rules between the keywords of one schema node: where xgrammar would accept a combination of supported
keywords and still write a value that breaks the schema, the combination is refused with the keyword and
its path (``json_schema_subset.check_json_schema`` calls ``check_node_combination`` on every node).

Each rule is a way the grammar is known to break the promise (found by the property test
``tests/engine/test_json_schema_vocabulary.py``, which draws schemas from the whole validation vocabulary
and validates every sampled answer with ``jsonschema``):

* an applicator (``$ref``, ``anyOf``, ``oneOf``, ``allOf``) beside another assertion: the grammar applies
  only one of them (``{"type": "object", "$ref": ...}`` wrote the referenced integer);
* a string, number, array-count or object-count keyword without a ``type``: the grammar ignores it
  (``{"minimum": 3}`` wrote ``-1``, ``{"minItems": 2}`` wrote ``[]``);
* ``enum``/``const`` values that the node's other keywords refuse: the grammar writes the listed values
  whatever the rest says (``{"type": "string", "enum": [1, 2]}`` wrote ``2``), and a value no other
  keyword admits makes the schema unsatisfiable;
* number bounds with more than 6 decimals: xgrammar's numeric ranges stop at 6 decimals
  (``minimum: 1e-7`` wrote ``""``); exclusive number bounds past 1e9 (``exclusiveMinimum: 1e16`` wrote
  ``10000000000000000.000001``, which reads back as 1e16);
* integer bounds the grammar cannot take (xgrammar refuses them with its own message, naming no path):
  a fractional bound on ``type: integer`` is refused with the whole bound of the same meaning to write
  instead (``minimum: 0.5`` is ``minimum: 1``, ``exclusiveMinimum: 2.5`` is ``minimum: 3``, ``maximum: 1.5``
  is ``maximum: 1``; refused, not rewritten, so the grammar always enforces the schema as sent); beside
  ``number`` in a type list, refused (split it with ``anyOf``); a bound on an integer beyond +-2^63 (int64:
  the grammar cannot enforce it); bounds that leave no value (``minimum 0, exclusiveMaximum 0``), refused
  as unsatisfiable;
* ``enum``/``const`` integers beyond +-2^63 (written as rounded floats), and a number range that holds no
  number of at most 6 decimals (exclusive 0 to 0.000001 wrote ``{"a": }``);
* ``pattern`` beside ``format``: the grammar applies one (``^[a-c]{1,3}$`` with ``email`` wrote an email);
* ``minItems`` above the ``prefixItems`` count where ``items`` is absent or false: the grammar writes no
  other item (strict, as absent ``additionalProperties``) and refuses the schema; ``maxItems`` below that
  count: the grammar refuses it;
* ``minProperties`` above the number of ``properties`` where no other key is allowed: unsatisfiable;
* ``minProperties`` above the required count where keys outside ``properties`` are allowed: the grammar
  may repeat a key, so it cannot count distinct keys (``{"k1": 1, "k1": 2, "k1": 3}``);
* a ``patternProperties`` regex that matches a name of ``properties`` (that key must satisfy both, the
  grammar applies one), or several ``patternProperties`` (a key matching two must satisfy both);
* ``oneOf`` whose branches are not disjoint by type, by value or by a required property's values (a
  discriminated union): the grammar enforces it as ``anyOf``.
"""

from __future__ import annotations

import decimal
import math
import re

APPLICATORS = ("$ref", "anyOf", "oneOf", "allOf")
# Keywords that assert nothing about the instance beside an applicator (annotations are skipped earlier).
_NEUTRAL = frozenset({"$defs", "definitions"})
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY_KEYWORDS = ("minItems", "maxItems")
_OBJECT_KEYWORDS = ("minProperties", "maxProperties", "patternProperties", "additionalProperties")
# What a keyword's type is called in messages (properties, required, items, prefixItems imply their type).
_TYPE_OF = {**dict.fromkeys(_STRING_KEYWORDS, "string"), **dict.fromkeys(_NUMBER_KEYWORDS, "number or integer"),
            **dict.fromkeys(_ARRAY_KEYWORDS, "array"), **dict.fromkeys(_OBJECT_KEYWORDS, "object")}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_DECIMALS = 6   # xgrammar's number ranges: a bound needing more digits is not enforced
# An exclusive number bound this large: the least value the grammar writes past it (bound + 1e-6) reads back
# as the bound itself (a double's spacing there is over 2e-6), so the bound is not enforced.
MAX_EXCLUSIVE_NUMBER = 1e9
INT64_BOUND = 2 ** 63   # an integer bound outside [-2^63, 2^63): past xgrammar's int64


def check_node_combination(node: dict, path: str, asserted: frozenset[str]) -> None:
    """Refuse a combination of keywords in one node that the grammar would not enforce exactly.

    Args:
        node: one schema object whose keywords each passed their own check.
        path: its path in messages (``response_format.json_schema.schema.properties.a``).
        asserted: the node's keywords that constrain the instance (annotations left out).

    Raises:
        ValueError: ``"<path>.<keyword>: unsupported schema ..."`` or ``"<path>.<keyword>: invalid JSON
            schema: ..."`` naming the keyword at fault.
    """
    _check_applicators(node, path, asserted)
    _check_typed_keywords(node, path)
    _check_values_against_siblings(node, path)
    _check_number_precision(node, path)
    _check_integer_bounds(node, path)
    _check_empty_range(node, path)
    _check_key_counting(node, path)
    _check_item_counting(node, path)
    _check_pattern_properties(node, path)
    _check_one_of(node, path)
    if "pattern" in node and "format" in node:
        raise ValueError(f"{path}.pattern: unsupported schema feature 'pattern' beside 'format' (the grammar "
                         "applies only one of them)")


def _check_applicators(node: dict, path: str, asserted: frozenset[str]) -> None:
    present = [k for k in APPLICATORS if k in asserted]
    if not present:
        return
    others = sorted(asserted - _NEUTRAL - {present[0]})
    if others:
        raise ValueError(f"{path}.{present[0]}: unsupported schema feature '{present[0]}' beside '{others[0]}' "
                         f"(the grammar applies only one of them: move '{others[0]}' into the subschemas)")


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if t is None:
        return None
    return set(t) if isinstance(t, list) else {t}


def _check_typed_keywords(node: dict, path: str) -> None:
    types = _types(node)
    if types is not None or "enum" in node or "const" in node:
        return
    for key, wanted in _TYPE_OF.items():
        if key in node:
            raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' without a 'type' "
                             f"(the grammar enforces it only beside type: {wanted})")


def _check_values_against_siblings(node: dict, path: str) -> None:
    """Each ``enum``/``const`` value must pass the node's other keywords: the grammar writes the listed
    values as they are."""
    import jsonschema  # lazy: only schemas with enum/const need it

    for key in ("const", "enum"):
        big = _int_past_int64(node[key]) if key in node else None
        if big is not None:
            raise ValueError(f"{path}.{key}: unsupported schema: integer {big} in '{key}' is beyond +-2^63 (the "
                             "grammar writes it as a rounded float: a trial's 2^70 + 1 came back 1.18e+21)")
    if "$ref" in repr(node):
        return   # a reference inside: left to the grammar (jsonschema alone cannot resolve it here)
    for key in ("const", "enum"):
        if key not in node:
            continue
        rest = {k: v for k, v in node.items() if k not in (key, "$defs", "definitions")}
        if not rest:
            continue
        values = [node[key]] if key == "const" else node[key]
        validator = jsonschema.Draft202012Validator(rest)
        bad = [v for v in values if not validator.is_valid(v)]
        if bad and len(bad) == len(values):
            raise ValueError(f"{path}.{key}: invalid JSON schema: no value of '{key}' passes the other keywords "
                             f"({bad[0]!r} does not: no value can match)")
        if bad:
            raise ValueError(f"{path}.{key}: unsupported schema: value {bad[0]!r} of '{key}' does not pass the "
                             "other keywords (the grammar would write it): leave it out")


def _int_past_int64(value: object) -> int | None:
    """The first integer outside [-2^63, 2^63) in a JSON value (nested in arrays and objects too), else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if not -INT64_BOUND <= value < INT64_BOUND else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((big for v in items if (big := _int_past_int64(v)) is not None), None)


def _decimals(value: float | int) -> int:
    exponent = decimal.Decimal(repr(value)).as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def _check_number_precision(node: dict, path: str) -> None:
    for key in _BOUNDS:
        if key in node and _decimals(node[key]) > MAX_DECIMALS:
            raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' {node[key]!r} with more than "
                             f"{MAX_DECIMALS} decimals (the grammar's number ranges would not enforce it)")
    if "number" in (_types(node) or ()):
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and abs(node[key]) >= MAX_EXCLUSIVE_NUMBER:
                raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' {node[key]!r} on a number "
                                 f"beyond {MAX_EXCLUSIVE_NUMBER:g} (the least number past it reads back as the "
                                 "bound: use minimum/maximum)")


def _whole_equivalent(key: str, value: float) -> str:
    """The whole integer bound of the same meaning as a fractional ``key: value`` (e.g. ``minimum 3``)."""
    low = key in ("minimum", "exclusiveMinimum")
    return f"{'minimum' if low else 'maximum'} {math.ceil(value) if low else math.floor(value)}"


def _check_integer_bounds(node: dict, path: str) -> None:
    types = _types(node) or set()
    if "integer" not in types:
        return
    for key in _BOUNDS:
        if key not in node:
            continue
        value = node[key]
        if not -INT64_BOUND <= value < INT64_BOUND:
            raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' {value!r} on an integer beyond "
                             "+-2^63 (the grammar's integers are int64: it cannot enforce the bound)")
        if float(value).is_integer():
            continue
        if "number" in types:
            raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' {value!r} (not whole) with both "
                             "integer and number in type (the grammar takes only whole bounds on integers: "
                             "split the types with anyOf)")
        raise ValueError(f"{path}.{key}: unsupported schema feature '{key}' {value!r} (not whole) on an integer "
                         f"(the grammar takes only whole bounds on integers: write {_whole_equivalent(key, value)}, "
                         "the same meaning)")


def _check_empty_range(node: dict, path: str) -> None:
    """Bounds that leave no number (``minimum 0, exclusiveMaximum 0``) or no integer (``exclusiveMinimum 1,
    exclusiveMaximum 2``): unsatisfiable (xgrammar refuses them as "Invalid range: empty range", no path)."""
    lows = [k for k in ("minimum", "exclusiveMinimum") if k in node]
    highs = [k for k in ("maximum", "exclusiveMaximum") if k in node]
    types = _types(node) or set()
    integer = "integer" in types and "number" not in types
    for low in lows:
        for high in highs:
            lo, hi = node[low], node[high]
            empty = lo > hi or (lo == hi and (low, high) != ("minimum", "maximum"))
            if integer and float(lo).is_integer() and float(hi).is_integer():
                whole_lo = int(lo) + (low == "exclusiveMinimum")
                whole_hi = int(hi) - (high == "exclusiveMaximum")
                empty = empty or whole_lo > whole_hi
            if empty:
                raise ValueError(f"{path}.{low}: invalid JSON schema: {low} {lo!r} and {high} {hi!r} leave no "
                                 f"{'integer' if integer else 'number'} (no value can match)")
            if not integer and not _room_for_a_written_number(lo, low == "exclusiveMinimum", hi,
                                                              high == "exclusiveMaximum"):
                raise ValueError(f"{path}.{low}: unsupported schema: {low} {lo!r} and {high} {hi!r} leave no "
                                 f"number of at most {MAX_DECIMALS} decimals, the most the grammar writes (a "
                                 "trial's exclusive 0 to 0.000001 wrote {\"a\": }): widen the range")


def _room_for_a_written_number(lo, lo_open: bool, hi, hi_open: bool) -> bool:
    """Whether a number of at most ``MAX_DECIMALS`` decimals lies in the range from ``lo`` to ``hi`` (each end
    open or closed)."""
    step = decimal.Decimal(1).scaleb(-MAX_DECIMALS)
    low, high = decimal.Decimal(repr(lo)), decimal.Decimal(repr(hi))
    first = (low / step).to_integral_value(decimal.ROUND_CEILING) * step   # the least written number >= lo
    if lo_open and first == low:
        first += step
    return first < high or (first == high and not hi_open)


def _extra_keys_allowed(node: dict) -> bool:
    """Keys outside ``properties`` may be written: absent ``additionalProperties`` means false (strict) where
    ``properties`` is given; an object without ``properties`` takes any keys, as xgrammar compiles it (a trial's
    ``{"minProperties": 1, "maxProperties": 2}`` object was called one "no value can match")."""
    extra = node.get("additionalProperties", False if "properties" in node else True)
    return bool(node.get("patternProperties")) or extra is not False


def _check_item_counting(node: dict, path: str) -> None:
    listed = len(node.get("prefixItems") or [])
    high = node.get("maxItems")
    if high is not None and high < listed:     # xgrammar refused it with its own words, naming no path
        raise ValueError(f"{path}.maxItems: unsupported schema feature 'maxItems' {high} below the {listed} "
                         "prefixItems (the grammar writes each prefix item: list at most maxItems of them)")
    low = node.get("minItems")
    if low is None or node.get("items", False) is not False:
        return
    if low > listed:
        raise ValueError(f"{path}.minItems: unsupported schema feature 'minItems' {low} above the {listed} "
                         "prefixItems where 'items' is absent or false (the grammar then writes no other item, "
                         "as absent additionalProperties: give 'items' a schema)")


def _check_key_counting(node: dict, path: str) -> None:
    low = node.get("minProperties")
    if low is None:
        return
    if not _extra_keys_allowed(node):
        listed = len(node.get("properties") or {})
        if low > listed:
            raise ValueError(f"{path}.minProperties: invalid JSON schema: minProperties {low} is more than the "
                             f"{listed} properties an object may have (additionalProperties is false or absent: "
                             "no value can match)")
        return
    required = len(set(node.get("required") or []))
    if low > required:
        raise ValueError(f"{path}.minProperties: unsupported schema feature 'minProperties' {low} above the "
                         f"{required} required properties where keys outside 'properties' are allowed (the "
                         "grammar may repeat such a key, so it cannot count distinct keys)")


def _check_pattern_properties(node: dict, path: str) -> None:
    patterns = node.get("patternProperties") or {}
    if len(patterns) > 1:
        raise ValueError(f"{path}.patternProperties: unsupported schema feature 'patternProperties' with more "
                         "than one pattern (a key matching two must satisfy both; the grammar applies one)")
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error:
            continue   # left to the grammar's compile, which names it
        for name in node.get("properties") or {}:
            if regex.search(name):
                raise ValueError(f"{path}.patternProperties.{pattern}: unsupported schema feature "
                                 f"'patternProperties' matching property {name!r} (that key must satisfy both "
                                 "schemas; the grammar applies only the one of properties)")


def _branch_values(branch: object) -> list | None:
    if isinstance(branch, dict) and set(branch) == {"const"}:
        return [branch["const"]]
    if isinstance(branch, dict) and set(branch) == {"enum"}:
        return list(branch["enum"])
    return None


def _disjoint_types(branches: list) -> bool:
    seen: set[str] = set()
    for branch in branches:
        types = _types(branch) if isinstance(branch, dict) else None
        if types is None:
            return False
        if "number" in types:
            types = types | {"integer"}
        if "integer" in types:
            types = types | {"number"}
        if seen & types:
            return False
        seen |= types
    return True


def _disjoint_values(branches: list) -> bool:
    seen: list = []
    for branch in branches:
        values = _branch_values(branch)
        if values is None:
            return False
        for v in values:
            if any(v == s and type(v) is type(s) for s in seen):
                return False
        seen += values
    return True


def _required_values(branch: object) -> dict[str, list] | None:
    """An object branch's required properties that take listed values: name -> its ``const`` or ``enum``
    values; None when the branch is not ``type: object`` (a non-object value could match two branches)."""
    if not isinstance(branch, dict) or _types(branch) != {"object"}:
        return None
    props, required = branch.get("properties") or {}, branch.get("required") or []
    return {name: [props[name]["const"]] if "const" in props[name] else list(props[name]["enum"])
            for name in required if isinstance(props.get(name), dict)
            and ("const" in props[name] or isinstance(props[name].get("enum"), list))}


def _disjoint_by_property(branches: list) -> bool:
    """Whether every branch is an object requiring one property whose values no two branches share (a
    discriminated union: Pydantic's ``Field(discriminator=...)``, OpenAPI's ``discriminator``)."""
    maps = [_required_values(b) for b in branches]
    if any(m is None for m in maps):
        return False
    return any(_disjoint_values([{"enum": m[name]} for m in maps])
               for name in set.intersection(*(set(m) for m in maps)))


def check_one_of(branches: list, path: str) -> None:
    """Refuse a ``oneOf`` (at ``path``, its branches with their local ``$ref`` resolved) whose branches are not
    disjoint by type, by value, or by a required property's values: the grammar enforces it as anyOf."""
    if len(branches) < 2 or _disjoint_types(branches) or _disjoint_values(branches) \
            or _disjoint_by_property(branches):
        return
    raise ValueError(f"{path}: unsupported schema feature 'oneOf' with branches not disjoint by type, by value "
                     "or by a required property's const/enum values (the grammar enforces it as anyOf: a value "
                     "could match two); use anyOf or give each branch its own type")


def _check_one_of(node: dict, path: str) -> None:
    branches = node.get("oneOf")
    if not branches or any(isinstance(b, dict) and "$ref" in b for b in branches):
        return   # a branch by reference: checked once the references are (json_schema_subset.check_json_schema)
    check_one_of(branches, f"{path}.oneOf")
