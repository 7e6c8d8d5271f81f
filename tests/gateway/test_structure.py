"""The gateway's structure (issue 48): no layer outside ``gateway/backends/`` branches on a backend's kind (it
asks the backend: ``provider()``, ``serves(req)``, ``stream_timeouts``, ``probe``, ``open_chat_stream``,
``endpoints``, ``loading``), the modules of ``gateway/`` import one another without a cycle (every import
counted, those inside functions too), and the values crossing the layers live below all of them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKEND_KINDS = {"local", "openai", "anthropic"}


def kind_branches(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` comparing a ``.kind`` attribute with a backend kind (``==``, ``!=``, ``in``)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides):
            continue
        literals = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
        if literals & BACKEND_KINDS:
            lines.append(node.lineno)
    return lines


def test_no_layer_outside_the_backends_branches_on_a_backends_kind():
    files = [f for f in sorted((ROOT / "gateway").rglob("*.py")) if "backends" not in f.relative_to(ROOT).parts]
    assert len(files) > 50
    found = [f"{f.relative_to(ROOT)}:{line}" for f in files for line in kind_branches(ast.parse(f.read_text()))]
    assert found == []


def test_the_kind_walk_sees_each_form():
    tree = ast.parse('a = b.kind == "local"\nc = "anthropic" != x.kind\nd = y.kind in ("openai", "z")\n'
                     'e = f.kind == "timeout"\n')
    assert kind_branches(tree) == [1, 2, 3]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from a.b import c`` counts ``a.b.c`` when that is a
    module, else ``a.b``), from every import statement of each file."""
    modules = {module_of(f): f for f in (ROOT / package).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {m for t in targets if t.split(".")[0] == package and (m := resolve(t)) and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_gateways_modules_import_one_another_without_a_cycle():
    graph = import_graph("gateway")
    assert len(graph) > 50 and "gateway.backends.local" in graph["gateway.backends.build"]
    assert cycles(graph) == []


def test_the_values_module_imports_no_step_and_only_the_edge_codecs_read_sse():
    """``gateway/values.py`` (the request, the event, the answer) sits below every step; a streamed event's bytes
    are read (``EventReader``) only by the codecs at the edge, which decode each event once."""
    graph = import_graph("gateway")
    assert graph["gateway.values"] == set()
    readers = sorted(module_of(f) for f in (ROOT / "gateway").rglob("*.py")
                     if "EventReader" in f.read_text() and f.name != "sse.py")
    assert readers == ["gateway.translate.anthropic_answer", "gateway.translate.chat_events"]


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
