"""bcp's reusable conformance suite for storage backends.

It ships inside the package so that a third-party backend proves the same object
contract as the built-in ones: subclass :class:`BackendContractTests` in a pytest
module, override its ``backend`` fixture (and, ideally, the ``raw_put``/``raw_get``
hooks), and every guarantee of :class:`bcp.backends.Backend` is tested.
"""

from .object_contract import BackendContractTests

__all__ = ["BackendContractTests"]
