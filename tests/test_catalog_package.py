"""The shape of the metadata layer, read from its source with ``ast``: the catalog is a
package of small modules with one job each (tests/test_import_map.py checks, for the
whole library, that none imports a private name of another and that there is no cycle).
"""

from __future__ import annotations

import ast

from test_import_map import library_modules

PACKAGE = "bcp.metadata"


def test_the_catalog_is_a_package_of_small_modules():
    modules = library_modules()
    package = sorted(m for m in modules if m.startswith(f"{PACKAGE}.catalog."))
    assert f"{PACKAGE}.catalog" in modules and modules[f"{PACKAGE}.catalog"].name == "__init__.py"
    assert {f"{PACKAGE}.catalog.{m}" for m in ("core", "sections", "arrow", "validate", "budget")} <= set(package)
    assert f"{PACKAGE}.sections" not in modules, "the v2 layout lives in the catalog package"
    sizes = {m: len(modules[m].read_text().splitlines()) for m in package}
    assert max(sizes.values()) <= 400, sizes
    for m in package:
        assert ast.get_docstring(ast.parse(modules[m].read_text())), f"{m} says why it exists"
