"""The map of the library, read from its source with ``ast`` (issue 28): no module
imports a private name of another, no two modules import each other (directly or
through others, imports inside functions included: they are cycles too, only
deferred), no module is over 600 lines, and every module says why it exists.

The library is one namespace from four folders (pyproject's ``package-dir``):
``bcp/``, ``backends/`` (``bcp.backends``), ``metadata/`` (``bcp.metadata``) and
``conformance/`` (``bcp.conformance``). Before issue 28 these checks failed on
``metadata/catalog.py`` <-> ``sections.py`` (a cycle and three private names),
``bcp/convert.py`` <-> ``bcp/dcp_metadata.py`` and four modules of 640-1,195 lines.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package name -> folder, as pyproject.toml's package-dir maps them
LAYERS = {"bcp": "bcp", "bcp.backends": "backends", "bcp.metadata": "metadata", "bcp.conformance": "conformance"}
MAX_LINES = 600


def library_modules(root: Path = ROOT, layers: dict[str, str] = LAYERS) -> dict[str, Path]:
    """Module name -> file, for every .py of every layer."""
    out = {}
    for package, folder in layers.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


@functools.cache
def _parsed(path: Path, text: str) -> tuple[ast.Module, tuple[ast.AST, ...]]:
    return (tree := ast.parse(text, str(path))), tuple(ast.walk(tree))


def parse(path: Path) -> ast.Module:
    """``path`` parsed, once per text: the checks below read the whole library, each
    the same trees (they only read them; keyed on the text, so an edited file is read anew)."""
    return _parsed(path, path.read_text())[0]


def walk(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s tree (``ast.walk``), listed once per text."""
    return _parsed(path, path.read_text())[1]


def imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import of the
    file, at any depth; ``from package import module`` counts as importing the module."""
    is_package = path.name == "__init__.py"
    for node in walk(path):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub, None, node.lineno) if sub in modules else (target, alias.name, node.lineno)


def private(word: str) -> bool:
    return word.startswith("_") and not (word.startswith("__") and word.endswith("__"))


#: Private modules that are a package's own business but shared inside it on purpose.
SHARED_PRIVATE_MODULES = frozenset({"bcp._version"})


def map_problems(modules: dict[str, Path]) -> tuple[list[str], list[list[str]]]:
    """(private names or modules imported across modules, import cycles as module lists)."""
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, taken, line in imports(name, path, modules):
            if target not in modules and not any(target.startswith(f"{m}.") for m in modules):
                continue  # outside the library
            if any(private(p) for p in target.split(".")) and target not in SHARED_PRIVATE_MODULES:
                found.append(f"{name}:{line} imports the private module {target}")
            if taken is not None and private(taken) and target != name:
                found.append(f"{name}:{line} imports {taken} from {target}")
            if target in modules and target != name:
                graph[name].add(target)
    return found, _cycles(graph)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (m, ..., m) per back edge of a depth-first walk; empty: no cycle."""
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
    return cycles


def test_no_private_name_crosses_a_module_and_no_import_cycle():
    found, cycles = map_problems(library_modules())
    assert found == [], "\n".join(found)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_is_over_600_lines_and_each_says_why_it_exists():
    modules = library_modules()
    assert len(modules) > 100  # the whole library was found
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules.items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
    undocumented = [m for m, p in modules.items() if p.stat().st_size and not ast.get_docstring(parse(p))]
    assert undocumented == []


def test_packages_by_job_exist_and_their_old_modules_are_gone():
    modules = library_modules()
    for package in ("bcp.cli", "bcp.convert", "bcp.planning", "bcp.metadata.catalog", "bcp.io_scheduler", "bcp.tiers"):
        assert modules[package].name == "__init__.py", package
    for gone in ("bcp.save_plan", "bcp.dcp_metadata", "bcp.boxes", "bcp.metadata.sections", "bcp.plan_cache"):
        assert gone not in modules, f"{gone} moved into its package"
    assert "bcp.metadata.geometry" in modules  # the one home of box geometry


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"a.py": "from .b import _helper\n", "b.py": "def _helper():\n    pass\n"}, "imports _helper from"),
        ({"a.py": "from ._inner import x\n", "_inner.py": "x = 1\n"}, "private module"),
    ],
)
def test_the_checker_sees_private_imports(tmp_path, files, problem):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    found, cycles = map_problems(library_modules(tmp_path, {"pkg": "pkg"}))
    assert len(found) == 1 and problem in found[0] and cycles == []


def test_the_checker_sees_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    found, cycles = map_problems(library_modules(tmp_path, {"pkg": "pkg"}))
    assert found == [] and cycles == [["pkg.a", "pkg.b", "pkg.a"]]


# -- packages (issue 38) ---------------------------------------------------------------------------


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The node a module belongs to in the package graph: a layer (``bcp.backends``,
    ``bcp.metadata``, ``bcp.conformance``) or a package of the engine (``bcp.tiers``, ...)
    as a whole; a module at the engine's top (``bcp.reader``) stands for itself."""
    for layer in LAYERS:
        if layer != "bcp" and (module == layer or module.startswith(f"{layer}.")):
            return layer
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or modules[module].name == "__init__.py" else module


def package_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Cycles between packages: an import that climbs back up (``io_scheduler.x`` imports
    ``reader`` while ``reader`` imports ``io_scheduler.y``) is no module-level cycle, but
    it ties the two packages into one."""
    graph: dict[str, set[str]] = {package_of(m, modules): set() for m in modules}
    for name, path in modules.items():
        for target, _taken, _line in imports(name, path, modules):
            if target in modules and package_of(target, modules) != package_of(name, modules):
                graph[package_of(name, modules)].add(package_of(target, modules))
    return _cycles(graph)


def test_no_import_climbs_back_up_between_packages():
    cycles = package_cycles(library_modules())
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_check_sees_an_import_that_climbs_back_up(tmp_path):
    for name, text in {
        "__init__.py": "",
        "reader.py": "from pkg.sched import a\n",
        "sched/__init__.py": "",
        "sched/a.py": "x = 1\n",
        "sched/b.py": "def f():\n    from pkg import reader\n",
    }.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    modules = library_modules(tmp_path, {"pkg": "pkg"})
    assert map_problems(modules) == ([], [])  # no module-level cycle ...
    assert package_cycles(modules) == [["pkg.reader", "pkg.sched", "pkg.reader"]]  # ... but a package-level one


def test_no_two_modules_of_the_library_share_a_name():
    by_name: dict[str, list[str]] = {}
    for module, path in library_modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.stem, []).append(module)
    assert {n: ms for n, ms in by_name.items() if len(ms) > 1} == {}


def test_library_imports_are_spelled_absolute():
    """One spelling: ``from bcp.backends import ...``, never ``from ..backends`` (the
    folder ``bcp/backends`` does not exist on disk) nor ``from .x`` (a move rewrites
    absolute names with one search)."""
    relative = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in library_modules().values()
        for node in walk(path)
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []


# -- one save orchestration (issue 38) ---------------------------------------------------------

#: the save's named phases: the one place the saves share
PHASES = "bcp.save_phases"
#: the saves composed from them
SAVES = ("bcp.saver", "bcp.async_save", "bcp.tiers.fast_save", "bcp.tiers.drain")


def imported(module: str, modules: dict[str, Path]) -> set[str]:
    return {target for target, _taken, _line in imports(module, modules[module], modules)}


def test_the_local_tier_never_imports_the_saver_and_every_save_composes_the_phases():
    """The local tier's save, the persistent save and the drain share only the
    phases module: no module of ``bcp.tiers`` imports ``bcp.saver`` (before, the fast
    save re-entered six of its internals), and the phases import none of the saves."""
    modules = library_modules()
    tiers = [m for m in modules if m.startswith("bcp.tiers.")]
    assert len(tiers) > 10  # the whole package was found
    offenders = {m: sorted(t for t in imported(m, modules) if t == "bcp.saver") for m in tiers}
    assert {m: t for m, t in offenders.items() if t} == {}
    for save in SAVES:
        assert PHASES in imported(save, modules), f"{save} does not compose {PHASES}"
    assert not imported(PHASES, modules) & {*SAVES, "bcp.tiers"}, f"{PHASES} imports a save that composes it"


def parked_errors(path: Path) -> list[str]:
    """Functions that park an error on an object not their own: ``x.error = x.error or e``
    (``self.error`` is an object recording its own error, e.g. a pipeline's writer thread)."""
    found = []
    for func in walk(path):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.BoolOp):
                continue
            for target in node.targets:
                first = node.value.values[0]
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "error"
                    and isinstance(first, ast.Attribute)
                    and ast.dump(first) == ast.dump(target).replace("Store()", "Load()")
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                ):
                    found.append(func.name)
    return found


def test_a_staging_error_is_parked_in_one_place():
    """Before, ``bcp.saver``, ``bcp.tiers.fast_save`` and ``write_rank_data`` each kept
    their own copy of parking a staging error for the writing thread to report."""
    modules = library_modules()
    parked = {m: names for m, p in modules.items() if (names := parked_errors(p))}
    assert parked == {PHASES: ["park_staging_error"]}
    defined = [
        m
        for m, p in modules.items()
        for node in walk(p)
        if isinstance(node, ast.FunctionDef) and node.name == "park_staging_error"
    ]
    assert defined == [PHASES]


def test_the_parking_check_sees_a_copy(tmp_path):
    (tmp_path / "a.py").write_text(
        "def stage(p):\n    try:\n        p.stage()\n    except BaseException as e:\n"
        "        p.pipeline.error = p.pipeline.error or e\n"
        "class W:\n    def loop(self, e):\n        self.error = self.error or e\n"
    )
    assert parked_errors(tmp_path / "a.py") == ["stage"]


# -- dead code (issue 38) -------------------------------------------------------------------------

#: Top-level functions that nothing in the library names, called from outside by name.
#: Each with the caller that finds it.
CALLED_FROM_OUTSIDE = {
    # pytest calls a plugin's hooks by name (entry point pytest11 = bcp.conformance.pytest_plugin)
    "bcp.conformance.pytest_plugin.pytest_addoption": "pytest hook",
    "bcp.conformance.pytest_plugin.pytest_configure": "pytest hook",
    # the conformance suite's fixtures, which pytest injects by parameter name
    "bcp.conformance.test_suite.bcp_uri": "pytest fixture",
    "bcp.conformance.test_suite.backend_facts": "pytest fixture",
    # the memory store is process-wide; its users (tests, notebooks) empty it between runs
    "bcp.backends.memory.clear_memory_store": "memory:// store's reset",
    # the plan caches are process-wide; the way to plan from scratch again (tests, benchmarks)
    "bcp.planning.cache.clear_plan_caches": "plan caches' reset",
    # the identity the vectorised combiner (_Combiner) computes in bulk, kept as its reference
    "bcp.metadata.checksum.crc32c_combine": "CRC32C combine identity",
}


def _names_used(path: Path) -> set[str]:
    """Every name a module reads: names, attributes, names imported, strings (``__all__``)."""
    used: set[str] = set()
    for node in walk(path):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
    return used


def unused_functions(modules: dict[str, Path], public_text: str = "") -> list[str]:
    """``module.function`` for each top-level function that no module of the library
    uses (its own module included, past its definition) and ``public_text`` (the docs,
    the README, pyproject's entry points) does not name."""
    trees = {name: parse(path) for name, path in modules.items()}
    used: set[str] = set()
    for path in modules.values():
        used |= _names_used(path)
    out = []
    for name, tree in trees.items():
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name in used:
                continue
            named = re.search(rf"\b{re.escape(node.name)}\b", public_text)
            if f"{name}.{node.name}" not in CALLED_FROM_OUTSIDE and not named:
                out.append(f"{name}.{node.name}")
    return out


def public_text() -> str:
    """What users are told exists: the README, every docs page, pyproject.toml (scripts
    and entry points)."""
    pages = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def test_every_top_level_function_of_the_library_has_a_caller():
    """Dead code cannot come back silently: a function only tests call lives in tests/
    (tests/helpers.py), one nothing calls is deleted. Before issue 38 this found
    ``read_plan.choose_replicas`` (no caller) and ``write_pipeline.write_rank_data``,
    ``shared_read.plan_sharing``, ``tiers.recover.recover_latest`` (tests only)."""
    modules = library_modules()
    assert unused_functions(modules, public_text()) == []
    defined = {
        f"{name}.{node.name}"
        for name, path in modules.items()
        for node in parse(path).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    assert set(CALLED_FROM_OUTSIDE) <= defined, "an allowed function no longer exists: take it off the list"


def test_the_dead_code_check_sees_a_function_nothing_calls(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg.a import kept\n")
    (tmp_path / "pkg" / "a.py").write_text(
        "def kept():\n    return _used()\n\ndef _used():\n    return 1\n\n"
        "def dead():\n    return 2\n\ndef documented():\n    return 3\n"
    )
    modules = library_modules(tmp_path, {"pkg": "pkg"})
    assert unused_functions(modules, "call `documented()`") == ["pkg.a.dead"]


def unannotated_functions(modules: dict[str, Path]) -> list[str]:
    """``module:line name`` for each function (nested ones and methods too) with a
    parameter or a return left unannotated, as mypy's ``disallow_untyped_defs`` sees it:
    ``self``/``cls`` of a method need none, nor does ``__init__``'s return."""
    out = []
    for name, path in modules.items():
        methods = {
            id(f)
            for c in walk(path)
            if isinstance(c, ast.ClassDef)
            for f in c.body
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for node in walk(path):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
            if id(node) in methods and not static and a.posonlyargs + a.args:
                params = params[1:]
            if any(p.annotation is None for p in params) or (node.returns is None and node.name != "__init__"):
                out.append(f"{name}:{node.lineno} {node.name}")
    return out


def test_every_function_of_the_library_is_annotated():
    """pyproject's mypy runs with ``disallow_untyped_defs``; this says the same in the
    fast tier, without mypy's minute. Before issue 38, 55 functions lacked annotations."""
    assert unannotated_functions(library_modules()) == []


def test_the_annotation_check_sees_a_missing_annotation(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(
        "class C:\n    def __init__(self, x: int):\n        pass\n\n    def m(self, y) -> None:\n        pass\n\n"
        "    @staticmethod\n    def s(z: int) -> int:\n        return z\n\n"
        "def f(*args: int, **kw: int):\n    def inner(v: int) -> int:\n        return v\n    return inner\n"
    )
    assert sorted(unannotated_functions(library_modules(tmp_path, {"pkg": "pkg"}))) == ["pkg.a:12 f", "pkg.a:5 m"]


# -- the checks' own cost (issue 38: a fast tier that stays fast) ---------------------------------


def test_the_checks_parse_each_file_once_and_an_edited_file_again(tmp_path, monkeypatch):
    """The checks above each read the whole library; they share one parse per file text."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""p."""\nfrom pkg.a import f\n')
    (tmp_path / "pkg" / "a.py").write_text('"""a."""\ndef f() -> int:\n    return 1\n')
    modules = library_modules(tmp_path, {"pkg": "pkg"})
    calls = []
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda text, *a, **k: calls.append(text) or real(text, *a, **k))
    for _ in range(2):
        assert map_problems(modules) == ([], [])
        assert unused_functions(modules) == []
        assert unannotated_functions(modules) == []
    assert len(calls) == 2, calls
    (tmp_path / "pkg" / "a.py").write_text('"""a."""\ndef f():\n    return 1\n')
    assert unannotated_functions(modules) == ["pkg.a:2 f"]
    assert len(calls) == 3


def test_the_tier_markers_are_worked_out_once_per_test_function(monkeypatch):
    """Collection classifies every item (tests/conftest.py); the parametrized cases of
    one function share the answer instead of walking its code again for each case."""
    import types

    import conftest

    walks = []
    real = conftest._names_used
    monkeypatch.setattr(conftest, "_names_used", lambda *a: walks.append(a) or real(*a))

    def test_case(x):
        return subprocess.run(x)  # noqa: F821 - only its names are read

    module = types.ModuleType("test_fake")
    items = [types.SimpleNamespace(function=test_case, module=module, cls=None, fixturenames=["x"]) for _ in range(50)]
    memo: dict = {}
    found = {conftest._process_markers(item, memo) for item in items}
    assert len(walks) == 1 and found == {frozenset({"subprocess"})}
