"""Saves and loads through an object store that throttles, stalls and drops connections.

Real servers (moto_server, rclone serve s3, the GCS emulator) behind the fault proxy of
``tests/netproxy.py``, which answers a share of requests ``503 SlowDown``, lets a
request hang, resets connections in the middle of a body, or loses the answer to a
request the server carried out. The promise under test: a save either completes with
every byte right, or fails with a StorageError naming the object within a bounded time,
and never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import time
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.objectstore import Timeouts
from bcp.errors import CommitUncertainError
from conftest import new_bucket, store_uri
from netproxy import proxied, read_stats

UPLOADS = {"PUT", "POST"}


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    # 24 MiB in 4 tensors: with 5 MiB parts, several parts and a small catalog per save
    return {f"layer{i}.weight": torch.rand(3 << 19, generator=g) for i in range(4)} | {"step": 3}


def _template() -> dict:
    return {f"layer{i}.weight": torch.empty(3 << 19) for i in range(4)} | {"step": 0}


def _assert_exact(loaded: dict, state: dict) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def _via(endpoint: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(endpoint=endpoint)


@pytest.fixture
def servers(moto_server, rclone_server, gcs_server) -> dict:
    return {"moto": moto_server, "rclone": rclone_server, "gcs": gcs_server}


def test_the_proxy_adds_latency_and_caps_bandwidth(moto_server):
    """The harness does what the benchmark relies on: each round trip costs the latency,
    and a connection carries no more than the cap."""
    bucket = new_bucket(moto_server)
    direct = backend_for(store_uri("moto", moto_server, bucket))
    direct.write("blob", bytes(4 << 20))
    with proxied(moto_server.endpoint, latency=0.05, bandwidth=8e6) as endpoint:
        slow = backend_for(store_uri("moto", _via(endpoint), bucket, concurrency="1"))
        start = time.monotonic()
        for _ in range(5):
            slow.size("blob")
        sized = time.monotonic() - start
        start = time.monotonic()
        assert slow.read("blob") == bytes(4 << 20)
        read = time.monotonic() - start
    assert sized >= 5 * 0.05
    assert read >= (4 << 20) / 8e6 * 0.9  # 4 MiB at 8 MB/s: half a second at least


def test_the_proxy_throttles_exactly_the_first_n_requests_it_may_fault(moto_server, tmp_path):
    """``slowdown_first``: a count, not a share; ``path`` and ``methods`` say which requests count."""
    bucket = new_bucket(moto_server)
    direct = backend_for(store_uri("moto", moto_server, bucket))
    direct.write("data/a", b"x" * 10)
    direct.write("other", b"y")
    stats = tmp_path / "stats.json"
    with proxied(moto_server.endpoint, stats=stats, slowdown_first=2, path="/data/", methods={"GET"}) as endpoint:
        once = backend_for(store_uri("moto", _via(endpoint), bucket, retries="0"))  # no retry: each fault shows
        assert once.read("other") == b"y", "another path: never throttled"
        once.write("data/b", b"z")  # a PUT: not a method the faults apply to
        for _ in range(2):
            with pytest.raises(bcp.StorageError, match="gave up after 1 attempt"):
                once.read("data/a")
        assert once.read("data/a") == b"x" * 10, "the third request for it goes through"
        assert once.read("data/b") == b"z"
    injected = read_stats(stats)
    assert injected.slowdown == 2 and injected.requests >= 6, injected
    assert injected.reset == injected.stall == injected.lost == 0


@pytest.mark.parametrize("kind", ["moto", "rclone", "gcs"])
@pytest.mark.parametrize(
    "fault",
    [
        {"slowdown": 0.25},
        {"reset": 0.25, "methods": UPLOADS},
        {"lost": 0.25, "methods": UPLOADS},
    ],
    ids=["503-slowdown", "reset-mid-upload", "answer-lost"],
)
def test_a_save_through_faults_completes_with_every_byte_right(servers, kind, fault, tmp_path):
    server = servers[kind]
    bucket = new_bucket(server)
    stats = tmp_path / "stats.json"
    state = _state()
    with proxied(server.endpoint, stats=stats, seed=1, **fault) as endpoint:
        uri = store_uri(kind, _via(endpoint), bucket, "ckpt", retry_base_delay="0.01", retry_max_delay="0.1")
        bcp.save(state, uri)
    injected = read_stats(stats)
    assert injected.slowdown + injected.reset + injected.lost > 0, injected
    direct = store_uri(kind, server, bucket, "ckpt")
    _assert_exact(bcp.load(_template(), direct), state)
    if kind != "gcs":  # parts of multipart uploads retried or lost are not left behind
        assert backend_for(direct).unwrap().pending_uploads() == []


@pytest.mark.parametrize("kind", ["moto", "gcs"])
def test_a_stalled_upload_is_abandoned_after_the_timeout_and_sent_again(servers, kind, tmp_path):
    server = servers[kind]
    bucket = new_bucket(server)
    stats = tmp_path / "stats.json"
    state = _state()
    with proxied(server.endpoint, stats=stats, seed=3, stall=0.2, methods=UPLOADS) as endpoint:
        uri = store_uri(
            kind, _via(endpoint), bucket, "ckpt", timeout="1", min_throughput="1GiB", retry_base_delay="0.01"
        )
        start = time.monotonic()
        bcp.save(state, uri)
        took = time.monotonic() - start
    assert read_stats(stats).stall > 0
    assert took < 60
    _assert_exact(bcp.load(_template(), store_uri(kind, server, bucket, "ckpt")), state)


@pytest.mark.parametrize("kind", ["moto", "rclone", "gcs"])
def test_a_store_that_never_answers_fails_the_save_in_bounded_time_and_keeps_the_last_good_step(
    servers, kind, tmp_path
):
    server = servers[kind]
    bucket = new_bucket(server)
    state = _state()
    good = bcp.CheckpointManager(store_uri(kind, server, bucket, "run"), async_save=False)
    good.save(1, state)
    changed = {k: (v + 1 if isinstance(v, torch.Tensor) else 4) for k, v in state.items()}
    with proxied(server.endpoint, stall=1.0, methods=UPLOADS) as endpoint:
        hung = bcp.CheckpointManager(
            store_uri(
                kind,
                _via(endpoint),
                bucket,
                "run",
                timeout="0.5",
                min_throughput="1GiB",
                retries="2",
                retry_deadline="2",
            ),
            async_save=False,
        )
        start = time.monotonic()
        with pytest.raises(bcp.StorageError) as failure:
            hung.save(2, changed)
        took = time.monotonic() - start
    assert took < 30
    message = str(failure.value)
    assert "0.5" in message and "step_0000000002" in message and "rank00000" in message, message
    fresh = bcp.CheckpointManager(store_uri(kind, server, bucket, "run"))
    assert fresh.steps() == [1]
    step, loaded = fresh.load_latest(_template())
    assert step == 1
    _assert_exact(loaded, state)


@pytest.mark.parametrize("kind", ["moto", "rclone"])
def test_a_load_through_resets_and_stalls_reads_every_byte_right(servers, kind, tmp_path):
    server = servers[kind]
    bucket = new_bucket(server)
    state = _state()
    bcp.save(state, store_uri(kind, server, bucket, "ckpt"))
    stats = tmp_path / "stats.json"
    with proxied(server.endpoint, stats=stats, seed=2, reset=0.4, stall=0.2, methods={"GET"}) as endpoint:
        loaded = bcp.load(_template(), store_uri(kind, _via(endpoint), bucket, "ckpt", timeout="1"))
    injected = read_stats(stats)
    assert injected.reset + injected.stall > 0, injected
    _assert_exact(loaded, state)


@settings(max_examples=6, deadline=None)
@given(
    slowdown=st.sampled_from([0.0, 0.1, 0.3]),
    reset=st.sampled_from([0.0, 0.1, 0.3]),
    lost=st.sampled_from([0.0, 0.1, 0.3]),
    stall=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 10_000),
)
def test_any_mix_of_faults_either_saves_exactly_or_fails_and_commits_nothing(
    moto_server, slowdown, reset, lost, stall, seed
):
    bucket = new_bucket(moto_server)
    state = _state()
    with proxied(moto_server.endpoint, seed=seed, slowdown=slowdown, reset=reset, lost=lost, stall=stall) as endpoint:
        uri = store_uri(
            "moto",
            _via(endpoint),
            bucket,
            "ckpt",
            timeout="1",
            retries="3",
            retry_base_delay="0.01",
            retry_deadline="8",
        )
        try:
            bcp.save(state, uri)
        except CommitUncertainError:  # the manifest's answers lost and its read-back failed: either outcome
            saved = None
        except bcp.StorageError:
            saved = False
        else:
            saved = True
    direct = store_uri("moto", moto_server, bucket, "ckpt")
    if saved is None and bcp.exists(direct):  # it landed: then it is the whole checkpoint
        saved = True
    if saved:
        _assert_exact(bcp.load(_template(), direct), state)
    else:
        with pytest.raises((bcp.IncompleteCheckpointError, bcp.CheckpointNotFoundError)):
            bcp.load(_template(), direct)


def test_timeout_options_are_checked():
    with pytest.raises(ValueError, match="timeout"):
        backend_for("s3://bucket/x?timeout=soon")
    with pytest.raises(ValueError, match="timeout"):
        backend_for("s3://bucket/x?timeout=-1")
    with pytest.raises(ValueError, match="min_throughput"):
        backend_for("s3://bucket/x?min_throughput=fast")
    for none in ("0", "0.00", "none"):
        assert backend_for(f"s3://bucket/x?timeout={none}").unwrap().timeouts.limit(1 << 30) is None
    gcs = backend_for("gs://bucket/x?anon=true&timeout=2.5&min_throughput=2MiB").unwrap()
    assert gcs.timeouts.idle == 2.5 and gcs.timeouts.limit(4 << 20) == 4.5
    default = backend_for("s3://bucket/x").unwrap().timeouts
    assert default.idle == 60.0 and default.limit(16 << 20) == 76.0  # 16 MiB at 1 MiB/s, plus the idle time


@settings(max_examples=50, deadline=None)
@given(
    idle=st.floats(0.01, 1000),
    rate=st.integers(1, 1 << 40),
    small=st.integers(0, 1 << 40),
    extra=st.integers(0, 1 << 40),
)
def test_a_request_is_allowed_more_time_the_more_it_moves(idle, rate, small, extra):
    """Slow links are not cut off: the limit never shrinks as a request grows, and never
    drops below the idle timeout."""
    timeouts = Timeouts(idle, rate)
    assert idle <= timeouts.limit(small) <= timeouts.limit(small + extra)


# -- streamed-file backends (fsspec, HDFS): a stream cannot be rewound ------------------------------

#: s3fs with no retries of its own: each throttled request reaches bcp's retry loop
_S3FS_ONCE = {"default_block_size": 5 << 20, "config_kwargs": {"retries": {"total_max_attempts": 1}}}


def test_a_failed_stream_write_is_not_written_again_and_nothing_commits(moto_server, tmp_path):
    """fsspec+s3 buffers a write's bytes before the part upload that fails: bcp's retry
    loop wrote them a second time, and a save whose data file held 32 MiB for 24 looked
    complete. Now the stream's first failure ends the object, named in the error."""
    bucket = new_bucket(moto_server)
    state = _state()
    with proxied(moto_server.endpoint, slowdown_first=5, path="partNumber", methods={"PUT"}) as endpoint:
        uri = f"fsspec+s3://{bucket}/ckpt?endpoint_url={endpoint}&retry_base_delay=0.01"
        with pytest.raises(bcp.StorageError, match=r"an earlier write to its stream failed \(.*reduce your request"):
            bcp.save(state, uri, storage_options=_S3FS_ONCE)
    direct = backend_for(f"fsspec+s3://{bucket}/ckpt?endpoint_url={moto_server.endpoint}")
    assert not direct.exists("manifest.json"), "a failed save looks complete"
    bcp.save(state, f"fsspec+s3://{bucket}/ckpt?endpoint_url={moto_server.endpoint}", storage_options=_S3FS_ONCE)
    _assert_exact(bcp.load(_template(), f"fsspec+s3://{bucket}/ckpt?endpoint_url={moto_server.endpoint}"), state)


def test_a_retried_commit_of_an_aborted_writer_names_the_failure_that_aborted_it(moto_server):
    """A throttled rename (the commit) aborts the streamed writer; the retry loop's next
    commit then said only "already aborted", the real error lost."""
    bucket = new_bucket(moto_server)
    with proxied(moto_server.endpoint, slowdown_first=5, path="data/rank00000-0.bin", methods={"PUT"}) as endpoint:
        uri = f"fsspec+s3://{bucket}/ckpt?endpoint_url={endpoint}&retry_base_delay=0.01"
        with pytest.raises(bcp.StorageError, match=r"already aborted after its commit failed \(.*reduce your request"):
            bcp.save({"w": torch.ones(1000)}, uri, storage_options=_S3FS_ONCE)
