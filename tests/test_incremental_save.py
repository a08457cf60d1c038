"""Incremental saves (``base=``, ``incremental=True``): only changed pieces are written,
the others refer to the base's stored bytes (metadata/FORMAT.md, "References").

Each checkpoint is read back here as a reader written from FORMAT.md would (catalog
rows, the manifest's data files, references at ``NAME/PATH`` of the parent, block
checksums), independently of bcp's own loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bcp
import bcp.incremental
import bcp.save_phases
from bcp.metadata import block_checksums
from bcp.metadata.keys import split_parent
from bcp.pieces import cut_pieces, rows_per_piece
from bcp.shards import Piece
from bcp.target import resolve_backend
from bcp.verify import verify_checkpoint

PIECE = 256  # bytes: float32 rows of 16 values are 64 bytes, so a piece is 4 rows


def read_as_format(uri: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``uri``, read from its catalog rows and data
    files as FORMAT.md says (block checksums and digests checked)."""
    reader = bcp.open(uri)
    manifest = reader.manifest
    owner = {f.path: f.checkpoint for f in manifest.data_files}
    backend = resolve_backend(uri)
    parent = resolve_backend(split_parent(uri)[0])
    reader.catalog.require_all()
    out: dict[str, torch.Tensor] = {}
    for frag in reader.catalog.fragments:
        dtype = getattr(torch, frag.dtype)
        t = out.setdefault(frag.fqn, torch.zeros(frag.global_shape, dtype=dtype))
        ck = owner[frag.file]
        data = (
            backend.read(frag.file, frag.byte_offset, frag.nbytes)
            if ck is None
            else parent.read(f"{ck}/{frag.file}", frag.byte_offset, frag.nbytes)
        )
        assert len(data) == frag.nbytes
        assert list(block_checksums(data, manifest.checksum_block_bytes)) == list(frag.checksums)
        box = t[tuple(slice(o, o + n) for o, n in zip(frag.offsets, frag.lengths, strict=True))]
        box.copy_(torch.frombuffer(bytearray(data), dtype=dtype).reshape(box.shape) if frag.nbytes else box)
    reader.close()
    return out


def own_bytes(uri: str) -> int:
    """Bytes in the checkpoint's own data files, from the store."""
    backend = resolve_backend(uri)
    manifest = bcp.open(uri).manifest
    return sum(backend.size(f.path) for f in manifest.data_files if f.checkpoint is None)


def pieces_of(t: torch.Tensor) -> list[tuple[tuple, bytes]]:
    shape = tuple(t.shape)
    whole = Piece((tuple(0 for _ in shape), shape), t)
    return [(p.box, p.tensor.contiguous().numpy().tobytes()) for p in cut_pieces(whole, t.dtype, PIECE)]


def changed_bytes(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None) -> int:
    total = 0
    for k, t in new.items():
        before = dict(pieces_of(old[k])) if old is not None else {}
        total += sum(len(b) for box, b in pieces_of(t) if before.get(box) != b)
    return total


def test_cut_pieces_are_whole_rows_at_multiples_of_rows_per_piece():
    t = torch.zeros(10, 16)
    rows = rows_per_piece((10, 16), torch.float32, PIECE)
    assert rows == 4
    cut = cut_pieces(Piece(((3, 0), (10, 16)), t), torch.float32, PIECE)
    assert [p.box for p in cut] == [((3, 0), (1, 16)), ((4, 0), (4, 16)), ((8, 0), (4, 16)), ((12, 0), (1, 16))]
    assert [p.tensor.shape[0] for p in cut] == [1, 4, 4, 1]
    big = cut_pieces(Piece(((0, 0), (3, 100)), torch.zeros(3, 100)), torch.float32, PIECE)  # a row > PIECE
    assert [p.box[1][0] for p in big] == [1, 1, 1]


state_shapes = st.lists(st.tuples(st.integers(1, 24), st.sampled_from([16, 32])), min_size=1, max_size=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=state_shapes, data=st.data())
def test_each_step_reads_back_and_writes_only_changed_pieces(uri_factory, shapes, data):
    state = {f"t{i}": torch.randn(r, c) for i, (r, c) in enumerate(shapes)}
    uris: list[str] = []
    saved: list[dict[str, torch.Tensor]] = []
    steps = data.draw(st.integers(2, 3))
    for step in range(steps):
        if step:
            for k, t in state.items():
                if data.draw(st.booleans(), label=f"change {k}"):
                    a = data.draw(st.integers(0, t.shape[0] - 1))
                    b = data.draw(st.integers(a + 1, t.shape[0]))
                    t[a:b] += 1
        uri = uri_factory()
        base = {"base": uris[-1]} if uris else {"incremental": True}
        info = bcp.save(state, uri, checksum_block_bytes=64, piece_bytes=PIECE, **base)
        expect = changed_bytes(state, saved[-1] if saved else None)
        assert own_bytes(uri) == expect == info.bytes_written
        uris.append(uri)
        saved.append({k: v.clone() for k, v in state.items()})
        for u, s in zip(uris, saved, strict=True):  # every checkpoint still equals its step
            got = read_as_format(u)
            assert got.keys() == s.keys()
            loaded = {k: torch.full_like(v, float("nan")) for k, v in s.items()}
            bcp.load(loaded, u)  # and bcp's own loader reads it the same
            for k in s:
                assert torch.equal(got[k], s[k]), (u, k)
                assert torch.equal(loaded[k], s[k]), (u, k)
        owners = {f.checkpoint for f in bcp.open(uri).manifest.data_files} - {None}
        assert owners <= {split_parent(x)[1] for x in uris[:-1]}


def test_references_are_flat_and_the_digests_are_xxh3_128(tmp_path):
    state = {"w": torch.arange(64.0).reshape(4, 16), "v": torch.ones(8, 16)}
    bcp.save(state, str(tmp_path / "a"), incremental=True, piece_bytes=PIECE)
    state["v"][0] += 1
    bcp.save(state, str(tmp_path / "b"), base=str(tmp_path / "a"), piece_bytes=PIECE)
    state["v"][0] += 1
    bcp.save(state, str(tmp_path / "c"), base=str(tmp_path / "b"), piece_bytes=PIECE)
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert doc["version"] == 3
    refs = {f["checkpoint"] for f in doc["data_files"] if "checkpoint" in f}
    assert refs == {"a"}  # w and v[4:8] are a's bytes: never "b", which only refers to them
    reader = bcp.open(str(tmp_path / "c"))
    rows = reader.catalog.fragments
    for f in rows:
        data = read_bytes(tmp_path, "c", f.file, f.byte_offset, f.nbytes, reader.manifest)
        assert f.digest == xxhash.xxh3_128_digest(data)


def read_bytes(root, name, path, offset, n, manifest):
    owner = {f.path: f.checkpoint for f in manifest.data_files}[path] or name
    with open(root / owner / path, "rb") as fh:
        fh.seek(offset)
        return fh.read(n)


def test_a_base_without_digests_gives_a_full_save_with_digests(tmp_path):
    state = {"w": torch.randn(8, 16)}
    bcp.save(state, str(tmp_path / "a"))  # a plain save: no digests
    info = bcp.save(state, str(tmp_path / "b"), base=str(tmp_path / "a"), piece_bytes=PIECE)
    assert info.bytes_written == 8 * 16 * 4
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["version"] == 2
    assert all(f.digest is not None for f in bcp.open(str(tmp_path / "b")).catalog.fragments)
    again = bcp.save(state, str(tmp_path / "c"), base=str(tmp_path / "b"), piece_bytes=PIECE)
    assert again.bytes_written == 0


def test_the_base_must_be_a_committed_sibling(tmp_path):
    state = {"w": torch.randn(4, 16)}
    (tmp_path / "x").mkdir()
    bcp.save(state, str(tmp_path / "x" / "a"), incremental=True)
    with pytest.raises(ValueError, match="is not a sibling"):
        bcp.save(state, str(tmp_path / "b"), base=str(tmp_path / "x" / "a"))
    with pytest.raises(bcp.CheckpointNotFoundError, match=r"base .*nothing.*no committed checkpoint"):
        bcp.save(state, str(tmp_path / "x" / "b"), base=str(tmp_path / "x" / "nothing"))
    with pytest.raises(ValueError, match="is the checkpoint being saved"):
        bcp.save(state, str(tmp_path / "x" / "a"), base=str(tmp_path / "x" / "a"), overwrite=True)
    assert not (tmp_path / "b").exists() and not (tmp_path / "x" / "b" / "manifest.json").exists()


def test_a_base_deleted_between_the_reads_is_not_referred_to(tmp_path, monkeypatch):
    state = {"w": torch.randn(8, 16)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    real = bcp.incremental.read_manifest
    calls = []

    def deleted_after_holds(backend, *args):
        calls.append(os.listdir(tmp_path / "a"))
        if len(calls) == 2:  # the second read, after the holds: the base is being deleted
            holds = [h for g in os.listdir(tmp_path / "a") if g.startswith("gen-") for h in _holds(tmp_path / "a" / g)]
            assert holds, "the holds are written before the base's manifest is read again"
            os.remove(tmp_path / "a" / "manifest.json")
            return None
        return real(backend, *args)

    monkeypatch.setattr(bcp.incremental, "read_manifest", deleted_after_holds)
    info = bcp.save(state, b, base=a, piece_bytes=PIECE)
    assert len(calls) == 2
    assert info.bytes_written == 8 * 16 * 4  # every byte its own
    doc = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert doc["version"] == 2 and all("checkpoint" not in f for f in doc["data_files"])
    assert torch.equal(read_as_format(b)["w"], state["w"])


def test_a_save_whose_base_files_go_while_it_writes_does_not_commit(tmp_path, monkeypatch):
    """A save that outlives the grace period: once its holds are written, a gc deletes
    the base's data file. The save fails before its commit, naming the file; nothing is
    committed (it used to commit references to bytes that were gone)."""
    state = {"w": torch.randn(8, 16)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    (data_file,) = bcp.incremental.read_manifest(resolve_backend(a)).data_files
    real = bcp.save_phases.hold_base

    def gc_after_the_holds(*args, **kwargs):
        held = real(*args, **kwargs)
        os.remove(os.path.join(a, *data_file.path.split("/")))
        return held

    monkeypatch.setattr(bcp.save_phases, "hold_base", gc_after_the_holds)
    with pytest.raises(bcp.IncompleteCheckpointError, match=f"a/{data_file.path}.*nothing was committed"):
        bcp.save(state, b, base=a, piece_bytes=PIECE)
    assert not os.path.exists(os.path.join(b, "manifest.json"))


def _holds(gen) -> list[str]:
    return os.listdir(gen / "holds") if (gen / "holds").exists() else []


def test_holds_name_the_referrer_and_its_save(tmp_path):
    state = {"w": torch.randn(8, 16)}
    bcp.save(state, str(tmp_path / "a"), incremental=True)
    info = bcp.save(state, str(tmp_path / "b"), base=str(tmp_path / "a"))
    gens = [g for g in os.listdir(tmp_path / "a") if g.startswith("gen-")]
    assert [h for g in gens for h in _holds(tmp_path / "a" / g)] == [f"b.{info.save_id}"]


def test_async_save_with_a_base_keeps_the_values_at_the_call(uri_factory):
    state = {"w": torch.zeros(16, 16), "v": torch.ones(16, 16)}
    a, b = uri_factory("a"), uri_factory("b")
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    state["w"][0] = 5
    expect = {k: v.clone() for k, v in state.items()}
    handle = bcp.async_save(state, b, base=a, piece_bytes=PIECE)
    state["w"].fill_(7)  # after the call: not in the checkpoint
    state["v"].fill_(7)
    info = handle.wait()
    assert info.bytes_written == PIECE
    got = read_as_format(b)
    assert all(torch.equal(got[k], expect[k]) for k in expect)
    assert all(torch.equal(v, expect[k]) for k, v in bcp.open(b).state().items())


def test_two_gloo_ranks_save_with_a_base(tmp_path):
    import dist_jobs
    import incremental_save_jobs

    dist_jobs.spawn(incremental_save_jobs.two_ranks_job, 2, str(tmp_path))
    for name in ("s0", "s1"):
        got = read_as_format(str(tmp_path / name))
        assert set(got) == {"w", "s"}
    w = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    w[20:22] += 1
    assert torch.equal(read_as_format(str(tmp_path / "s1"))["w"], w)
    s0, s1 = (read_as_format(str(tmp_path / n))["s"].numpy() for n in ("s0", "s1"))
    assert np.count_nonzero(s1 != s0) == 16  # rank 1's first shard row
    assert verify_checkpoint(str(tmp_path / "s1"))["ok"]


def test_an_incremental_save_on_s3_holds_and_refers_to_its_sibling(moto_server):
    from conftest import new_bucket, store_uri

    bucket = new_bucket(moto_server)
    a, b = (store_uri("moto", moto_server, bucket, f"run/{n}") for n in ("a", "b"))
    state = {"w": torch.randn(16, 16), "v": torch.randn(16, 16)}
    bcp.save(state, a, incremental=True, piece_bytes=PIECE)
    state["w"][5] += 1
    info = bcp.save(state, b, base=a, piece_bytes=PIECE)
    assert info.bytes_written == PIECE
    assert own_bytes(b) == PIECE
    parent = resolve_backend(split_parent(a)[0])
    assert [k.rsplit("/", 1)[1] for k in parent.list("a/") if "/holds/" in k] == [f"b.{info.save_id}"]
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(loaded, b)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_digests_work_in_a_forked_child_after_the_parent_used_its_pool():
    import multiprocessing

    from bcp.io_scheduler.write_pipeline import WriteItem
    from bcp.pieces import digest_items

    items = [WriteItem(None, Piece(((0,), (1 << 20,)), torch.full((1 << 20,), float(k))), 0) for k in range(4)]  # type: ignore[arg-type]
    expect = digest_items(items, 2)  # the parent's pool has idle threads now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(digest_items, (items, 2)).get(timeout=60)
    assert np.array_equal(got, expect)
    assert bytes(expect[1]) == xxhash.xxh3_128_digest(items[1].piece.tensor.numpy().tobytes())


def test_tied_scalar_and_empty_tensors_are_reused_and_written_once(uri_factory):
    w = torch.randn(32, 16)
    state = {"a": w, "b": w, "z": torch.tensor(3.0), "e": torch.zeros(0, 16)}
    u1, u2, u3 = uri_factory(), uri_factory(), uri_factory()
    assert bcp.save(state, u1, incremental=True, piece_bytes=PIECE).bytes_written == 32 * 64 + 4
    assert bcp.save(state, u2, base=u1, piece_bytes=PIECE).bytes_written == 0  # nothing changed: no own file
    w[3] += 1
    assert bcp.save(state, u3, base=u2, piece_bytes=PIECE).bytes_written == PIECE  # one piece, once for a and b
    got = bcp.open(u3).state()
    assert torch.equal(got["a"], w) and torch.equal(got["b"], w) and got["z"] == 3.0 and got["e"].shape == (0, 16)
    assert torch.equal(read_as_format(u2)["a"], read_as_format(u1)["a"])


def test_a_base_replaced_after_the_early_match_is_matched_again_as_held(tmp_path, monkeypatch):
    """The one-rank early match read the base before another process replaced it; the
    save holds the new base and matches again against it (``saver._decide``'s fallback):
    it refers only to pieces the held base stores, and writes the others."""
    import bcp.saver

    w, v_old, v_new = torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    bcp.save({"w": w, "v": v_old}, a, incremental=True, piece_bytes=PIECE)
    early_matches: list = []
    real_early, real_find, real_read = bcp.saver._decide_early, bcp.saver.find_candidates, bcp.incremental.read_manifest
    finds: list[str] = []

    def early(*args, **kwargs):
        early_matches.append(real_early(*args, **kwargs))
        return early_matches[-1]

    def find(base, *args, **kwargs):
        finds.append(base.manifest.save_id)
        return real_find(base, *args, **kwargs)

    def replaced_before_the_hold(backend, *args):
        if len(early_matches) == 1 and not hasattr(early_matches[0], "replaced"):
            early_matches[0].result()  # the early match is done, on the base as it was
            early_matches[0].replaced = True
            bcp.save({"w": w, "v": v_new}, a, incremental=True, piece_bytes=PIECE, overwrite=True)  # another process
        return real_read(backend, *args)

    monkeypatch.setattr(bcp.saver, "_decide_early", early)
    monkeypatch.setattr(bcp.saver, "find_candidates", find)
    monkeypatch.setattr(bcp.incremental, "read_manifest", replaced_before_the_hold)
    old_id = bcp.open(a).manifest.save_id
    info = bcp.save({"w": w, "v": v_old}, b, base=a, piece_bytes=PIECE)
    new_id = bcp.open(a).manifest.save_id
    assert old_id != new_id
    assert finds == [old_id, new_id]  # matched early on the old base, then again on the held one
    assert info.bytes_written == v_old.numel() * 4  # "w" refers to the held base; "v" differs from it
    got = read_as_format(b)
    assert torch.equal(got["w"], w) and torch.equal(got["v"], v_old)
    doc = json.loads((tmp_path / "b" / "manifest.json").read_text())
    referred = {f["path"] for f in doc["data_files"] if f.get("checkpoint") == "a"}
    assert referred and referred <= {f.path for f in bcp.open(a).manifest.data_files}


@pytest.mark.parametrize("tied_again", [True, False])
@pytest.mark.parametrize("head_changes", [True, False])
def test_a_tie_of_the_base_is_reused_only_by_keys_tied_again(tmp_path, tied_again, head_changes):
    """The base stored emb and head tied (one storage, bytes once). The next save ties
    them again (both reuse those bytes: still one tensor when read) or not (then only
    emb reuses them: head, changed or not, is written itself, so no two untied keys
    share bytes, which a read without a template refuses or merges into one tensor)."""
    w = torch.randn(64, 1024)
    opts = {"piece_bytes": 16 << 10}
    bcp.save({"emb": w, "head": w}, str(tmp_path / "s1"), incremental=True, **opts)
    head = w if tied_again else w.clone()
    if head_changes:
        head[0] += 1  # tied again: emb changes with it
    bcp.save({"emb": w, "head": head}, str(tmp_path / "s2"), base=str(tmp_path / "s1"), **opts)
    state = bcp.open(str(tmp_path / "s2")).state()
    assert torch.equal(state["emb"], w) and torch.equal(state["head"], head)
    assert (state["emb"] is state["head"]) == tied_again
    manifest = bcp.open(str(tmp_path / "s2")).manifest
    own = sum(f.nbytes for f in manifest.data_files if not f.checkpoint)
    piece = 16 << 10  # row 0's piece, of 4 rows
    assert own == ((piece if head_changes else 0) if tied_again else head.nbytes), own
