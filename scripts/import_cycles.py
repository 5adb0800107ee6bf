"""Import circles among the package's modules, counting only imports that run when a module is imported.

Reads every ``.py`` under ``src/lightning_gaudi_fsdp`` with :mod:`ast` (nothing is imported), takes the imports at
module level (also inside a module-level ``if``/``try``, but not under ``if TYPE_CHECKING:`` and not inside functions
or classes), and prints each strongly connected group of modules that import one another in a circle, with one circle
through it. Importing ``a.b.c`` also imports the packages ``a`` and ``a.b``, so those count as imported too, except
a package the importing module lies in (Python has started importing it before the module, so that import does
nothing); ``from a import b`` counts as importing ``a.b`` when ``b`` is a module, else as importing ``a`` (also a
package the module lies in: ``b`` must already be defined there).

Run: ``python scripts/import_cycles.py`` (exit code 1 when there is a circle).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lightning_gaudi_fsdp"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _top_level_imports(node.body)
            found += _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _top_level_imports(block)
    return found


def _with_parents(name: str, modules: set[str], importer: str) -> set[str]:
    parts = name.split(".")
    own = importer.split(".")
    ancestors = {".".join(own[:i]) for i in range(1, len(own))}
    return ({".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules) - ancestors


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= _with_parents(alias.name, modules, name)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from pkg import module`` imports that module, else a name of ``pkg``
                full = f"{base}.{alias.name}"
                edges |= _with_parents(full if full in modules else base, modules, name)
                if full not in modules and base in modules:  # a name the package's __init__ must define first
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def one_circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest circle from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                todo.append(nxt)
    return group


def main() -> int:
    graph = import_graph()
    groups = cycles(graph)
    for group in groups:
        print(f"circle among {len(group)} modules: {' -> '.join(one_circle(graph, group))}")
        print(f"  all of: {', '.join(group)}")
    print(f"{len(groups)} import circle(s) among {len(graph)} modules (module-level imports only)")
    return 1 if groups else 0


if __name__ == "__main__":
    raise SystemExit(main())
