"""Shared fixtures: a checkpoint URI on each built-in backend, hypothesis profiles,
and the test tiers (markers applied at collection: see ``pytest_collection_modifyitems``)."""

from __future__ import annotations

import inspect
import os
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The S3/GCS SDKs read credentials only from their standard sources, as in
# production: point them at the local test servers' throwaway keys, for this process
# and every rank it spawns, before anything imports botocore.
from servers import test_environment

os.environ.update(test_environment())

settings.register_profile(
    "default",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
#: The fast tier (``pytest -m fast``): a quarter of the default examples, and a tenth of
#: the explicit counts that go through ``helpers.examples``.
settings.register_profile(
    "fast",
    deadline=None,
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def pytest_configure(config: pytest.Config) -> None:
    """Load the hypothesis profile: HYPOTHESIS_PROFILE if set, else "fast" for
    ``pytest -m fast``, "ci" under CI, "default" otherwise (--hypothesis-profile wins).
    Here, not at import: test modules that ``from conftest import ...`` import this file
    a second time, which must not reset the profile. Test modules are imported after
    this, so ``helpers.examples`` sees the profile."""
    if config.getoption("--hypothesis-profile", None):
        return
    tier = "fast" if config.getoption("markexpr", "") == "fast" else None
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or tier or ("ci" if os.environ.get("CI") else "default"))


@pytest.fixture(params=["file", "memory"])
def uri_factory(request, tmp_path):
    """Returns a function giving a fresh checkpoint URI on the parametrized backend."""
    from bcp.backends.memory import clear_memory_store

    store = f"t{uuid.uuid4().hex[:10]}"
    counter = iter(range(10**9))

    def make(name: str | None = None) -> str:
        name = name or f"ckpt{next(counter)}"
        if request.param == "file":
            return str(tmp_path / name)
        return f"memory://{store}/{name}"

    yield make
    clear_memory_store(store)


@pytest.fixture
def uri(uri_factory) -> str:
    return uri_factory()


def _server(kind: str, tmp_path_factory):
    from servers import STARTERS

    try:
        server = STARTERS[kind](tmp_path_factory.mktemp(kind))
    except (ImportError, FileNotFoundError) as e:  # the test set-up installs them; say what is missing
        pytest.fail(f"cannot start the {kind} server: {e}; run the README's test set-up command")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto_server: S3 with AWS's error behaviour (conditional writes, multipart rules)."""
    yield from _server("moto", tmp_path_factory)


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    """rclone serve s3 over a local directory (ignores If-None-Match)."""
    yield from _server("rclone", tmp_path_factory)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """gcp-storage-emulator, in memory."""
    yield from _server("gcs", tmp_path_factory)


def new_bucket(server) -> str:
    from servers import make_bucket

    name = f"b{uuid.uuid4().hex[:12]}"
    make_bucket(server, name)
    return name


#: How each object-store server is addressed (options the tests add to every URI).
def store_uri(kind: str, server, bucket: str, path: str = "", **extra) -> str:
    from urllib.parse import urlencode

    if kind == "gcs":
        base, options = f"gs://{bucket}", {"endpoint_url": server.endpoint, "anon": "true"}
    else:
        base, options = f"s3://{bucket}", {"endpoint_url": server.endpoint, "part_size": "5MiB"}
        if kind == "rclone":
            options["conditional_writes"] = "false"
    options.update(extra)
    return f"{base}/{path}".rstrip("/") + "?" + urlencode(options)


# -- torch's process-wide switches -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _torch_switches_restored() -> Iterator[None]:
    """Put back torch's process-wide switches after each test: a framework trained in
    the test process (Lightning's ``deterministic=True``, transformers' full determinism)
    turns on deterministic algorithms, under which ``torch.empty`` fills every new
    tensor, which fails for dtypes without a fill (uint1-7, int1-7, float4), so a
    later test would fail only because of the order the tests ran in."""
    import torch

    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    threads = torch.get_num_threads()
    yield
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
        deterministic,
        warn_only,
    ):
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# -- test tiers ------------------------------------------------------------------------------
#
# Every test gets the markers of what it costs, at collection, so that no one has to
# remember them: `pytest -m fast` runs the rest, and the whole suite stays `pytest`.
#
#   distributed  spawns gloo processes (dist_jobs.spawn, torch.multiprocessing.spawn)
#   server       needs moto_server, rclone or the GCS emulator (the fixtures below)
#   subprocess   runs python or bcp in a child process
#   slow         marked by hand: takes more than about 2 s on 2 cores
#   fast         none of the above
#
# How a test is classified: the fixtures it requests (server), and the names its code
# uses: the test function, the fixtures it requests that are defined in its module or
# class, and, transitively, the functions and classes of tests/ (or of the test's own
# file) that those name. ``spawn`` among them means distributed, ``subprocess`` or
# ``Popen`` means subprocess, a server fixture's name (also as a string, for
# ``request.getfixturevalue``) means server. A test whose child processes hide behind
# library code gets the marker by hand.

#: Fixtures that start a server process, shared by the session.
SERVER_FIXTURES = frozenset({"moto_server", "rclone_server", "gcs_server"})
#: Names whose use means the test starts processes, by marker.
PROCESS_NAMES = {"distributed": frozenset({"spawn"}), "subprocess": frozenset({"subprocess", "Popen"})}
#: The markers that keep a test out of the fast tier.
COSTLY = ("distributed", "server", "subprocess", "slow")
TESTS_DIR = Path(__file__).resolve().parent


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every function, lambda and comprehension nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj: object) -> list[types.FunctionType]:
    """The Python functions behind ``obj``: itself, a fixture's function, a class's methods."""
    if isinstance(obj, type):
        return [f for v in vars(obj).values() for f in _functions(getattr(v, "__func__", v))]
    obj = getattr(getattr(obj, "hypothesis", None), "inner_test", obj)  # under @given
    obj = inspect.unwrap(getattr(obj, "fget", obj))
    return [obj] if isinstance(obj, types.FunctionType) else []


def _names_used(roots: list[object], cls: type | None, home: str) -> set[str]:
    """Global and attribute names, and string constants, used by ``roots`` and, through
    them, by every function or class defined in tests/ or in ``home`` (the test's file)."""
    seen: set[types.CodeType] = set()
    names: set[str] = set()
    todo = [f for root in roots for f in _functions(root)]
    while todo:
        fn = todo.pop()
        if fn.__code__ in seen:
            continue
        seen.add(fn.__code__)
        for code in _codes(fn.__code__):
            names.update(code.co_names)
            names.update(c for c in code.co_consts if isinstance(c, str) and c in SERVER_FIXTURES)
            for name in code.co_names:
                for sub in [*_functions(fn.__globals__.get(name)), *_functions(getattr(cls, name, None))]:
                    file = sub.__code__.co_filename
                    if file == home or Path(file).resolve().is_relative_to(TESTS_DIR):
                        todo.append(sub)
    return names


def _process_markers(item: pytest.Item, memo: dict[tuple, frozenset[str]]) -> frozenset[str]:
    """The markers of ``item``'s costs; ``memo`` holds them per (function, fixtures,
    class), so the parametrized cases of one test (hundreds, some) are read once."""
    functions = _functions(getattr(item, "function", None))
    if not functions:
        return frozenset()
    module, cls = getattr(item, "module", None), getattr(item, "cls", None)
    key = (functions[0], cls, module, tuple(item.fixturenames))
    if key not in memo:
        home = functions[0].__code__.co_filename
        fixtures = [getattr(cls, name, None) or getattr(module, name, None) for name in item.fixturenames]
        names = _names_used([*functions, *fixtures], cls, home) | set(item.fixturenames)
        found = {marker for marker, used in PROCESS_NAMES.items() if names & used}
        if names & SERVER_FIXTURES:
            found.add("server")
        memo[key] = frozenset(found)
    return memo[key]


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    memo: dict[tuple, frozenset[str]] = {}
    for item in items:
        for marker in sorted(_process_markers(item, memo)):
            item.add_marker(marker)
        if not any(item.get_closest_marker(m) for m in COSTLY):
            item.add_marker("fast")
