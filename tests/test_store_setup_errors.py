"""Object stores set up wrong (issue 36): no credentials, a bucket that is not there,
an endpoint that refuses connections. Each is one StorageError line that says what is
wrong, chained to the SDK's error, within ``retry_deadline`` (the SDKs' own retry
loops are off), and one line from the CLI. Against moto_server and
gcp-storage-emulator; "refused" is a port on 127.0.0.1 where nothing listens."""

from __future__ import annotations

import importlib
import logging
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import botocore.exceptions
import pytest
import s3fs
import torch

import bcp
from bcp.backends import ObjectNotFoundError, StorageError, backend_for
from bcp.backends.retry import RetryPolicy
from servers import free_port


def _state() -> dict:
    return {"w": torch.arange(8, dtype=torch.float32)}


def _chain(error: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(out) < 20:
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def _uri(kind: str, endpoint: str, bucket: str, **extra: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in extra.items())
    base = (
        f"s3://{bucket}/run?endpoint_url={endpoint}"
        if kind == "s3"
        else f"gs://{bucket}/run?endpoint_url={endpoint}&anon=true"
    )
    return f"{base}&{query}" if query else base


def _no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """An environment with no AWS credentials anywhere: no variables, config files
    that do not exist, no instance metadata; s3fs's cached clients dropped."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    shared, config = tmp_path / "absent-credentials", tmp_path / "absent-config"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    return shared, config


def test_s3_without_credentials_says_where_it_looked_in_one_line(moto_server, monkeypatch, tmp_path):
    shared, config = _no_aws_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "SeCrEt-token-alone-is-no-credential")  # ignored alone; never shown
    uri = _uri("s3", moto_server.endpoint, "any-bucket", retry_deadline="5")
    try:
        with pytest.raises(StorageError) as info:
            bcp.save(_state(), uri)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # later tests build clients with credentials again
    message = str(info.value)
    assert "\n" not in message
    assert "no AWS credentials found" in message, message
    for place in ("AWS_ACCESS_KEY_ID", str(shared), str(config), "storage_options", "role"):
        assert place in message, f"{place} missing from: {message}"
    assert "SeCrEt" not in message
    assert not isinstance(info.value, ObjectNotFoundError)
    assert any(isinstance(e, botocore.exceptions.NoCredentialsError) for e in _chain(info.value))


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_missing_bucket_is_named(kind, request):
    server = request.getfixturevalue("moto_server" if kind == "s3" else "gcs_server")
    bucket = f"absent-{uuid.uuid4().hex[:12]}"
    uri = _uri(kind, server.endpoint, bucket, retry_deadline="5")
    for attempt in (lambda: bcp.save(_state(), uri), lambda: bcp.load(_state(), uri)):
        start = time.monotonic()
        with pytest.raises(StorageError) as info:
            attempt()
        message = str(info.value)
        assert "\n" not in message
        assert f"no such bucket {bucket!r} at {server.endpoint}" in message, message
        assert "no such object" not in message
        assert not isinstance(info.value, FileNotFoundError), "a missing bucket is not a missing object"
        assert any(isinstance(e, FileNotFoundError) for e in _chain(info.value)), "chained to the SDK's 404"
        assert time.monotonic() - start < 5, "a missing bucket is not retried"


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_refused_endpoint_fails_within_the_deadline_naming_it(kind, caplog):
    deadline = 2.0
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    uri = _uri(kind, endpoint, "bucket", retry_deadline=str(deadline))
    caplog.set_level(logging.WARNING)  # what a user sees (botocore logs tracebacks at DEBUG)
    importlib.import_module("gcsfs" if kind == "gcs" else "s3fs")  # not timed: an import, not a retry
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        bcp.save(_state(), uri)
    elapsed = time.monotonic() - start
    message = str(info.value)
    # 3 s of slack for a loaded CI machine (3.6 s was seen once against a 3.5 s bound); a
    # retry loop that ignores the deadline takes at least one more backoff of several seconds.
    assert elapsed < deadline + 3.0, f"{elapsed:.1f} s against retry_deadline={deadline}"
    assert "\n" not in message
    assert f"cannot connect to endpoint {endpoint}: connection refused" in message, message
    assert "gave up after" in message
    assert any(isinstance(e, ConnectionRefusedError) for e in _chain(info.value))
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert not tracebacks, f"the SDK logged tracebacks: {tracebacks}"


def test_no_pause_outlasts_the_retry_deadline():
    """The bound the end-to-end test above allows slack for, exactly: every pause is cut
    to what is left of the deadline, so the pauses sum to at most the deadline."""
    random.seed(0)  # an uncut first pause (uniform in [0, 5] s) would be 0.3 s or more with this seed
    policy = RetryPolicy(attempts=50, base_delay=5.0, max_delay=5.0, deadline=0.3)
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        time.sleep(seconds)

    def refused() -> None:
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(StorageError, match="gave up after"):
        policy.call(refused, uri="gs://b/run", key="k", action="write", sleep=pause)
    assert pauses and max(pauses) <= 0.3 and sum(pauses) <= 0.3 + 1e-6, pauses


@pytest.mark.slow  # three CLI processes (torch's import), run side by side
def test_the_cli_prints_each_as_one_line(moto_server, gcs_server, tmp_path):
    no_credentials = dict(os.environ)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        no_credentials.pop(name, None)
    no_credentials["AWS_SHARED_CREDENTIALS_FILE"] = str(tmp_path / "absent-credentials")
    no_credentials["AWS_CONFIG_FILE"] = str(tmp_path / "absent-config")
    refused = f"http://127.0.0.1:{free_port()}"
    cases = [
        (_uri("s3", moto_server.endpoint, "some-bucket"), no_credentials, "no AWS credentials found"),
        (_uri("gcs", gcs_server.endpoint, "absent-bucket"), os.environ, "no such bucket 'absent-bucket'"),
        (_uri("gcs", refused, "bucket", retry_deadline="1"), os.environ, f"cannot connect to endpoint {refused}"),
    ]
    running = [
        (
            subprocess.Popen(
                [sys.executable, "-m", "bcp.cli", "inspect", uri],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env),
            ),
            expect,
        )
        for uri, env, expect in cases
    ]
    for process, expect in running:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 1, stderr
        lines = stderr.splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith("bcp inspect: ") and expect in lines[0], lines[0]


@pytest.mark.parametrize("scheme", ["webhdfs", "fsspec+webhdfs"])
def test_an_unreachable_fsspec_store_is_an_error_not_an_empty_one(scheme, tmp_path):
    """fsspec's isfile, isdir and find answer False or nothing for any error: an
    unreachable WebHDFS looked like a store holding no checkpoint, so a manager's
    load_latest started the job from scratch. Every lookup now raises StorageError."""
    uri = f"{scheme}://127.0.0.1:{free_port()}/run?retry_deadline=1"  # nothing listens there
    for call in (
        lambda: bcp.exists(uri),
        lambda: bcp.CheckpointManager(uri, async_save=False).load_latest({"w": torch.zeros(2)}),
        lambda: list(backend_for(uri).list("")),
    ):
        with pytest.raises(StorageError, match=r"127\.0\.0\.1"):
            call()
