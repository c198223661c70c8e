"""The import layers written in k3export/__init__.py's docstring hold, and no module imports itself
back through others (an import cycle), lazy imports inside functions included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import k3export

ROOT = Path(k3export.__file__).parent
PLUGINS = ROOT.parent / "plugins" / "k3plugins"


def floors() -> dict[str, int]:
    """{package or top-level module: floor}, from the docstring's "floor N   names" lines."""
    table = {}
    for number, names in re.findall(r"^\s*floor\s+(\d+)\s+(.+)$", k3export.__doc__, re.MULTILINE):
        for name in names.split():
            table[name] = int(number)
    return table


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The k3export modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the project imports by absolute names"
            # `from k3export.ops import mxfp4` imports the module k3export.ops.mxfp4.
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
    return {name for name in found if name.split(".")[0] == "k3export"}


def graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules) for f in files}


def unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: k3export.check.runners.chain -> check."""
    return module.split(".")[1] if "." in module else ""


def wrong_imports(edges: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Every import that goes up the floors or sideways to another package on the same floor."""
    wrong = []
    for module, imported in sorted(edges.items()):
        if not unit(module):
            continue  # k3export/__init__.py
        assert unit(module) in table, (f"{module} is on no floor: add its package to the table in "
                                       "k3export/__init__.py's docstring")
        for target in sorted(imported):
            if unit(target) != unit(module) and table[unit(target)] >= table[unit(module)]:
                wrong.append(f"{module} (floor {table[unit(module)]}) imports {target} "
                             f"(floor {table[unit(target)]})")
    return wrong


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done or module not in edges:
            return None
        for target in sorted(edges[module]):
            cycle = visit(target, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return None

    return next((c for c in (visit(m, []) for m in sorted(edges)) if c), None)


def test_every_import_goes_down_the_floors() -> None:
    table = floors()
    assert table["check"] > table["engine"] > table["onnx"] > table["model"]  # the table was read
    assert wrong_imports(graph(), table) == []


def test_no_import_cycle() -> None:
    assert find_cycle(graph()) is None


def test_the_plugins_import_nothing_from_k3export() -> None:
    users = [str(f) for f in PLUGINS.rglob("*.py") if imports(f, set())]
    assert not users, users


def test_wrong_imports_are_found(tmp_path: Path) -> None:
    """The checks can fail: a lazy import up the floors, one sideways, and a cycle are all found."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from k3export.check.driver import run_check\n")
    edges = {"k3export.model.k3": imports(lazy, set()),
             "k3export.shards.plan": {"k3export.runtime"},
             "k3export.check.taps": {"k3export.check.compare", "k3export.onnx.taps"}}
    assert wrong_imports(edges, floors()) == [
        "k3export.model.k3 (floor 4) imports k3export.check.driver (floor 9)",
        "k3export.shards.plan (floor 8) imports k3export.runtime (floor 8)"]
    functions, moe = "k3export.onnx.functions", "k3export.onnx.moe"
    assert find_cycle({functions: {moe}, moe: {functions}}) == [functions, moe, functions]


def test_the_readme_states_the_same_floors() -> None:
    """The README's one-line form of the table ("__main__ > cli > ... > errors, progress")."""
    readme = (ROOT.parent / "README.md").read_text().splitlines()
    line = next(text.strip() for text in readme if text.strip().startswith("__main__ > "))
    stated = [set(group.replace(",", " ").split()) for group in reversed(line.split(" > "))]
    table = floors()
    floor_names = [{name for name, f in table.items() if f == floor} for floor in sorted(set(table.values()))]
    assert stated == floor_names
