"""The configuration reference, generated from the schema (``schema.py``): every key's path, type, default,
bounds and meaning, so the documentation cannot name a key the gateway does not read.

``python -m gateway.config.reference > docs/operators/configuration.md`` writes the page (``make docs`` does);
``tests/gateway/config/test_reference.py`` keeps the page, ``config.example.yaml`` (which shows every key with
a comment) and the key paths the docs name in step with the schema. A key's meaning is the comment beside its
field in ``schema.py``, else the comment beside it in ``config.example.yaml``.

Paths: ``a.b`` for nested settings, ``<name>`` for a map's keys (``routes.<name>.targets``), ``[]`` for a list's
items (``models[].name``).
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gateway.config import EXAMPLE_CONFIG
from gateway.config.schema import READ_AT_START, GatewayConfig

EXAMPLE = Path(EXAMPLE_CONFIG)


@dataclass
class Node:
    """A place in the config: a model's settings (``children``), a map or list of models (``item``), or a leaf
    (anything else: a scalar, a list of strings, a free map such as a rule's ``match``). ``owner`` and ``name``
    say which model field it is."""

    kind: str                                   # "model" | "map" | "list" | "leaf"
    owner: str = ""
    name: str = ""
    type: str = ""
    default: str = ""
    bounds: str = ""
    doc: str = ""
    children: dict[str, "Node"] = field(default_factory=dict)
    item: "Node | None" = None
    only_for: tuple[str, ...] = ()


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if typing.get_origin(annotation) is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def _container(annotation: Any) -> tuple[str, list[type[BaseModel]]] | None:
    """("map", models) for a map of models, ("list", models) for a list of models, else None."""
    parts = (list(typing.get_args(annotation))
             if typing.get_origin(annotation) in (typing.Union, types.UnionType) else [annotation])
    for a in parts:
        origin = typing.get_origin(a)
        if origin is dict and _models_in(typing.get_args(a)[1]):
            return "map", _models_in(typing.get_args(a)[1])
        if origin is list and _models_in(typing.get_args(a)[0]):
            return "list", _models_in(typing.get_args(a)[0])
    return None


def _type_name(annotation: Any) -> str:
    text = re.sub(r"gateway\.config\.\w+\.", "", str(annotation).replace("typing.", ""))
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    return re.sub(r"Annotated\[(.*), FieldInfo\(.*\)\]", r"\1", text)


def _default(info) -> str:
    if info.is_required():
        return "required"
    value = info.default if info.default is not PydanticUndefined else info.default_factory()
    if isinstance(value, BaseModel):
        return ""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _bounds(info) -> str:
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length"}
    return ", ".join(f"{sign} {getattr(m, attr)}" for m in info.metadata for attr, sign in names.items()
                     if getattr(m, attr, None) is not None)


def _field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Each field's comment in the schema's source: the comment on its line, else the comment lines above it."""
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls.__module__ != model.__module__:
            continue
        above: list[str] = []
        for line in inspect.getsource(cls).splitlines()[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# ").strip())
                continue
            m = re.match(r"\s{4}(\w+):[^#]*(?:#\s*(.*))?$", line)
            if m and m.group(1) in model.model_fields:
                comments[m.group(1)] = (m.group(2) or " ".join(above)).strip()
            above = []
    return comments


def _model_doc(model: type[BaseModel]) -> str:
    return " ".join((model.__dict__.get("__doc__") or "").split("\n\n")[0].split())


def _node(models: list[type[BaseModel]]) -> Node:
    """The settings of a model, or of a union of models discriminated by ``type`` (each key once, with the
    types that read it when not all do, and per type where the types differ in its type, default or meaning)."""
    node = Node("model")
    variants: dict[str, list[tuple[str, Node]]] = {}
    for model in models:
        comments = _field_comments(model)
        hints = typing.get_type_hints(model, include_extras=True)   # forward references resolved
        kind = typing.get_args(model.model_fields["type"].annotation)[0] if len(models) > 1 else ""
        for name, info in model.model_fields.items():
            annotation = hints.get(name, info.annotation)
            child = Node("leaf", owner=model.__name__, name=name, type=_type_name(annotation),
                         default=_default(info), bounds=_bounds(info), doc=comments.get(name, ""))
            container, sub = _container(annotation), _models_in(annotation)
            if container is not None:
                child.kind, child.item = container[0], _node(container[1])
            elif sub:
                child.kind, child.children = "model", _node(sub).children
                child.doc = child.doc or _model_doc(sub[0])
            variants.setdefault(name, []).append((kind, child))
            node.children.setdefault(name, child)
    for name, read_by in variants.items():
        if len(read_by) > 1 and node.children[name].kind == "leaf":
            node.children[name] = _merged(read_by)
        if len(models) > 1 and len(read_by) < len(models):
            _mark(node.children[name], tuple(k for k, _ in read_by))
    return node


def _merged(read_by: list[tuple[str, Node]]) -> Node:
    """One key several backend types read (``backends.<name>.base_url``): its type the union of theirs (a
    ``Literal``'s values joined), and its default, bounds and meaning each one value, or per type where they differ
    (``required (openai); https://api.anthropic.com/v1 (anthropic)``)."""
    literals = [re.fullmatch(r"Literal\[(.*)\]", leaf.type) for _, leaf in read_by]
    kind = (f"Literal[{', '.join(m.group(1) for m in literals)}]" if all(literals)
            else " | ".join(dict.fromkeys(leaf.type for _, leaf in read_by)))

    def per_type(attr: str) -> str:
        groups: dict[str, list[str]] = {}
        for k, leaf in read_by:
            groups.setdefault(getattr(leaf, attr), []).append(k)
        if len(groups) == 1:
            return next(iter(groups))
        return "; ".join(f"{value} ({', '.join(kinds)})" for value, kinds in groups.items() if value)

    first = read_by[0][1]
    return Node("leaf", owner=first.owner, name=first.name, type=kind, default=per_type("default"),
                bounds=per_type("bounds"), doc=per_type("doc"))


def _mark(node: Node, kinds: tuple[str, ...]) -> None:
    node.only_for = kinds
    for child in node.children.values():
        _mark(child, kinds)


def schema_tree() -> Node:
    """The gateway config's settings as a tree."""
    return _node([GatewayConfig])


def walk(node: Node, prefix: str = "") -> list[tuple[str, Node]]:
    """Every setting below ``node`` with its path, in the schema's order."""
    out: list[tuple[str, Node]] = []
    for name, child in node.children.items():
        path = f"{prefix}{name}"
        out.append((path, child))
        if child.kind == "model":
            out += walk(child, path + ".")
        elif child.kind in ("map", "list"):
            out += walk(child.item, path + (".<name>." if child.kind == "map" else "[]."))
    return out


def resolve(tree: Node, path: str) -> Node | None:
    """The setting a dotted path names (``state.redis_url``, ``backends.local.cost``, ``routes.<name>.slo``,
    ``models[].cache``), or None when the schema has no such key. A map takes any name; a leaf ends the path."""
    node = tree
    for part in re.findall(r"\[\]|[^.\[\]]+", path):
        if node.kind == "leaf":
            return node
        if node.kind == "map":                 # the part is an entry's name
            node = node.item
            continue
        if node.kind == "list":
            node = node.item
            if part == "[]":
                continue
        child = node.children.get(part) if part != "[]" else None
        if child is None:
            return None
        node = child
    return node


# ------------------------------------------------------------------ config.example.yaml
_REAL = re.compile(r"^(\s*)(- )?([A-Za-z_][\w-]*):(?:\s+(.*))?$")
_COMMENTED = re.compile(r"^(\s*)#(\s+)(- )?([a-z_][\w-]*):(?:\s+(.*))?$")


def _split_comment(rest: str) -> tuple[str, str]:
    m = re.search(r"(^|\s)#\s?(.*)$", rest)
    return (rest[:m.start()].strip(), m.group(2).strip()) if m else (rest.strip(), "")


_INLINE_HASH = re.compile(r"\s#")     # the ``#`` of a line's trailing comment


def _comment_continued(key_line: str, line: str) -> str | None:
    """The text of ``line`` when it only goes on with ``key_line``'s comment: its ``#`` in the same column, with
    nothing but blanks (or, in a commented-out block, the block's ``#``) before it; else None."""
    m = _INLINE_HASH.search(key_line, key_line.find(":"))
    if m is None:
        return None
    column = m.end() - 1
    head, hash_, text = line[:column], line[column:column + 1], line[column + 1:]
    return text.strip() if hash_ == "#" and head.strip() in ("", "#") else None


@dataclass
class ExampleKey:
    path: str
    line: int
    comment: str
    node: Node | None


def example_keys(text: str | None = None) -> list[ExampleKey]:
    """Every key ``config.example.yaml`` shows, in force or commented out (``# cache:`` and the lines below it),
    with its schema path (names of map entries as ``<name>``, list items as ``[]``), its comment and its setting
    (None: the schema has no such key). Keys inside a leaf (a rule's ``match``) are not settings and not listed."""
    tree = schema_tree()
    lines = (EXAMPLE.read_text() if text is None else text).splitlines()
    stack: list[tuple[int, str, Node]] = [(-1, "", tree)]      # (indent, path, node) of the enclosing keys
    out: list[ExampleKey] = []
    for number, line in enumerate(lines, 1):
        if out and out[-1].comment and (more := _comment_continued(lines[out[-1].line - 1], line)) is not None:
            out[-1].comment += " " + more          # a comment wrapped onto the next line, aligned under its "#"
            continue
        m, c = _REAL.match(line), _COMMENTED.match(line)
        flow_item = re.match(r"^(\s*)(#\s+)?- (\{.*)$", line)
        if m and not line.lstrip().startswith("#"):
            indent, dash, key, rest = len(m.group(1)), m.group(2), m.group(3), m.group(4) or ""
        elif c:
            indent, dash, key, rest = len(c.group(1)) + len(c.group(2)) - 1, c.group(3), c.group(4), c.group(5) or ""
        elif flow_item:
            indent = len(flow_item.group(1)) + (len(flow_item.group(2)) - 1 if flow_item.group(2) else 0)
            while stack[-1][0] >= indent:
                stack.pop()
            _, path, node = stack[-1]
            value, _ = _split_comment(flow_item.group(3))
            if node.kind == "list":
                _flow(out, path + "[]", node.item, value, number)
            continue
        else:
            continue
        if dash:                                   # "- key:" opens an item of the enclosing list
            while stack[-1][0] >= indent:
                stack.pop()
            _, path, node = stack[-1]
            if node.kind != "list":
                continue
            stack.append((indent, path + "[]", node.item))
            indent += 2
        while stack[-1][0] >= indent:
            stack.pop()
        parent_path, parent = stack[-1][1], stack[-1][2]
        if parent is None or parent.kind == "leaf":
            stack.append((indent, parent_path, parent))
            continue
        path, node = _child(parent_path, parent, key)
        value, comment = _split_comment(rest)
        out.append(ExampleKey(path, number, comment, node))
        stack.append((indent, path, node if node is not None else Node("leaf")))
        if node is not None and value:
            _flow(out, path, node, value, number)
    return out


def _child(parent_path: str, parent: Node, key: str) -> tuple[str, Node | None]:
    prefix = f"{parent_path}." if parent_path else ""
    if parent.kind == "map":
        return f"{prefix}<name>", parent.item
    if parent.kind == "model":
        return f"{prefix}{key}", parent.children.get(key)
    return f"{prefix}{key}", None


def _flow(out: list[ExampleKey], path: str, node: Node, value: str, number: int) -> None:
    """The keys of a flow value (``{input: 0.15, output: 0.60}``, ``[{backend: r1}]``) under ``node``."""
    try:
        data = yaml.safe_load(value)
    except yaml.YAMLError:
        return
    _data_keys(out, path, node, data, number)


def _data_keys(out: list[ExampleKey], path: str, node: Node, data: Any, number: int) -> None:
    if node.kind == "leaf":
        return
    if node.kind == "list" and isinstance(data, list):
        for item in data:
            _data_keys(out, f"{path}[]", node.item, item, number)
    elif node.kind == "map" and isinstance(data, dict):
        for value in data.values():
            _data_keys(out, f"{path}.<name>", node.item, value, number)
    elif node.kind == "model" and isinstance(data, dict):
        for key, value in data.items():
            child_path, child = _child(path, node, str(key))
            out.append(ExampleKey(child_path, number, "", child))
            if child is not None:
                _data_keys(out, child_path, child, value, number)


# ------------------------------------------------------------------ the page
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The configuration reference page."""
    tree = schema_tree()
    examples: dict[tuple[str, str], str] = {}
    for k in example_keys():
        if k.node is not None and k.comment:
            examples.setdefault((k.node.owner, k.node.name), k.comment)
    lines = ["# Configuration reference", "",
             "Generated from the gateway's schema (`gateway/config/schema.py`) by "
             "`python -m gateway.config.reference`: a test fails when this page, `config.example.yaml` (which "
             "shows every key with a comment) or a key path named in these docs drifts from the schema. Unknown "
             "keys are errors at load; a reload validates first and names the key path of each problem.", "",
             "`<name>` stands for a map's key (a route's or a backend's name), `[]` for each item of a list. Sizes "
             "accept `KiB`, `MiB` and `GiB`. Secrets are never in the file: it names environment variables "
             "(`api_key_env`, `token_env`, a virtual key's `env`).", ""]
    section = None
    for path, node in walk(tree):
        top = re.split(r"[.\[]", path)[0]
        if top != section:
            section = top
            lines += ["", f"## `{top}`", "", "| key | type | default | bounds | meaning |", "|---|---|---|---|---|"]
        doc = node.doc or examples.get((node.owner, node.name), "")
        if node.only_for:
            doc += f" (backends of type {', '.join(node.only_for)})"
        if path in READ_AT_START:
            doc += " (read at start: a reload keeps the running value)"
        default = f"`{_cell(node.default)}`" if node.default else ""
        lines.append(f"| `{path}` | `{_cell(node.type)}` | {default} | {_cell(node.bounds)} | {_cell(doc.strip())} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
