"""The suite as collected by ``pytest --pyargs bcp.conformance --bcp-uri URI``
(and by ``bcp conformance URI``). Without --bcp-uri every test skips."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from bcp.backends import Backend, Capability, backend_for, join_uri
from bcp.conformance.checkpoint_contract import CheckpointContractTests
from bcp.conformance.object_contract import BackendContractTests
from bcp.conformance.probe import probe
from bcp.conformance.pytest_plugin import target_uri

MiB = 1 << 20


@pytest.fixture(scope="session")
def bcp_uri(pytestconfig: pytest.Config) -> str:
    uri = target_uri(pytestconfig)
    if not uri:
        pytest.skip("no store given: run with --bcp-uri URI (or use `bcp conformance URI`)")
    return uri


@pytest.fixture(scope="session")
def backend_facts(bcp_uri: str) -> dict:
    b = backend_for(bcp_uri)
    inner = b.unwrap()
    caps = [c.name for c in Capability if c.name and c in b.capabilities and c is not Capability.NONE]
    return {
        "class": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "capabilities": "|".join(caps) or "none",
        "part_size": b.hints.part_size,
        "concurrency": b.hints.concurrency,
        "retrying": inner is not b,
    }


class TestObjectContract(BackendContractTests):
    @pytest.fixture
    def backend(
        self, bcp_uri: str, backend_facts: dict, record_property: Callable[[str, object], None]
    ) -> Iterator[Backend]:
        record_property("backend", backend_facts)
        b = backend_for(join_uri(bcp_uri, f"obj-contract-{uuid.uuid4().hex[:12]}"))
        yield b
        try:
            b.delete_prefix("")
        finally:
            b.close()


class TestCheckpointContract(CheckpointContractTests):
    @pytest.fixture
    def store_uri(self, bcp_uri: str) -> str:
        return bcp_uri


class TestPerformanceProbe:
    """A class only so the probe declares its report heading like every other check."""

    report_heading = "performance (reported, not judged)"

    def test_performance_probe(
        self, bcp_uri: str, pytestconfig: pytest.Config, record_property: Callable[[str, object], None]
    ) -> None:
        full = pytestconfig.getoption("--bcp-level") == "full"
        mib = pytestconfig.getoption("--bcp-probe-mib") or (256 if full else 32)
        figures = probe(
            backend_for(join_uri(bcp_uri, f"probe-{uuid.uuid4().hex[:12]}")),
            total_bytes=mib * MiB,
            small_reads=50 if full else 10,
        )
        record_property("figures", figures)
        assert figures["write_GBps"] > 0 and figures["read_GBps_best"] > 0
