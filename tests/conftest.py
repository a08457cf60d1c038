"""Shared fixtures: a checkpoint URI on each built-in backend, hypothesis profiles."""

from __future__ import annotations

import os
import uuid

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
