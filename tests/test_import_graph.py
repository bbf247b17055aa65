"""The import graph: no cycle between modules, and the package never imports benchmarks or tests.

Every ``import`` statement counts, function-local ones included: a cycle hidden inside a
function still couples two modules and breaks as soon as someone hoists the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pass_manager", "passes")
OUTSIDE_THE_PACKAGE = ("benchmarks", "tests")


def module_files(root: Path, top_levels: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module under the given top-level directories."""
    found = {}
    for top in top_levels:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name the module imports, anywhere in its body, relative imports resolved.

    ``from a import b`` yields ``a.b``: ``b`` may be a submodule.
    """
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                package = package if is_package else package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def known_prefix(name: str, modules: set[str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, top_levels: tuple[str, ...]) -> nx.DiGraph:
    """Module -> the modules it imports (the longest known module prefix of each name)."""
    files = module_files(root, top_levels)
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for name in imported_names(module, path):
            target = known_prefix(name, set(files))
            if target is not None and target != module:
                graph.add_edge(module, target)
                # Importing pkg.sub.mod from outside pkg.sub runs pkg/sub/__init__.py first.
                parts = target.split(".")
                for end in range(1, len(parts)):
                    package = ".".join(parts[:end])
                    if not module.startswith(package + ".") and package != module:
                        graph.add_edge(module, package)
            elif target is None and name.split(".")[0] in OUTSIDE_THE_PACKAGE:
                graph.add_edge(module, name)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.simple_cycles(graph))


def test_no_import_cycles_between_modules():
    found = cycles(import_graph(ROOT, (*PACKAGES, "benchmarks")))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_package_never_imports_benchmarks_or_tests():
    graph = import_graph(ROOT, (*PACKAGES, *OUTSIDE_THE_PACKAGE))
    bad = sorted(
        f"{module} imports {target}"
        for module, target in graph.edges
        if module.split(".")[0] in PACKAGES and target.split(".")[0] in OUTSIDE_THE_PACKAGE
    )
    assert not bad, "\n".join(bad)


def test_no_test_module_imports_another_test_module():
    """Shared test helpers live in a conftest or a helper module, never in a test module."""
    graph = import_graph(ROOT, ("tests",))
    bad = sorted(
        f"{module} imports {target}"
        for module, target in graph.edges
        if target.rsplit(".", 1)[-1].startswith("test_")
    )
    assert not bad, "\n".join(bad)


def test_walker_sees_function_local_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "c.py").write_text("import pkg.sub.d\n")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "sub" / "b.py").write_text(
        "def f():\n    from .. import a\n    import benchmarks.models\n    return a\n"
    )
    (package / "sub" / "d.py").write_text("")
    graph = import_graph(tmp_path, ("pkg",))
    # pkg.c -> pkg.sub.d runs pkg/sub/__init__.py, which imports b; nothing imports c back.
    assert ("pkg.c", "pkg.sub") in graph.edges
    assert cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b"], ["pkg.a", "pkg.sub.b"]]
    assert ("pkg.sub.b", "benchmarks.models") in graph.edges
