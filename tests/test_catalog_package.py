"""The shape of the metadata layer, read from its source with ``ast``: the catalog is a
package of modules with one job each, none imports a private name of another, and no
module imports (even inside a function) a module that imports it back.

Before issue 28, ``catalog.py`` imported ``sections`` inside seven functions while
``sections.py`` imported catalog's ``_codes``, ``_ipc_file`` and ``_table``: both
checks fail on that layout."""

from __future__ import annotations

import ast
from pathlib import Path

METADATA = Path(__file__).resolve().parents[1] / "metadata"
PACKAGE = "bcp.metadata"


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under ``root`` (the folder of PACKAGE)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([PACKAGE, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for every import in the file,
    at any depth (imports inside functions count: they make cycles too)."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, None) if sub in modules else (target, alias.name))
    return found


def _private(word: str) -> bool:
    return word.startswith("_") and not (word.startswith("__") and word.endswith("__"))


def layer_problems(root: Path) -> tuple[list[str], list[list[str]]]:
    """(private names imported across modules, import cycles) of the package at ``root``."""
    modules = _modules(root)
    private: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, taken in _imports(name, path, modules):
            if target.startswith(PACKAGE) and any(_private(p) for p in target.split(".")):
                private.append(f"{name} imports module {target}")
            if taken is not None and _private(taken) and target != name:
                private.append(f"{name} imports {taken} from {target}")
            if target in modules and target != name:
                graph[name].add(target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n) :], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return private, cycles


def test_no_private_name_crosses_a_module_and_no_import_cycle():
    private, cycles = layer_problems(METADATA)
    assert private == [], private
    assert cycles == [], cycles


def test_the_catalog_is_a_package_of_small_modules():
    modules = _modules(METADATA)
    package = sorted(m for m in modules if m.startswith(f"{PACKAGE}.catalog."))
    assert f"{PACKAGE}.catalog" in modules and modules[f"{PACKAGE}.catalog"].name == "__init__.py"
    assert {f"{PACKAGE}.catalog.{m}" for m in ("core", "sections", "tiling", "arrow", "validate", "budget")} <= set(
        package
    )
    assert f"{PACKAGE}.sections" not in modules, "the v2 layout lives in the catalog package"
    sizes = {m: len(modules[m].read_text().splitlines()) for m in package}
    assert max(sizes.values()) <= 400, sizes
    for m in package:
        assert ast.get_docstring(ast.parse(modules[m].read_text())), f"{m} says why it exists"


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    """The checker itself: a two-module cycle through a function-level import, and a
    private name, are both reported."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .b import _helper\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n\n\ndef _helper():\n    pass\n")
    private, cycles = layer_problems(tmp_path)
    assert private == [f"{PACKAGE}.a imports _helper from {PACKAGE}.b"]
    assert cycles == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]]
