"""bcp's reusable conformance suite for storage backends.

It ships inside the package so that a third-party backend proves the same object
contract as the built-in ones: subclass :class:`BackendContractTests` in a pytest
module, override its ``backend`` fixture (and, ideally, the ``raw_put``/``raw_get``
hooks), and every guarantee of :class:`bcp.backends.Backend` is tested;
:class:`CheckpointContractTests` does the same for whole checkpoints.

It also runs against any URI, with a report: ``bcp conformance URI``,
``pytest --pyargs bcp.conformance --bcp-uri URI``, or :func:`run_suite` from Python.
"""

from .checkpoint_contract import CheckpointContractTests
from .object_contract import BackendContractTests
from .runner import run_suite

__all__ = ["BackendContractTests", "CheckpointContractTests", "run_suite"]
