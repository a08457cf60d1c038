"""Shared fixtures: a checkpoint URI on each built-in backend, hypothesis profiles."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "ci", deadline=None, max_examples=60, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


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
