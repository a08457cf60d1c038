"""bcp's reusable conformance suite for storage backends.

It ships inside the package so that a third-party backend proves the same object
contract as the built-in ones: subclass :class:`BackendContractTests` in a pytest
module, override its ``backend`` fixture (and, ideally, the ``raw_put``/``raw_get``
hooks), and every guarantee of :class:`bcp.backends.Backend` is tested;
:class:`CheckpointContractTests` does the same for whole checkpoints. The object
contract is also exported one operation at a time (:data:`OBJECT_CONTRACT_GROUPS`,
e.g. :class:`RangedReadTests`), to subclass while working on that operation.

It also runs against any URI, with a report: ``bcp conformance URI``,
``pytest --pyargs bcp.conformance --bcp-uri URI``, or :func:`run_suite` from Python.
Its modules, one line each: docs/architecture.md.
"""

import sys

if __name__ == "bcp.conformance":
    from bcp.conformance.checkpoint_contract import CheckpointContractTests
    from bcp.conformance.object_contract import (
        OBJECT_CONTRACT_GROUPS,
        AtomicCommitTests,
        BackendContractTests,
        ConcurrencyTests,
        CreateOnlyWriteTests,
        DeleteTests,
        ExistsTests,
        IncrementalStoreTests,
        KeyTests,
        ListingTests,
        MissingObjectTests,
        MultipartWriteTests,
        ObjectContractBase,
        OverwriteTests,
        RangedReadTests,
        RoundTripTests,
    )
    from bcp.conformance.runner import run_suite
elif "_pytest" not in sys.modules:  # the folder imported under its own name: a second copy of every class
    raise ImportError(
        f"this folder is the package bcp.conformance; write `import bcp.conformance`, not `import {__name__}`"
    )
else:
    # pytest collecting test_suite.py by its path in a development checkout, where this
    # folder is not inside bcp/ and so gets the name "conformance". It stays an empty
    # package (test_suite.py imports everything it uses from bcp.conformance), and
    # anything asked of it says where to look instead.
    def __getattr__(name: str) -> object:
        raise AttributeError(
            f"{__name__}.{name}: this folder is the package bcp.conformance; use bcp.conformance.{name}"
        )


__all__ = [
    "OBJECT_CONTRACT_GROUPS",
    "AtomicCommitTests",
    "BackendContractTests",
    "CheckpointContractTests",
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
    "run_suite",
]
