"""Credentials in a URI or an SDK message never reach what bcp shows: SaveInfo,
errors, logs, ``bcp ls`` (issue 14)."""

from __future__ import annotations

import logging

import pytest
import torch

import bcp
from bcp.backends import backend_for
from bcp.backends.memory import clear_memory_store
from bcp.backends.storage_errors import StorageError, redact, redact_uri

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    "text",
    [
        f'{{"password": "{SECRET}", "user": "bob"}}',
        f"{{'password': '{SECRET} with spaces'}}",
        f"Authorization: Bearer {SECRET}.abc-def",
        "Authorization: Basic czNjcjN0LVBhNTU6eA==",
        f"GET https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig={SECRET}%3D&se=2030",
        f"POST /token client_secret={SECRET}&grant_type=client_credentials",
        f"cannot connect to ftp://bob:{SECRET}@host:21/dir",
        f"fsspec+sftp://bob:{SECRET}@h/x failed",
        f"api_key={SECRET}",
        f"X-Goog-Signature={SECRET}",
        f"aws_session_token: {SECRET}",
    ],
)
def test_redact_hides_the_secret(text):
    shown = redact(text)
    assert SECRET not in shown and "s3cr3t" not in shown and "czNjcjN0" not in shown, shown
    assert "***" in shown


def test_redact_keeps_ordinary_text():
    for text in ("design: good", "Basic usage", "cwd: /tmp", "no creds in http://host/p?region=eu", "step 10"):
        assert redact(text) == text


def test_redact_uri():
    assert redact_uri(f"memory://user:{SECRET}@store/ck") == "memory://user:***@store/ck"
    assert redact_uri(f"ftp://bob:p@ss{SECRET}@host:21/d?x=1") == "ftp://bob:***@host:21/d?x=1"
    assert redact_uri(f"s3://b/p?token={SECRET}&region=eu#f") == "s3://b/p?token=***&region=eu#f"
    for unchanged in ("/plain/p:w@d", "file:///x/y", "x:///p", "hdfs://bob@nn:8020/p", "gs://b/p?anon=true"):
        assert redact_uri(unchanged) == unchanged


def test_storage_errors_still_redact_signed_urls():
    err = StorageError(f"GET https://b/k?X-Amz-Signature={SECRET} failed", uri="s3://b", key="k", action="reading")
    assert SECRET not in str(err)


@pytest.fixture
def secret_uri():
    yield f"memory://user:{SECRET}@store/run"
    clear_memory_store(f"user:{SECRET}@store")


def test_the_backend_shows_a_redacted_uri_and_connects_with_the_real_one(secret_uri):
    backend = backend_for(f"{secret_uri}/x")
    assert SECRET not in backend.uri and SECRET not in repr(backend) and backend.uri.endswith("@store/run/x")
    backend.write("k", b"v")
    assert backend_for(f"{secret_uri}/x").read("k") == b"v"  # same store: the real netloc was used


def test_no_secret_in_saveinfo_errors_or_debug_logs(secret_uri, caplog):
    caplog.set_level(logging.DEBUG)
    state = {"w": torch.arange(10.0), "step": 3}
    info = bcp.save(state, f"{secret_uri}/a")
    assert SECRET not in info.uri and SECRET not in str(info) and SECRET not in repr(info)
    bcp.load({"w": torch.empty(10), "step": 0}, f"{secret_uri}/a")
    reader = bcp.open(f"{secret_uri}/a")
    assert SECRET not in reader.uri
    with pytest.raises(bcp.errors.CheckpointExistsError) as exists:
        bcp.save(state, f"{secret_uri}/a")
    with pytest.raises(bcp.errors.CheckpointNotFoundError) as missing:
        bcp.open(f"{secret_uri}/missing")
    with pytest.raises(TypeError) as bad_option:
        backend_for(f"{secret_uri}/a?bogus=1")
    manager = bcp.CheckpointManager(secret_uri, keep_last=1, async_save=False)
    for step in (1, 2):
        manager.save(step, state)
    assert manager.latest() == 2
    for error in (exists.value, missing.value, bad_option.value):
        assert SECRET not in str(error) and SECRET not in repr(error.args), error
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert caplog.records and SECRET not in logged


def test_bcp_ls_shows_no_secret(secret_uri, capsys, monkeypatch):
    from bcp.cli import main

    bcp_logger = logging.getLogger("bcp")
    monkeypatch.setattr(bcp_logger, "level", bcp_logger.level)
    empty = f"memory://user:{SECRET}@store/empty"
    assert main(["ls", empty]) == 1  # nothing stored there: one line, status 1 (docs/manager.md)
    manager = bcp.CheckpointManager(secret_uri, async_save=False)
    manager.save(5, {"w": torch.ones(2)})
    assert main(["--log-level", "DEBUG", "ls", secret_uri]) == 0
    assert main(["inspect", f"{secret_uri}/step_0000000005"]) == 0
    assert main(["rm", "--dry-run", f"{secret_uri}/step_0000000005"]) == 0
    assert main(["inspect", f"{secret_uri}/nothing"]) == 1
    out = capsys.readouterr()
    assert "user:***@store" in out.out and "committed" in out.out
    assert SECRET not in out.out and SECRET not in out.err, out
