"""Credentials the fsspec way (issue 17): accepted in ``storage_options``, refused in
the URI, and written nowhere (logs at DEBUG, errors, SaveInfo/LoadInfo, the
checkpoint's objects, CLI output), against the real local servers."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import bcp
from bcp.backends import backend_for
from conftest import new_bucket, store_uri
from servers import Server, _start, free_port, rclone_binary
from side_by_side import SideBySide


def _secret() -> str:
    """A recognisable value that appears nowhere unless leaked."""
    return f"SeCrEt{secrets.token_hex(12)}"


def _state() -> dict:
    return {"w": torch.arange(3000, dtype=torch.float32), "meta": {"step": 3}}


def _template() -> dict:
    return {"w": torch.zeros(3000), "meta": {"step": 0}}


def _assert_absent(secret: str, *texts: object) -> None:
    for text in texts:
        assert secret not in str(text), f"the secret appears in: {str(text)[:300]}"


def _stored_bytes(uri: str, **options: object) -> list[tuple[str, bytes]]:
    backend = backend_for(uri, **options)
    return [(key, backend.read(key)) for key in backend.list("")]


# -- refused in the URI, checked in storage_options (no server needed) ------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "s3://b/p?secret={s}",
        "s3://b/p?key={s}",
        "s3://b/p?token={s}",
        "s3://b/p?aws_secret_access_key={s}&region=eu-west-1",
        "s3://b/p?password={s}",
        "s3://AKIAEXAMPLE:{s}@b/p",
        "s3://{s}@b/p",
        "gs://b/p?token={s}",
        "gs://b/p?credentials={s}",
        "gs://user:{s}@b/p",
    ],
)
def test_credentials_in_the_uri_are_refused_without_echoing_them(template):
    secret = _secret()
    with pytest.raises(ValueError, match="do not belong in a URI") as info:
        backend_for(template.format(s=secret))
    message = str(info.value)
    assert "storage_options" in message, "the error must say where credentials go"
    _assert_absent(secret, message, repr(info.value))


@pytest.mark.parametrize(
    ("uri", "options", "match"),
    [
        ("s3://b/p", {"key": "AKIAEXAMPLE"}, "key and secret go together"),
        ("s3://b/p", {"secret": "{s}"}, "key and secret go together"),
        ("s3://b/p", {"token": "{s}"}, "needs key and secret"),
        ("s3://b/p", {"key": "A", "aws_access_key_id": "B", "secret": "{s}"}, "same credential"),
        ("s3://b/p", {"key": "A", "secret": 12345678}, "secret must be a non-empty string, got int"),
        ("s3://b/p", {"key": "A", "secret": "{s}", "anon": True}, "exclude each other"),
        ("s3://b/p", {"key": "A", "secret": "{s}", "profile": "dev"}, "exclude each other"),
        ("s3://b/p", {"key": "A", "secret": "{s}", "colour": "{s}"}, "unknown option.*colour"),
        ("gs://b/p", {"token": 12345678}, "token must be"),
        ("gs://b/p", {"token": "{s}", "anon": True}, "exclude each other"),
        ("gs://b/p", {"token": "{s}", "shape": "{s}"}, "unknown option.*shape"),
    ],
)
def test_bad_credential_options_are_named_without_echoing_them(uri, options, match):
    secret = _secret()
    filled = {k: v.format(s=secret) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(TypeError, match=match) as info:
        backend_for(uri, **filled)
    _assert_absent(secret, info.value, repr(info.value))


# -- S3 (moto): accepted from storage_options, written nowhere ----------------------------------------


@pytest.fixture(scope="module")
def moto_bucket(moto_server) -> str:
    return new_bucket(moto_server)


def test_s3_credentials_from_storage_options_are_written_nowhere(moto_server, moto_bucket, caplog):
    secret, token = _secret(), _secret()
    creds = {"key": "AKIAUSERA", "secret": secret, "token": token}
    uri = store_uri("moto", moto_server, moto_bucket, uuid.uuid4().hex)
    with caplog.at_level(logging.DEBUG, logger="bcp"):
        saved = bcp.save(_state(), uri, storage_options=creds)
        info = bcp.load_with_info(_template(), uri, storage_options=creds)
        with pytest.raises(bcp.CheckpointError) as missing:
            bcp.load(_template(), store_uri("moto", moto_server, moto_bucket, "missing"), storage_options=creds)
        backend = backend_for(uri, **creds)
    assert torch.equal(info.state["w"], _state()["w"]), "the credentials from storage_options did not work"
    bcp_records = [r for r in caplog.records if r.name.startswith("bcp")]
    assert bcp_records, "no bcp log records were captured at DEBUG"
    for value in (secret, token):
        _assert_absent(value, *(r.getMessage() for r in caplog.records))
        _assert_absent(value, saved, repr(saved), info.uri, repr(info), missing.value, repr(missing.value))
        _assert_absent(value, backend, backend.uri, repr(backend.unwrap()))
    stored = _stored_bytes(uri, **creds)
    assert any(key.endswith("manifest.json") for key, _ in stored), "the manifest was not among the objects"
    for key, data in stored:
        for value in (secret, token, "AKIAUSERA"):
            assert value.encode() not in data, f"a credential was written into {key}"


def test_cli_never_prints_credentials(moto_server, moto_bucket, tmp_path):
    """The CLI takes credentials from the standard sources (here the environment) and
    refuses them in a URI; neither way do they reach its output, even at DEBUG. Its four
    runs are independent processes, started side by side (each imports torch)."""
    secret = _secret()
    uri = store_uri("moto", moto_server, moto_bucket, uuid.uuid4().hex)
    bcp.save(_state(), uri)
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret}
    base, _, query = uri.partition("?")
    bad_uris = (f"{base}?{query}&secret={secret}", uri.replace("s3://", f"s3://AKIAX:{secret}@", 1))
    runs = SideBySide(workers=4)
    try:
        for name, target in [
            ("shown", uri),
            *((f"refused{i}", bad) for i, bad in enumerate(bad_uris)),
            ("failing", store_uri("moto", moto_server, moto_bucket, "missing")),
        ]:
            runs.submit(
                name, [sys.executable, "-m", "bcp.cli", "--log-level", "DEBUG", "inspect", target], env=env, timeout=120
            )
        shown = runs.result("shown")
        assert shown.returncode == 0, shown.stderr
        assert "1 tensors" in shown.stdout and "[3000]" in shown.stdout, shown.stdout
        _assert_absent(secret, shown.stdout, shown.stderr)
        for i in range(len(bad_uris)):
            refused = runs.result(f"refused{i}")
            assert refused.returncode != 0 and "do not belong in a URI" in refused.stderr, refused.stderr
            _assert_absent(secret, refused.stdout, refused.stderr)
        failing = runs.result("failing")
        assert failing.returncode != 0
        _assert_absent(secret, failing.stdout, failing.stderr)
    finally:
        runs.close()


# -- S3 (rclone, which checks keys): two accounts in one process ----------------------------------------


@pytest.fixture(scope="module")
def two_account_rclone(tmp_path_factory) -> Iterator[tuple[Server, dict, dict]]:
    """``rclone serve s3`` that knows two key pairs, neither of them the environment's:
    a request signed with anything but storage_options' credentials is refused."""
    workdir: Path = tmp_path_factory.mktemp("rclone2")
    root = workdir / "root"
    (root / "shared").mkdir(parents=True)
    a = {"key": "account-a-key", "secret": _secret()}
    b = {"key": "account-b-key", "secret": _secret()}
    port = free_port()
    argv = [rclone_binary(), "serve", "s3", "--addr", f"127.0.0.1:{port}", "--config", os.devnull]
    argv += ["--auth-key", f"{a['key']},{a['secret']}", "--auth-key", f"{b['key']},{b['secret']}"]
    server = _start("rclone-two-accounts", [*argv, "--log-level", "ERROR", str(root)], port, workdir)
    yield server, a, b
    server.stop()


def test_s3_two_accounts_in_one_process(two_account_rclone, caplog):
    server, a, b = two_account_rclone
    uri = store_uri("rclone", server, "shared", uuid.uuid4().hex)
    with pytest.raises(OSError, match="Forbidden"):  # the environment's keys are not this server's
        bcp.save(_state(), uri)
    bcp.save(_state(), uri, storage_options=a)
    loaded = bcp.load(_template(), uri, storage_options=b)
    assert torch.equal(loaded["w"], _state()["w"])
    wrong = {"key": b["key"], "secret": _secret()}
    with caplog.at_level(logging.DEBUG, logger="bcp"), pytest.raises(OSError, match="Forbidden") as info:
        bcp.load(_template(), uri, storage_options=wrong)
    text = f"{info.value!r} {info.value} {info.value.__cause__!r}"
    for secret in (wrong["secret"], a["secret"], b["secret"]):
        _assert_absent(secret, text, *(r.getMessage() for r in caplog.records))


# -- GCS (gcp-storage-emulator): token from storage_options, written nowhere ------------------------------


def test_gcs_token_from_storage_options_is_written_nowhere(gcs_server, caplog):
    """An access token in a google.auth Credentials object (gcsfs sends it as
    ``Authorization: Bearer``; the emulator accepts any) stands for every form of
    ``token`` gcsfs takes: the others (a raw token string, a key file, a dict) need
    Google's OAuth endpoints, which the tests cannot reach."""
    from google.oauth2.credentials import Credentials

    bucket = new_bucket(gcs_server)
    token = f"ya29.{_secret()}"
    uri = f"gs://{bucket}/{uuid.uuid4().hex}?endpoint_url={gcs_server.endpoint}&conditional_writes=false"
    creds = {"token": Credentials(token)}
    with caplog.at_level(logging.DEBUG, logger="bcp"):
        saved = bcp.save(_state(), uri, storage_options=creds)
        info = bcp.load_with_info(_template(), uri, storage_options=creds)
        with pytest.raises(bcp.CheckpointError) as missing:
            bcp.load(_template(), f"gs://{bucket}/missing?endpoint_url={gcs_server.endpoint}", storage_options=creds)
        backend = backend_for(uri, **creds)
    assert torch.equal(info.state["w"], _state()["w"])
    assert backend.unwrap().fs.credentials.credentials.token == token, "gcsfs did not get the token"
    assert [r for r in caplog.records if r.name.startswith("bcp")], "no bcp log records were captured at DEBUG"
    _assert_absent(token, *(r.getMessage() for r in caplog.records if r.name.startswith("bcp")))
    _assert_absent(token, saved, repr(saved), repr(info), missing.value, repr(missing.value), backend)
    stored = _stored_bytes(uri, **creds)
    assert any(key.endswith("manifest.json") for key, _ in stored)
    for key, data in stored:
        assert token.encode() not in data, f"the token was written into {key}"


def test_options_reprs_leave_storage_options_out():
    """SaveOptions/LoadOptions may be logged or printed by users: their repr never shows
    storage_options, which may hold credentials."""
    secret = "sk-" + uuid.uuid4().hex
    for options in (
        bcp.SaveOptions(storage_options={"secret": secret}),
        bcp.LoadOptions(storage_options={"token": secret}),
    ):
        assert secret not in repr(options) and "storage_options" not in repr(options)
        assert options.storage_options is not None and secret in options.storage_options.values()
