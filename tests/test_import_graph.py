"""The import graph: the boundaries of the layout, and no cycle between modules.

* no cycle between modules (package and benchmarks);
* the package never imports benchmarks or tests, and no module under tests/ imports
  benchmarks (what both need lives in tests/models, or in the package);
* ``pass_manager`` never imports ``passes``, and has no module about buffers: none named
  for buffers or methods, none defining a shared-buffer condition or facet (running over
  several methods and their shared state lives in ``passes._methods``; the manager offers
  a generic joint-condition hook);
* among package modules only ``passes.inplace_to_functional`` (and the engine's own
  modules) import InplaceToFunctional's engine, ``passes._functionalization``;
* no package module imports ExecuTorch's test backends (``executorch.exir.backend.test``):
  cases built on them are test models (tests/models/executorch_cases.py);
* no test module imports another test module.

Every ``import`` statement counts, function-local ones included: a cycle hidden inside a
function still couples two modules and breaks as soon as someone hoists the import. Each
rule is a function of the checkout's root, so that a test can show it catches a tree that
breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pass_manager", "passes")
OUTSIDE_THE_PACKAGE = ("benchmarks", "tests")
ENGINE = "passes._functionalization"
ENGINE_USERS = ("passes.inplace_to_functional",)
EXECUTORCH_TEST_BACKENDS = "executorch.exir.backend.test"


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


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _edges(graph: nx.DiGraph, source: str, target: str) -> list[str]:
    return sorted(
        f"{module} imports {imported}"
        for module, imported in graph.edges
        if within(module, source) and within(imported, target)
    )


def package_imports_of_tests_or_benchmarks(root: Path) -> list[str]:
    graph = import_graph(root, (*PACKAGES, *OUTSIDE_THE_PACKAGE))
    return sorted(
        edge for package in PACKAGES for outside in OUTSIDE_THE_PACKAGE
        for edge in _edges(graph, package, outside)
    )


def pass_manager_imports_of_passes(root: Path) -> list[str]:
    return _edges(import_graph(root, PACKAGES), "pass_manager", "passes")


BUFFER_WORDS = ("sharedbuffer", "bufferfacet", "bufferdifference", "shareagain",
                "sharedobjects")


def buffer_specific_modules(root: Path) -> list[str]:
    """pass_manager modules named for buffers or methods, or defining a top-level name about
    buffers several programs share."""
    bad = []
    for module, path in module_files(root, ("pass_manager",)).items():
        leaf = module.rsplit(".", 1)[-1].lower()
        if "buffer" in leaf or leaf == "methods":
            bad.append(f"{module} is named for buffers or methods")
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = ([node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else
                       [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)])
            bad += [f"{module} defines {name}" for name in targets
                    if any(word in name.lower().replace("_", "") for word in BUFFER_WORDS)]
    return sorted(bad)


def imports_of_the_engine(root: Path) -> list[str]:
    """Package modules importing passes._functionalization, other than the allowed ones."""
    return sorted(
        f"{module} imports {imported}"
        for module, imported in import_graph(root, PACKAGES).edges
        if within(imported, ENGINE) and not within(module, ENGINE) and module not in ENGINE_USERS
    )


def benchmarks_imported_by_tests(root: Path) -> list[str]:
    return _edges(import_graph(root, OUTSIDE_THE_PACKAGE), "tests", "benchmarks")


def imports_of_executorch_test_backends(root: Path) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, path in module_files(root, PACKAGES).items()
        for name in imported_names(module, path)
        if within(name, EXECUTORCH_TEST_BACKENDS)
    )


def test_no_import_cycles_between_modules():
    found = cycles(import_graph(ROOT, (*PACKAGES, "benchmarks")))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_package_never_imports_benchmarks_or_tests():
    bad = package_imports_of_tests_or_benchmarks(ROOT)
    assert not bad, "\n".join(bad)


def test_pass_manager_never_imports_passes():
    bad = pass_manager_imports_of_passes(ROOT)
    assert not bad, "\n".join(bad)


def test_pass_manager_has_no_buffer_specific_module():
    bad = buffer_specific_modules(ROOT)
    assert not bad, "\n".join(bad)


def test_only_inplace_to_functional_imports_the_functionalization_engine():
    bad = imports_of_the_engine(ROOT)
    assert not bad, "\n".join(bad)


def test_tests_never_import_benchmarks():
    bad = benchmarks_imported_by_tests(ROOT)
    assert not bad, "\n".join(bad)


def test_package_never_imports_executorch_test_backends():
    bad = imports_of_executorch_test_backends(ROOT)
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


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_each_boundary_rule_reports_the_module_that_breaks_it(tmp_path):
    """A tree keeping every rule passes them all; each module added below breaks one rule,
    and only that rule reports it (by module and import)."""
    allowed = {
        "pass_manager/__init__.py": "",
        "pass_manager/core.py": "from . import __name__ as _\n",
        "passes/__init__.py": "from .inplace_to_functional import InplaceToFunctional\n",
        "passes/inplace_to_functional.py": "from ._functionalization.rewrite import Rewrite\n",
        "passes/_functionalization/__init__.py": "",
        "passes/_functionalization/rewrite.py": "from .start import start\n",
        "passes/_functionalization/start.py": "import pass_manager.core\n",
        "passes/executorch.py": "from executorch.exir.backend import partitioner\n",
        "tests/__init__.py": "",
        "tests/models/__init__.py": "",
        "tests/models/cases.py": "import executorch.exir.backend.test.demo_backend\n",
        "tests/test_x.py": "from passes._functionalization import rewrite\n"
                           "from tests.models.cases import x\n",
        "benchmarks/__init__.py": "",
        "benchmarks/bench.py": "from tests.models.cases import x\nimport passes\n",
    }
    _write_tree(tmp_path, allowed)
    rules = {
        "package": package_imports_of_tests_or_benchmarks,
        "pass_manager": pass_manager_imports_of_passes,
        "buffers": buffer_specific_modules,
        "engine": imports_of_the_engine,
        "tests": benchmarks_imported_by_tests,
        "executorch": imports_of_executorch_test_backends,
    }
    assert {name: rule(tmp_path) for name, rule in rules.items()} == {name: [] for name in rules}
    breaking = {
        "package": ("passes/flow.py", "def f():\n    from tests.models import cases\n",
                    "passes.flow imports tests.models.cases"),
        "pass_manager": ("pass_manager/uses.py", "from passes import InplaceToFunctional\n",
                         "pass_manager.uses imports passes"),
        "buffers": ("pass_manager/checks.py", "class SharedBufferError(Exception):\n    pass\n",
                    "pass_manager.checks defines SharedBufferError"),
        "engine": ("passes/other.py", "from ._functionalization.start import start\n",
                   "passes.other imports passes._functionalization"),
        "tests": ("tests/helper.py", "from benchmarks.bench import f\n",
                  "tests.helper imports benchmarks.bench"),
        "executorch": ("passes/demo.py", "from executorch.exir.backend.test import demo_backend\n",
                       "passes.demo imports executorch.exir.backend.test.demo_backend"),
    }
    for name, (path, text, expected) in breaking.items():
        (tmp_path / path).write_text(text)
        found = {rule_name: rule(tmp_path) for rule_name, rule in rules.items()}
        assert expected in found[name], (name, found[name])
        assert not [rule_name for rule_name, bad in found.items() if bad and rule_name != name]
        (tmp_path / path).unlink()


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
