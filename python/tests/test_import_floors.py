"""The modules of the usbwire package stand on floors: none imports one that
(directly or through others) imports it back.

An import circle is where something lives above a module that needs it (the
lower module cannot be read alone, and nothing moves without the whole
circle). This reads every module of ``python/usbwire`` with :mod:`ast`, with
every import among the package's own modules: absolute (``usbwire.x``) and
relative, at the top and inside functions (an import moved into a function
hides a circle from the interpreter; it does not remove it), and fails
naming the circle. ``from PACKAGE import NAME`` counts as an import of the
module ``PACKAGE.NAME`` when there is one, else of the package's
``__init__``. The Rust crates have the same guard in
``crates/testing/tests/module_floors.rs``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE = Path(__file__).resolve().parent.parent / "usbwire"

Graph = Dict[str, Set[str]]


def modules_of(package: Path) -> Dict[str, Path]:
    """Every module of ``package`` by dotted name; a package by its own name (its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package's modules that the module ``name`` (at ``path``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: Set[str] = set()

    def module_or_package(dotted: str) -> Optional[str]:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = module_or_package(alias.name)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                target = module_or_package(f"{source}.{alias.name}") or module_or_package(source)
                if target:
                    found.add(target)
    found.discard(name)
    return found


def graph_of(package: Path) -> Graph:
    modules = modules_of(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: Graph) -> List[List[str]]:
    """Groups of modules that reach each other (Tarjan's strongly connected components), larger than one."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in sorted(graph.get(node, ())):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def floors(graph: Graph) -> Dict[str, int]:
    """Each module's floor: 0 if it imports none of the package, else one above the highest it imports."""
    known: Dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in known:
            known[node] = max((floor(after) + 1 for after in graph.get(node, ())), default=0)
        return known[node]

    for node in graph:
        floor(node)
    return known


def test_the_package_has_no_import_circle():
    graph = graph_of(PACKAGE)
    assert "usbwire.device.core" in graph and "usbwire.facedancer.backend" in graph, sorted(graph)
    found = circles(graph)
    described = [
        "\n".join(f"  {member} -> {', '.join(sorted(graph[member] & set(circle)))}" for member in circle)
        for circle in found
    ]
    assert not found, "python/usbwire has import circles; move what several modules share below them:\n" + "\n\n".join(
        described
    )
    # Each module imports only from floors below its own.
    on = floors(graph)
    assert all(on[after] < on[name] for name, imports in graph.items() for after in imports)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("import os\nA = 1\n\ndef late():\n    from .sub import b\n    return b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from .. import a\nfrom ..c import C\nimport pkg.sub.d\nfrom pkg import A\n")
    (package / "c.py").write_text("C = 1\n")
    (package / "sub" / "d.py").write_text("from . import e\n")
    graph = graph_of(package)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},
        "pkg.c": set(),
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg", "pkg.a", "pkg.c", "pkg.sub.d"},
        "pkg.sub.d": {"pkg.sub"},
    }
    assert circles(graph) == [["pkg", "pkg.a", "pkg.sub.b"]]
    assert floors({"x": {"y"}, "y": {"z"}, "z": set()}) == {"x": 2, "y": 1, "z": 0}
