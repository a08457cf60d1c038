"""docs/architecture.md is the one module-by-module map of the library (issue 38), and
it stays true: every module and package is named there (by its dotted name or its
path), every ``module.function`` / ``module.Class`` it names resolves by importing
the module, every path it names exists, no other page keeps a module table of its
own (README and CONTRIBUTING keep one line per folder), and each package's docstring
points to the map instead of listing its modules.

Before issue 38 the map named ``saver._prepare`` and ``saver._coordinate`` (gone),
``housekeeping.py`` (split into ``discovery.py`` and ``retention.py``) and left out
a dozen modules; ``bcp/tiers/__init__.py`` listed its modules, one of them renamed.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from test_import_map import library_modules

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
#: pages that keep one line per folder and never a module file
FOLDER_PAGES = ("README.md", "CONTRIBUTING.md")
#: a page naming this many modules at the head of table rows or list items is a map
MAP_ROWS = 3
#: modules a user imports by name: a user page's table of them (docs/integrations.md:
#: which framework, which extra) is not a map of the code
USER_MODULES = ("bcp.integrations.",)

#: dotted names in backticks that are files, not code (``manifest.json``)
FILE_SUFFIXES = (".json", ".arrow", ".md", ".py", ".bin", ".metadata", ".safetensors", ".txt", ".toml")
#: dotted names in backticks that belong to other packages
FOREIGN = frozenset({"torch", "np", "numpy", "pa", "pyarrow", "pickle", "fsspec", "os", "gc", "json", "dist"})

BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+/?$|^[\w.-]+/$")
LIBRARY_FILE = re.compile(r"\b(?:bcp|backends|metadata|conformance)/[\w/]*\.py\b")


def names_of(modules: dict[str, Path], root: Path = ROOT) -> dict[str, tuple[str, ...]]:
    """Module -> the spellings that name it: dotted, its file's path, a package's folder."""
    out = {}
    for name, path in modules.items():
        rel = path.relative_to(root).as_posix()
        spellings = [name, rel]
        if path.name == "__init__.py":
            spellings.append(rel.removesuffix("__init__.py"))
        out[name] = tuple(spellings)
    return out


def mentions(text: str, spelling: str) -> bool:
    """``spelling`` as a whole name: ``bcp.tiers`` is not named by ``bcp.tiers.drain``."""
    return re.search(rf"(?<![\w./]){re.escape(spelling)}(?![\w/]|\.\w)", text) is not None


def unnamed_modules(text: str, modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """The library modules and packages ``text`` does not name."""
    spellings = names_of(modules, root)
    return sorted(m for m, names in spellings.items() if not any(mentions(text, s) for s in names))


def resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    """None when ``dotted`` (``bcp.saver.save``, ``saver.SaveJob.start``, ``bcp.tiers``)
    is a library module, or an attribute chain of one; else why it is not. A short
    module name must be the end of exactly one module's dotted name."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        found = [head] if head in modules else [m for m in modules if m.endswith("." + head)]
        if not found:
            continue
        if len(found) > 1:
            return f"`{dotted}`: `{head}` is ambiguous ({', '.join(sorted(found))}): write the whole name"
        if i == len(parts):
            return None  # a module: named, not imported (an integration imports its framework)
        obj = importlib.import_module(found[0])
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"`{dotted}`: {found[0]} has no `{attr}`"
            obj = getattr(obj, attr)
        return None
    return f"`{dotted}` names no library module (renamed or gone?)"


def stale_references(text: str, modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Every backticked ``module.name`` that does not resolve and every repository path
    that does not exist, one line each."""
    problems = []
    for token in dict.fromkeys(BACKTICKED.findall(text)):
        token = token.strip()
        if PATH.match(token):
            if not (root / token).exists():
                problems.append(f"`{token}`: no such path in the repository")
            continue
        m = DOTTED.match(token)
        if m is None or token.endswith(FILE_SUFFIXES) or m.group(1).split(".")[0] in FOREIGN:
            continue
        why = resolve(m.group(1), modules)
        if why is not None:
            problems.append(why)
    return problems


def module_rows(text: str, modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Table rows and list items whose first backticked name is a library module: the
    shape of a module map."""
    spellings = {s for names in names_of(modules, root).values() for s in names if not s.startswith(USER_MODULES)}
    rows = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith(("|", "* ", "- ")):
            continue
        first = BACKTICKED.search(stripped)
        if first is not None and first.group(1).strip() in spellings:
            rows.append(stripped)
    return rows


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return library_modules()


def test_every_module_and_package_is_on_the_map(modules: dict[str, Path]) -> None:
    missing = unnamed_modules(MAP.read_text(), modules)
    assert missing == [], f"add one line each to its package's table in docs/architecture.md: {missing}"


def test_every_name_and_path_on_the_map_exists(modules: dict[str, Path]) -> None:
    stale = stale_references(MAP.read_text(), modules)
    assert stale == [], "docs/architecture.md names what is not there:\n" + "\n".join(stale)


def test_the_map_names_functions_it_can_check(modules: dict[str, Path]) -> None:
    """The save's and the load's walks name functions, not only modules: the
    resolution check above has something to bite on."""
    text = MAP.read_text()
    functions = [
        t
        for t in BACKTICKED.findall(text)
        if (m := DOTTED.match(t)) and resolve(m.group(1), modules) is None and m.group(1) not in modules
    ]
    assert len(functions) >= 30, functions


def test_the_map_reads_in_minutes() -> None:
    """One table row per module (they grow with the library); the prose around them
    stays short."""
    prose = [line for line in MAP.read_text().splitlines() if not line.startswith("|")]
    assert len(prose) <= 150


def test_no_other_page_is_a_module_map(modules: dict[str, Path]) -> None:
    for name in FOLDER_PAGES:
        assert LIBRARY_FILE.findall((ROOT / name).read_text()) == [], f"{name}: one line per folder, no module files"
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page != MAP:
            rows = module_rows(page.read_text(), modules)
            assert len(rows) < MAP_ROWS, f"{page.name} keeps a module table (docs/architecture.md is the map): {rows}"


def test_package_docstrings_point_to_the_map(modules: dict[str, Path]) -> None:
    """A package says what it is for and where its modules are described; listing
    them (as bcp/tiers/__init__.py did, one renamed since) is the map's job."""
    problems = []
    for name, path in modules.items():
        if path.name != "__init__.py" or name == "bcp":  # bcp's docstring is the public API's
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        own = {m.rsplit(".", 1)[1] for m in modules if m.rsplit(".", 1)[0] == name}
        listed = sorted(w for w in own if re.search(rf"`[~.]?(?:{re.escape(name)}\.)?{w}`", doc))
        if "docs/architecture.md" not in doc:
            problems.append(f"{name}: its docstring does not point to docs/architecture.md")
        if len(listed) >= MAP_ROWS:
            problems.append(f"{name}: its docstring lists its modules {listed}")
    assert problems == []


# -- the checker itself, on pages written for the purpose -----------------------------


def test_checker_finds_a_missing_module(modules: dict[str, Path], tmp_path: Path) -> None:
    text = MAP.read_text()
    page = tmp_path / "architecture.md"
    page.write_text(
        text.replace("bcp/tiers/drain.py", "bcp/tiers/elsewhere").replace("bcp.tiers.drain", "bcp.tiers.elsewhere")
    )
    assert unnamed_modules(page.read_text(), modules) == ["bcp.tiers.drain"]
    # a package is not named by one of its modules
    assert "bcp.tiers" in unnamed_modules("`bcp.tiers.drain` `bcp/tiers/drain.py`", modules)
    assert "bcp.tiers" not in unnamed_modules("`bcp/tiers/`", modules)


def test_checker_finds_stale_names(modules: dict[str, Path], tmp_path: Path) -> None:
    page = tmp_path / "architecture.md"
    page.write_text(
        "Step 2: `saver._coordinate`, `saver.prepare_save`, `housekeeping.list_checkpoints`,\n"
        "`bcp.commit.commit`, `Catalog.require`, `bcp/tiers/fast_save.py`, `bcp/housekeeping.py`,\n"
        "`conformance.runner`, `commit.delete_checkpoint()`, `manifest.json`, `torch.save`.\n"
    )
    assert stale_references(page.read_text(), modules) == [
        "`saver._coordinate`: bcp.saver has no `_coordinate`",
        "`housekeeping.list_checkpoints` names no library module (renamed or gone?)",
        "`Catalog.require` names no library module (renamed or gone?)",
        "`bcp/housekeeping.py`: no such path in the repository",
    ]
    assert stale_references("`conformance.probe`", modules) == []  # bcp.cli.conformance has no probe
    assert "ambiguous" in stale_references("`conformance.run_suite`", modules)[0]


def test_checker_finds_a_module_table(modules: dict[str, Path]) -> None:
    page = "| module | job |\n|---|---|\n| `bcp/saver.py` | save |\n| `bcp.loader` | load |\n* `bcp/reader.py`: read\n"
    assert len(module_rows(page, modules)) == 3
    assert module_rows("| `bcp.save` | save |\n* `ls`: list\n", modules) == []
    assert module_rows("| `bcp.integrations.dcp` | x |\n| `bcp.integrations.accelerate` | y |\n" * 2, modules) == []
    assert LIBRARY_FILE.findall("    bcp/          the engine\n") == []
    assert LIBRARY_FILE.findall("see bcp/tiers/drain.py") == ["bcp/tiers/drain.py"]
