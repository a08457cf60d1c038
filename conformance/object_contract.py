"""The object contract every storage backend must keep, as pytest tests.

Use it from a test module of your backend::

    from bcp.conformance import BackendContractTests

    class TestMyBackend(BackendContractTests):
        @pytest.fixture
        def backend(self, tmp_path):
            b = MyBackend.from_uri(...)   # an EMPTY store, fresh for every test
            yield b
            b.close()

        def raw_put(self, backend, key, data): ...   # write with the store's own SDK
        def raw_get(self, backend, key): ...         # read with the store's own SDK

The ``backend`` fixture must give an empty store (or an empty root inside one) to each
test: listing tests compare against exactly the keys they wrote.

The raw hooks bypass the backend under test, so a broken write cannot hide a broken
read (and the reverse): read tests seed their objects with ``raw_put`` and write tests
check what landed with ``raw_get``. Without the hooks those tests fall back to the
backend's own ``write``/``read``, and the tests that exist only to cross-check
against the store are skipped.

The tests are split by operation into the classes of :data:`OBJECT_CONTRACT_GROUPS`
(round trip, multi-part writes, ranged reads, listing, delete, exists, keys, missing
objects, atomic commit, overwrite, create-only writes, concurrency, and what incremental
checkpoints rely on: keys of sibling checkpoints, holds, empty objects), and
:class:`BackendContractTests` inherits all of them. Subclass one group instead (same
fixture and hooks) to run only that operation while working on it. Each test checks
one guarantee and fails with a message naming it; each group declares the heading
the conformance report shows its tests under. Tests for optional guarantees
(``Capability.PARALLEL_WRITES``, ``Capability.CREATE_ONLY``) skip when the backend
does not declare them.
"""

from __future__ import annotations

from bcp.conformance.object_base import (
    INVALID_KEYS,
    IRREGULAR_PARTS,
    KEYED_OPS,
    READ_OPS,
    THREAD_TIMEOUT,
    THREADS,
    ObjectContractBase,
    check_bytes,
    expect_raises,
    in_threads,
    payload,
)
from bcp.conformance.object_commit import AtomicCommitTests, ConcurrencyTests, CreateOnlyWriteTests, OverwriteTests
from bcp.conformance.object_data import MultipartWriteTests, RangedReadTests, RoundTripTests
from bcp.conformance.object_incremental import IncrementalStoreTests
from bcp.conformance.object_keys import DeleteTests, ExistsTests, KeyTests, ListingTests, MissingObjectTests

#: The per-operation groups, in the order they run and are reported.
OBJECT_CONTRACT_GROUPS: tuple[type[ObjectContractBase], ...] = (
    RoundTripTests,
    MultipartWriteTests,
    RangedReadTests,
    ListingTests,
    DeleteTests,
    ExistsTests,
    KeyTests,
    MissingObjectTests,
    AtomicCommitTests,
    OverwriteTests,
    CreateOnlyWriteTests,
    ConcurrencyTests,
    IncrementalStoreTests,
)


class BackendContractTests(
    IncrementalStoreTests,
    ConcurrencyTests,
    CreateOnlyWriteTests,
    OverwriteTests,
    AtomicCommitTests,
    MissingObjectTests,
    KeyTests,
    ExistsTests,
    DeleteTests,
    ListingTests,
    RangedReadTests,
    MultipartWriteTests,
    RoundTripTests,
):
    """Every group of the object contract in one class: what a backend author subclasses.
    Not collected itself (no ``Test`` prefix).

    The bases are :data:`OBJECT_CONTRACT_GROUPS` reversed because pytest collects
    inherited tests from the last base first; this way a run goes round trip first.
    It declares no heading: each test reports under the heading of its group.
    """


__all__ = [
    "INVALID_KEYS",
    "IRREGULAR_PARTS",
    "KEYED_OPS",
    "OBJECT_CONTRACT_GROUPS",
    "READ_OPS",
    "THREADS",
    "THREAD_TIMEOUT",
    "AtomicCommitTests",
    "BackendContractTests",
    "ConcurrencyTests",
    "CreateOnlyWriteTests",
    "DeleteTests",
    "ExistsTests",
    "IncrementalStoreTests",
    "KeyTests",
    "ListingTests",
    "MissingObjectTests",
    "MultipartWriteTests",
    "ObjectContractBase",
    "OverwriteTests",
    "RangedReadTests",
    "RoundTripTests",
    "check_bytes",
    "expect_raises",
    "in_threads",
    "payload",
]
