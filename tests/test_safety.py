"""Every error the foundation promises, and that nothing is ever lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import bcp
from bcp.backends import backend_for
from bcp.io_scheduler.staging import StagingPool
from bcp.metadata import MANIFEST_KEY
from bcp.metadata.keys import GENERATION_PREFIX
from bcp.metadata.manifest import reseal
from helpers import assert_same


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": seed}


def test_existing_checkpoint_is_refused_and_untouched(uri):
    bcp.save(small_state(1), uri)
    backend = backend_for(uri)
    before = {k: backend.read(k) for k in backend.list()}
    with pytest.raises(bcp.CheckpointExistsError, match="overwrite=True"):
        bcp.save(small_state(2), uri)
    after = {k: backend.read(k) for k in backend.list()}
    assert before == after, "a refused save changed the existing checkpoint"
    assert bcp.open(uri).read("step") == 1


def test_overwrite_replaces_and_drops_the_old_generation(uri):
    bcp.save(small_state(1), uri)
    old_gen = bcp.open(uri).manifest.generation
    bcp.save(small_state(2), uri, overwrite=True)
    r = bcp.open(uri)
    assert r.read("step") == 2 and torch.equal(r.read("w"), small_state(2)["w"])
    assert r.manifest.generation != old_gen
    assert not list(backend_for(uri).list(old_gen + "/")), "old generation left behind after overwrite"


class _Boom(RuntimeError):
    pass


def test_failed_save_leaves_previous_checkpoint_and_no_commit(uri, monkeypatch):
    bcp.save(small_state(1), uri)
    manifest_before = backend_for(uri).read(MANIFEST_KEY)
    from bcp.io_scheduler.write_pipeline import WritePipeline

    def failing_finish(self):
        self.abort()
        raise _Boom("disk on fire")

    monkeypatch.setattr(WritePipeline, "finish", failing_finish)
    with pytest.raises(_Boom):
        bcp.save(small_state(2), uri, overwrite=True)
    assert backend_for(uri).read(MANIFEST_KEY) == manifest_before
    assert_same(bcp.load(small_state(9), uri), small_state(1))
    gens = {k.split("/")[0] for k in backend_for(uri).list(GENERATION_PREFIX)}
    assert gens == {bcp.open(uri).manifest.generation}, "failed save left its generation behind"


def test_failure_while_writing_data_aborts_the_partial_object(tmp_path, monkeypatch):
    uri = str(tmp_path / "ck")
    calls = {"n": 0}
    real = os.pwrite

    def flaky(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    with pytest.raises(bcp.StorageError, match="No space left"):
        bcp.save(small_state(), uri)
    assert not os.path.exists(os.path.join(uri, MANIFEST_KEY))
    leftovers = [os.path.join(d, f) for d, _, fs in os.walk(uri) for f in fs]
    assert leftovers == [], f"partial files left behind: {leftovers}"


def test_killed_save_leaves_no_commit_and_previous_checkpoint_loads(tmp_path):
    """SIGKILL in the middle of writing data: the old checkpoint must load intact."""
    uri = str(tmp_path / "ck")
    bcp.save(small_state(1), uri)
    script = textwrap.dedent(
        f"""
        import os, signal, torch, bcp
        from bcp.backends import file as fb
        real = fb._FileWriter.write_at
        n = {{"calls": 0}}
        def write_then_die(self, offset, data):
            real(self, offset, data)
            n["calls"] += 1
            if n["calls"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        fb._FileWriter.write_at = write_then_die
        state = {{f"t{{i}}": torch.full((1024, 256), float(i)) for i in range(8)}}
        bcp.save(state, {uri!r}, overwrite=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    r = bcp.open(uri)
    assert r.read("step") == 1 and torch.equal(r.read("w"), small_state(1)["w"])
    assert set(r.tensor_keys()) == {"w", "b"}


def test_uncommitted_checkpoint_is_reported_incomplete(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    os.remove(os.path.join(uri, MANIFEST_KEY))
    with pytest.raises(bcp.IncompleteCheckpointError, match="never committed"):
        bcp.open(uri)
    with pytest.raises(bcp.IncompleteCheckpointError):
        bcp.load(small_state(), uri)


def test_missing_checkpoint(uri):
    with pytest.raises(bcp.CheckpointNotFoundError):
        bcp.open(uri)
    with pytest.raises(FileNotFoundError):
        bcp.load(small_state(), uri)


def _data_file(uri: str) -> tuple[str, int]:
    r = bcp.open(uri)
    frag = r.meta("w").fragments[0]
    return frag.file, frag.byte_offset


def test_corrupted_byte_is_caught_with_tensor_file_and_offset(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    file, start = _data_file(uri)
    path = os.path.join(uri, file)
    with open(path, "r+b") as f:
        f.seek(start + 100)
        byte = f.read(1)
        f.seek(start + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(bcp.CorruptCheckpointError) as err:
        bcp.load(small_state(), uri)
    msg = str(err.value)
    assert "'w'" in msg and file in msg and f"[{start}," in msg, msg
    assert err.value.fqn == "w" and err.value.file == file and err.value.offset == start
    with pytest.raises(bcp.CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        bcp.open(uri).read("w")
    # the other tensor is intact and still readable on its own
    assert torch.equal(bcp.open(uri).read("b"), small_state()["b"])


def test_truncated_data_file_is_reported(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    file, _ = _data_file(uri)
    path = os.path.join(uri, file)
    os.truncate(path, 1000)
    with pytest.raises(bcp.CorruptCheckpointError, match="truncated"):
        bcp.load(small_state(), uri)


def test_missing_data_file_is_reported(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    file, _ = _data_file(uri)
    os.remove(os.path.join(uri, file))
    with pytest.raises(bcp.CorruptCheckpointError, match="is missing"):
        bcp.open(uri).read("w")


def test_corrupted_catalog_is_reported(tmp_path):
    uri = str(tmp_path / "ck")
    bcp.save(small_state(), uri)
    cat = bcp.open(uri).manifest.catalog.path
    with open(os.path.join(uri, cat), "r+b") as f:
        f.seek(50)
        f.write(b"\xff\xff")
    with pytest.raises(bcp.CorruptCheckpointError, match=r"fragments\.arrow"):
        bcp.open(uri)


def test_newer_format_version_is_refused_clearly(uri):
    bcp.save(small_state(), uri)
    backend = backend_for(uri)
    doc = json.loads(backend.read(MANIFEST_KEY))
    doc["version"] = 99
    backend.write(MANIFEST_KEY, reseal(doc))
    with pytest.raises(bcp.FormatError, match="version 99 was written by a newer bcp"):
        bcp.open(uri)


def test_garbage_manifest_is_a_format_error(uri):
    bcp.save(small_state(), uri)
    backend_for(uri).write(MANIFEST_KEY, b"{not json")
    with pytest.raises(bcp.FormatError, match=r"manifest\.json: not valid JSON"):
        bcp.open(uri)


def test_unknown_scheme_lists_registered_schemes():
    with pytest.raises(ValueError, match="nosuch://") as err:
        bcp.save(small_state(), "nosuch://bucket/x")
    msg = str(err.value)
    assert "nosuch://bucket/x" in msg and "file://" in msg and "memory://" in msg


def test_strict_mismatch_lists_everything_at_once(uri):
    bcp.save({"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(4), "gone": torch.zeros(1), "n": 1}, uri)
    template = {
        "a": torch.zeros(3),
        "b": torch.zeros(3, 2),
        "c": torch.zeros(4, dtype=torch.float64),
        "new": torch.zeros(1),
        "n": torch.zeros(1),
    }
    with pytest.raises(bcp.StateMismatchError) as err:
        bcp.load(template, uri)
    e = err.value
    assert e.missing == ["new"] and e.unexpected == ["gone"]
    assert e.shape_mismatch == [("b", (3, 2), (2, 2))]
    assert e.dtype_mismatch == [("c", "float64", "float32")]
    assert e.kind_mismatch == [("n", "a tensor", "an object")]
    assert torch.equal(template["a"], torch.zeros(3)), "strict failure must not have loaded anything"
    for word in (
        "missing keys",
        "unexpected keys",
        "shape mismatch (state, checkpoint): b ([3, 2], [2, 2])",
        "dtype mismatch (state, checkpoint): c (float64, float32)",
        "kind mismatch (state, checkpoint): n (a tensor, an object)",
    ):
        assert word in str(e)


def test_non_strict_loads_the_overlap_and_casts(uri):
    bcp.save({"a": torch.arange(3.0), "c": torch.arange(4.0), "gone": torch.zeros(1)}, uri)
    template = {"a": torch.zeros(3), "c": torch.zeros(4, dtype=torch.float64), "new": torch.full((1,), 7.0)}
    out = bcp.load(template, uri, strict=False)
    assert torch.equal(out["a"], torch.arange(3.0))
    assert torch.equal(out["c"], torch.arange(4.0, dtype=torch.float64))
    assert out["new"].item() == 7.0
    with pytest.raises(bcp.StateMismatchError, match="shape mismatch"):
        bcp.load({"a": torch.zeros(5)}, uri, strict=False)


def test_unencodable_object_names_its_key(uri):
    class Custom:
        pass

    with pytest.raises(bcp.UnsupportedStateError, match=r"key 'cfg'.*\['inner'\].*Custom"):
        bcp.save({"w": torch.zeros(1), "cfg": {"inner": Custom()}}, uri)
    assert not list(backend_for(uri).list()), "a refused save wrote something"


def test_pickle_needs_opt_in_on_both_sides(uri):
    from fractions import Fraction

    bcp.save({"w": torch.zeros(1), "frac": Fraction(1, 3)}, uri, allow_pickle=True)
    with pytest.raises(bcp.UnsupportedStateError, match="'frac' was pickled"):
        bcp.load({"w": torch.zeros(1), "frac": None}, uri)
    out = bcp.load({"w": torch.zeros(1), "frac": None}, uri, allow_pickle=True)
    assert out["frac"] == Fraction(1, 3)


def test_a_planted_pickle_is_never_executed(tmp_path):
    """A tampered checkpoint with a pickle payload must not run it on load."""
    uri = str(tmp_path / "ck")
    bcp.save({"w": torch.zeros(1), "obj": 1}, uri)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    import base64
    import pickle

    backend = backend_for(uri)
    doc = json.loads(backend.read(MANIFEST_KEY))
    payload = base64.b64encode(pickle.dumps(Exploit())).decode()
    doc["objects"]["obj"][0]["value"] = {"$bcp": "pickle", "v": payload}
    backend.write(MANIFEST_KEY, reseal(doc))
    with pytest.raises(bcp.UnsupportedStateError):
        bcp.load({"w": torch.zeros(1), "obj": None}, uri)
    with pytest.raises(bcp.UnsupportedStateError):
        bcp.open(uri).objects()
    assert not marker.exists(), "loading executed code from the checkpoint"


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, "same key 'a.b'"),
        ({"d": {0: torch.zeros(1), "0": torch.zeros(1)}}, "both flatten to '0'"),
        ({"q": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8)}, "key 'q'.*quantized"),
        ({"s": torch.zeros(3, 3).to_sparse()}, "key 's'.*layout"),
        ({"m": torch.zeros(2, device="meta")}, "key 'm'.*meta"),
    ],
)
def test_unsaveable_states_fail_naming_the_key(uri, state, match):
    with pytest.raises(bcp.UnsupportedStateError, match=match):
        bcp.save(state, uri)


def test_racing_saves_commit_exactly_once(uri):
    """Without overwrite, of several saves racing to one URI exactly one commits."""
    results: list[object] = []
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            bcp.save(small_state(i), uri)
            results.append(i)
        except bcp.CheckpointExistsError as e:
            results.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, int)]
    assert len(winners) == 1, f"expected one winner, got {results}"
    r = bcp.open(uri)
    assert r.read("step") == winners[0] and torch.equal(r.read("w"), small_state(winners[0])["w"])
    gens = {k.split("/")[0] for k in backend_for(uri).list(GENERATION_PREFIX)}
    assert gens == {r.manifest.generation}, "losing saves left data behind"


@pytest.mark.parametrize("block", [(1 << 32) + 1, 1 << 40, True, 4096.0])
def test_a_checksum_block_size_readers_refuse_is_refused_at_save(tmp_path, block):
    """Readers accept checksum.block_bytes up to MAX_CHECKSUM_BLOCK_BYTES (an integer):
    a save must not write a checkpoint that no reader loads."""
    with pytest.raises((ValueError, TypeError), match="checksum_block_bytes"):
        bcp.SaveOptions(checksum_block_bytes=block)
    with pytest.raises((ValueError, TypeError), match="checksum_block_bytes"):
        bcp.save({"w": torch.ones(2)}, str(tmp_path / "ck"), checksum_block_bytes=block)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("block", [100, 3 << 20, 64 << 20])
def test_a_block_that_does_not_divide_the_staging_slab_is_refused_up_front(tmp_path, block):
    """Accepted by SaveOptions, the save then failed in its pipeline (a raw ValueError)."""
    with pytest.raises(ValueError, match=r"checksum_block_bytes must divide the staging slab size, 33554432 bytes"):
        bcp.SaveOptions(checksum_block_bytes=block)
    with pytest.raises(ValueError, match=r"checksum_block_bytes must divide"):
        bcp.save({"w": torch.ones(2)}, str(tmp_path / "ck"), checksum_block_bytes=block)
    assert not (tmp_path / "ck").exists()
    pool = StagingPool(1 << 30, slab_bytes=block * 4)
    bcp.save({"w": torch.arange(5.0)}, str(tmp_path / "ok"), checksum_block_bytes=block, pool=pool)
    assert torch.equal(bcp.open(str(tmp_path / "ok")).read("w"), torch.arange(5.0))


def test_checksum_block_sizes_readers_accept_are_accepted(tmp_path):
    import numpy as np

    from bcp.metadata.manifest import MAX_CHECKSUM_BLOCK_BYTES

    pool = StagingPool(2 << 32, slab_bytes=1 << 32)  # slabs are made when a save takes them
    assert bcp.SaveOptions(checksum_block_bytes=MAX_CHECKSUM_BLOCK_BYTES, pool=pool).checksum_block_bytes == 1 << 32
    uri = str(tmp_path / "ck")
    bcp.save({"w": torch.arange(5.0)}, uri, checksum_block_bytes=np.int64(1 << 20))  # an integer, not an int
    assert bcp.open(uri).manifest.checksum_block_bytes == 1 << 20
    assert torch.equal(bcp.open(uri).read("w"), torch.arange(5.0))
