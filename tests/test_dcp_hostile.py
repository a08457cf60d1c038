"""Hostile DCP checkpoints (issue 36): bcp's DCP readers (``bcp convert``'s
``from_dcp`` and ``BcpStorageReader``) allocate no more than the bytes really present,
parse the checksum sidecar strictly, and turn every malformed ``.metadata``,
``.bcp-checksums.json`` or truncated ``.distcp`` into one bcp error naming the file
(and the key and offset where there is one) -- never a bare Python exception, never
gigabytes for a file of kilobytes."""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

from bcp.convert.dcp_format import from_dcp
from bcp.convert.dcp_metadata import SafeBytesPlanner, parse_metadata
from bcp.errors import CheckpointError, CorruptCheckpointError, FormatError
from bcp.integrations.dcp import CHECKSUMS_KEY, METADATA_KEY, BcpStorageReader, BcpStorageWriter
from bcp.integrations.dcp_storage import parse_checksums
from helpers import examples

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

GIB = 1 << 30


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """The most memory Python allocated while ``fn`` ran, and what it raised."""
    tracemalloc.start()
    try:
        fn()
        raised = None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the caller asserts what was raised
        raised = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


def small_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.arange(6), "step": 3}


def dcp_dir(path: Path, state: dict | None = None) -> Path:
    dcp.save(state or small_state(), checkpoint_id=str(path), no_dist=True)
    return path


def bcp_dcp(path: Path, state: dict | None = None) -> str:
    uri = str(path)
    dcp.save(state or small_state(), storage_writer=BcpStorageWriter(uri))
    return uri


def only_data_file(path: Path) -> Path:
    (data,) = sorted(path.glob("*.distcp"))
    return data


def rewrite_metadata(path: Path, change: Callable[[Any], None]) -> None:
    """Edit a DCP checkpoint's (trusted, test-made) ``.metadata``."""
    md = pickle.loads((path / METADATA_KEY).read_bytes())
    change(md)
    (path / METADATA_KEY).write_bytes(pickle.dumps(md))


def failure(caught: pytest.ExceptionInfo[CheckpointException] | CheckpointException) -> BaseException:
    """The error DCP's load reported for rank 0."""
    exc = caught if isinstance(caught, CheckpointException) else caught.value
    err = exc.failures[0]
    return err[0] if isinstance(err, tuple) else err


# -- .metadata: the unpickler allocates only what the bytes spell out -----------------------------


def _global(module: str, name: str) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


def test_a_34_byte_metadata_calling_bytearray_of_a_gib_is_refused_before_allocating():
    blob = b"\x80\x04" + _global("builtins", "bytearray") + b"\x8a\x05" + GIB.to_bytes(5, "little") + b"\x85R."
    assert len(blob) < 40
    peak, raised = peak_bytes(lambda: parse_metadata(io.BytesIO(blob), where="ck/.metadata"))
    assert isinstance(raised, FormatError) and "ck/.metadata" in str(raised) and "bytearray" in str(raised), raised
    assert peak < 1 << 20, f"{peak:,} bytes allocated for a {len(blob)}-byte .metadata"


def test_a_declared_length_past_the_end_is_refused_before_allocating():
    blob = b"\x80\x04\x8e" + struct.pack("<Q", GIB) + b"abc"  # BINBYTES8 of 1 GiB, 3 bytes present
    peak, raised = peak_bytes(lambda: parse_metadata(io.BytesIO(blob), where="ck/.metadata"))
    assert isinstance(raised, FormatError) and "ck/.metadata" in str(raised) and "byte 2" in str(raised), raised
    assert peak < 1 << 20, f"{peak:,} bytes allocated for a {len(blob)}-byte .metadata"


def test_one_list_copied_by_set_a_thousand_times_is_refused():
    # a list of 1,000 ints, then set(that list) 1,000 times: ~10 KB that would build ~30 MB of sets
    items = b"".join(b"M" + struct.pack("<H", i) for i in range(1000))
    call = b"h\x00h\x01\x85R"  # BINGET set, BINGET the list, TUPLE1, REDUCE
    blob = (
        b"\x80\x02" + b"cbuiltins\nset\nq\x00" + b"](" + items + b"eq\x01" + b"(" + call * 1000 + b"l."
    )  # fmt: skip
    peak, raised = peak_bytes(lambda: parse_metadata(io.BytesIO(blob), where="ck/.metadata"))
    assert isinstance(raised, FormatError) and "builtins.set" in str(raised), raised
    assert peak < 4 << 20, f"{peak:,} bytes allocated for a {len(blob):,}-byte .metadata"


def test_one_dict_given_to_build_for_every_object_is_refused():
    # a dict of 1,000 keys, then 2,000 DCP objects each BUILT from it: ~20 KB that would copy 2M entries
    keys = b"".join(b"X" + struct.pack("<I", len(k)) + k + b"N" for k in (f"k{i}".encode() for i in range(1000)))
    one = b"h\x00)\x81h\x01b"  # BINGET the class, EMPTY_TUPLE, NEWOBJ, BINGET the dict, BUILD
    blob = (
        b"\x80\x02" + b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\nq\x00"
        + b"}(" + keys + b"uq\x01" + b"(" + one * 2000 + b"l."
    )  # fmt: skip
    peak, raised = peak_bytes(lambda: parse_metadata(io.BytesIO(blob), where="ck/.metadata"))
    assert isinstance(raised, FormatError) and "BUILD" in str(raised) and "ck/.metadata" in str(raised), raised
    assert peak < 4 << 20, f"{peak:,} bytes allocated for a {len(blob):,}-byte .metadata"


def test_a_real_metadata_is_within_the_budget(tmp_path):
    src = dcp_dir(tmp_path / "c", {f"layer{i}": {"w": torch.ones(2, 3), "n": i} for i in range(50)})
    md = parse_metadata(io.BytesIO((src / METADATA_KEY).read_bytes()), where="x")
    assert len(md.state_dict_metadata) == 100


# -- from_dcp (bcp convert): offsets and sizes against the real files ---------------------------------


def test_a_truncated_distcp_is_a_corrupt_checkpoint_error_naming_file_and_offset(tmp_path):
    src = dcp_dir(tmp_path / "c")
    data = only_data_file(src)
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=rf"{data.name}: DCP metadata stores '\w+' at bytes \d+\.\.") as e:
        from_dcp(str(src), str(tmp_path / "out"))
    assert e.value.file == data.name and e.value.offset is not None


def test_a_missing_distcp_is_a_corrupt_checkpoint_error(tmp_path):
    src = dcp_dir(tmp_path / "c")
    only_data_file(src).unlink()
    with pytest.raises(CorruptCheckpointError, match=r"\.distcp: missing"):
        from_dcp(str(src), str(tmp_path / "out"))


def test_a_tensor_declared_larger_than_its_stored_bytes_is_refused_before_allocating(tmp_path):
    src = dcp_dir(tmp_path / "c")

    def grow(md: Any) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size([1 << 40, 8])  # 32 TiB of float32, its one chunk grown alike (the chunks tile it)
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1 << 40, 8]))]

    rewrite_metadata(src, grow)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(CorruptCheckpointError, match=r"'w' is declared as 35,184,372,088,832 bytes"):
        from_dcp(str(src), str(tmp_path / "out"), scratch_dir=str(scratch))
    assert not any(scratch.rglob("*.bin")), "a scratch file was made before the check"


def test_a_compressed_entry_is_refused_before_any_scratch_file_or_read(tmp_path):
    """An entry marked as written through DCP's stream transforms (zstd) hides its size
    until it inflates: refused by name, before a scratch file of its declared size is
    made (from_dcp) or any byte is read (BcpStorageReader)."""
    src = dcp_dir(tmp_path / "c")

    def compress(md: Any) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size([1 << 40, 8])
        entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1 << 40, 8]))]
        for index, info in md.storage_data.items():
            if index.fqn == "w":
                info.transform_descriptors = ["zstandard/1"]

    rewrite_metadata(src, compress)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(FormatError, match=r"'w' is stored through DCP's stream transforms \['zstandard/1'\]"):
        from_dcp(str(src), str(tmp_path / "out"), scratch_dir=str(scratch))
    assert not any(scratch.iterdir()), "a scratch directory was made before the check"
    uri = bcp_dcp(tmp_path / "b")
    rewrite_metadata(tmp_path / "b", compress)
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(out, storage_reader=BcpStorageReader(uri, verify=False))
    err = failure(caught)
    assert isinstance(err, FormatError) and "(compressed), which bcp does not read" in str(err), err


def test_a_data_file_outside_the_checkpoint_is_refused(tmp_path):
    src = dcp_dir(tmp_path / "c")
    other = dcp_dir(tmp_path / "other", {"w": torch.full((16, 8), 7.0), "b": torch.arange(6), "step": 3})
    name = only_data_file(other).name

    def escape(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = f"../other/{name}"

    rewrite_metadata(src, escape)
    with pytest.raises(FormatError, match=r"not a data file in the checkpoint"):
        from_dcp(str(src), str(tmp_path / "out"))


# -- BcpStorageReader ---------------------------------------------------------------------------------


def test_a_declared_gib_in_a_small_file_is_refused_before_allocating(tmp_path):
    uri = bcp_dcp(tmp_path / "c")

    def huge(md: Any) -> None:
        for info in md.storage_data.values():
            info.length = GIB

    rewrite_metadata(tmp_path / "c", huge)
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    peak, raised = peak_bytes(lambda: dcp.load(out, storage_reader=BcpStorageReader(uri, verify=False)))
    assert isinstance(raised, CheckpointException), raised
    err = failure(raised)
    assert isinstance(err, CorruptCheckpointError) and err.file and err.file.endswith(".distcp"), err
    assert "but the file has" in str(err) and err.offset is not None
    size = only_data_file(tmp_path / "c").stat().st_size
    assert peak < 64 << 20, f"{peak:,} bytes allocated reading a {size}-byte file"


def plant_zip_bomb(path: Path, fqn: str) -> None:
    """Append to the data file a copy of ``fqn``'s entry (a torch.save zip) whose
    ``data.pkl`` declares 64 MiB more, deflated to about 64 KiB, and point the entry at it."""
    md = pickle.loads((path / METADATA_KEY).read_bytes())
    ((index, info),) = [(i, s) for i, s in md.storage_data.items() if i.fqn == fqn]
    data = path / info.relative_path
    entry = data.read_bytes()[info.offset : info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(entry)) as src, zipfile.ZipFile(out, "w") as dst:
        for e in src.infolist():
            body, pkl = src.read(e.filename), e.filename.endswith("data.pkl")
            dst.writestr(e.filename, body + bytes(64 << 20) if pkl else body, zipfile.ZIP_DEFLATED if pkl else 0)
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(out.getvalue())
    md.storage_data[index] = type(info)(info.relative_path, offset, len(out.getvalue()))
    (path / METADATA_KEY).write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("fqn", ["step", "w"])  # a value, a tensor: each a torch.save zip in the file
def test_a_zip_bomb_entry_is_refused_before_it_is_inflated(tmp_path, fqn):
    """Failed before: from_dcp (and the DCP storage reader) handed the entry to torch's
    loader, which inflated what it declared (+560 MiB for a 255 KiB entry)."""
    bomb = rf"bytes \d+\.\.\d+ \('{fqn}'\): its zip entries declare \d+ bytes, far more than its \d+ bytes hold"
    plant_zip_bomb(dcp_dir(tmp_path / "d"), fqn)
    peak, raised = peak_bytes(lambda: from_dcp(str(tmp_path / "d"), str(tmp_path / "out")))
    assert isinstance(raised, FormatError) and re.search(r"\.distcp: " + bomb, str(raised)), raised
    assert peak < 32 << 20 and not (tmp_path / "out").exists()
    uri = bcp_dcp(tmp_path / "c")
    plant_zip_bomb(tmp_path / "c", fqn)
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    peak, raised = peak_bytes(lambda: dcp.load(out, storage_reader=BcpStorageReader(uri, verify=False)))
    assert isinstance(raised, CheckpointException), raised
    err = failure(raised)
    assert isinstance(err, FormatError) and re.search(bomb, str(err)), err
    assert peak < 32 << 20


@pytest.mark.parametrize("verify", [False, True])
def test_a_truncated_distcp_through_the_reader_names_file_and_offset(tmp_path, verify):
    uri = bcp_dcp(tmp_path / "c")
    data = only_data_file(tmp_path / "c")
    data.write_bytes(data.read_bytes()[:-100])
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(out, storage_reader=BcpStorageReader(uri, verify=verify))
    err = failure(caught)
    assert isinstance(err, CorruptCheckpointError) and err.file == data.name, repr(err)
    assert data.name in str(err)


def test_a_corrupt_metadata_is_one_clear_error_without_the_per_rank_clause(tmp_path):
    uri = bcp_dcp(tmp_path / "c")
    (tmp_path / "c" / METADATA_KEY).write_bytes(b"\x80\x04garbage")
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(out, storage_reader=BcpStorageReader(uri, verify=False))
    text = str(caught.value)
    assert f"{METADATA_KEY}: not a readable DCP metadata pickle" in text, text
    assert "per-rank" not in text and "rank local metadata read failed" not in text, text


# -- .bcp-checksums.json: a strict schema ---------------------------------------------------------


def sidecar(uri_dir: Path) -> dict:
    return json.loads((uri_dir / CHECKSUMS_KEY).read_bytes())


def test_a_nested_checksum_file_is_a_format_error_not_a_recursion_error():
    raw = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(FormatError, match=r"ck/\.bcp-checksums\.json: .*nests deeper"):
        parse_checksums(raw, "ck/.bcp-checksums.json")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("files", None, "size"), 1066.5),
        (("files", None, "size"), True),
        (("metadata", "size"), "12"),
        (("metadata", "crc32c"), 1 << 32),
        (("files", None, "segments"), [[0, 10, -1]]),
        (("files", None, "segments"), [[0, 10**12, 0]]),
        (("version",), 1.0),
        (("extra",), 1),
    ],
)
def test_a_checksum_field_of_the_wrong_type_is_a_format_error_naming_the_file(tmp_path, path, value):
    bcp_dcp(tmp_path / "c")
    doc = sidecar(tmp_path / "c")
    node = doc
    for step in path[:-1]:
        node = node[step] if step is not None else next(iter(node.values()))
    node[path[-1]] = value
    with pytest.raises(FormatError, match=r"c/\.bcp-checksums\.json: not a bcp DCP checksum file"):
        parse_checksums(json.dumps(doc).encode(), str(tmp_path / "c" / CHECKSUMS_KEY))


def test_a_file_size_in_the_checksums_that_is_not_the_real_one_is_corrupt(tmp_path):
    uri = bcp_dcp(tmp_path / "c")
    doc = sidecar(tmp_path / "c")
    entry = next(iter(doc["files"].values()))
    entry["size"] = 3 * GIB
    (tmp_path / "c" / CHECKSUMS_KEY).write_text(json.dumps(doc))
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    peak, raised = peak_bytes(lambda: dcp.load(out, storage_reader=BcpStorageReader(uri)))
    assert isinstance(raised, CheckpointException), raised
    err = failure(raised)
    assert isinstance(err, CorruptCheckpointError) and "3221225472" in str(err), err
    assert peak < 64 << 20


# -- hypothesis: any mutation is an exact load or a bcp error ------------------------------------------


def mutate(data: bytes, kind: str, at: int, byte: int, n: int) -> bytes:
    at %= max(len(data), 1)
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (byte or 1)]) + data[at + 1 :]
    if kind == "set":
        return data[:at] + bytes([byte]) + data[at + 1 :]
    if kind == "cut":
        return data[:at]
    if kind == "insert":
        return data[:at] + bytes([byte]) * n + data[at:]
    return data[:at] + data[at + n :]  # "drop"


mutations = st.tuples(
    st.sampled_from(["flip", "set", "cut", "insert", "drop"]),
    st.integers(0, 1 << 20),
    st.integers(0, 255),
    st.integers(1, 16),
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One BcpStorageWriter checkpoint the hypothesis tests copy and damage."""
    path = tmp_path_factory.mktemp("hostile") / "c"
    bcp_dcp(path)
    return path


def copy_of(saved: Path, tmp: Path) -> Path:
    dst = tmp / f"c{len(list(tmp.iterdir()))}"
    dst.mkdir()
    for f in saved.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def load_or_error(path: Path, **kw: Any) -> dict | BaseException:
    """The state loaded (non-tensor entries with weights_only, as ``bcp convert``
    does), or DCP's exception."""
    out = {"w": torch.zeros(16, 8), "b": torch.zeros(6, dtype=torch.int64), "step": None}
    planner = SafeBytesPlanner()
    try:
        dcp.load(out, storage_reader=BcpStorageReader(str(path), **kw), planner=planner)
    except CheckpointException as e:
        return e
    return {**out, **planner.loaded}


def assert_bcp_failure(got: BaseException, what: str, *, planner_may_refuse: bool = False) -> None:
    """DCP's CheckpointException carrying bcp's error (or, for ``.metadata``, DCP's
    one-clause report of it): never a bare Python exception from bcp's reader. With
    ``planner_may_refuse`` (an unverified ``.metadata`` that was changed and still
    parses), DCP's own planner may refuse it for not matching the template
    ("Size mismatch ..."): an error raised in torch, not in bcp."""
    assert isinstance(got, CheckpointException), f"{what}: {got!r}"
    err = failure(got)
    wrapped = got.failures[0]
    raised_in = Path(wrapped[1][-1].filename) if isinstance(wrapped, tuple) and wrapped[1] else None
    if isinstance(err, AssertionError):  # DCP's report of a failed read_metadata
        text = str(err)
        assert "global metadata read failed" in text, f"{what}: {err}"
        assert METADATA_KEY in text or CHECKSUMS_KEY in text, f"{what}: {err}"
        assert "rank local" not in str(err)
    elif planner_may_refuse and raised_in is not None and "torch" in raised_in.parts:
        pass
    else:
        assert isinstance(err, CheckpointError), f"{what}: {type(err).__name__}: {err} (raised in {raised_in})"


@given(mutation=mutations)
def test_any_mutation_of_metadata_is_a_bcp_error_or_a_metadata(saved, mutation):
    raw = mutate((saved / METADATA_KEY).read_bytes(), *mutation)
    peak, raised = peak_bytes(lambda: parse_metadata(io.BytesIO(raw), where="ck/.metadata"))
    assert raised is None or isinstance(raised, CheckpointError), f"{type(raised).__name__}: {raised}"
    assert raised is None or "ck/.metadata" in str(raised)
    assert peak < (1 << 20) + 200 * len(raw), f"{peak:,} bytes for a {len(raw):,}-byte .metadata"


@given(mutation=mutations)
def test_any_mutation_of_the_checksums_is_an_exact_load_or_a_bcp_error(saved, tmp_path, mutation):
    path = copy_of(saved, tmp_path)
    (path / CHECKSUMS_KEY).write_bytes(mutate((path / CHECKSUMS_KEY).read_bytes(), *mutation))
    got = load_or_error(path)
    want = small_state()
    if isinstance(got, BaseException):
        assert_bcp_failure(got, "checksums")
    else:
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 3


@given(mutation=mutations, verify=st.booleans())
def test_any_mutation_of_the_data_or_metadata_through_the_reader_is_a_result_or_a_bcp_error(
    saved, tmp_path, mutation, verify
):
    path = copy_of(saved, tmp_path)
    target = path / (METADATA_KEY if mutation[2] % 2 else only_data_file(path).name)
    target.write_bytes(mutate(target.read_bytes(), *mutation))
    got = load_or_error(path, verify=verify)
    if isinstance(got, BaseException):
        assert_bcp_failure(got, target.name, planner_may_refuse=not verify and target.name == METADATA_KEY)
    elif verify:  # every byte is checksummed: only the exact state loads
        want = small_state()
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 3


@settings(max_examples=examples(25))
@given(cut=st.integers(0, 1 << 16), metadata=st.booleans())
def test_any_truncation_is_a_bcp_error_in_convert(saved, tmp_path, cut, metadata):
    path = copy_of(saved, tmp_path)
    target = path / (METADATA_KEY if metadata else only_data_file(path).name)
    data = target.read_bytes()
    target.write_bytes(data[: cut % len(data)])
    with pytest.raises(CheckpointError) as caught:
        from_dcp(str(path), str(tmp_path / f"out{cut}"))
    assert target.name in str(caught.value)


@settings(max_examples=examples(25))
@given(mutation=mutations)
def test_any_mutation_of_metadata_is_a_result_or_a_bcp_error_in_convert(saved, tmp_path, mutation):
    path = copy_of(saved, tmp_path)
    (path / METADATA_KEY).write_bytes(mutate((path / METADATA_KEY).read_bytes(), *mutation))
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    peak, raised = peak_bytes(lambda: from_dcp(str(path), str(out)))
    assert raised is None or isinstance(raised, CheckpointError), f"{type(raised).__name__}: {raised}"
    assert peak < 256 << 20, f"{peak:,} bytes converting a {(path / METADATA_KEY).stat().st_size:,}-byte .metadata"


def test_declared_tensor_bytes_in_a_real_checkpoint_fit_their_storage(tmp_path):
    """The check from_dcp makes holds for what DCP writes (every dtype, empty tensors)."""
    state = {str(dt): torch.ones(3, 5, dtype=dt) for dt in (torch.float16, torch.bfloat16, torch.int8, torch.bool)}
    state["empty"] = torch.empty(0, 4)
    src = dcp_dir(tmp_path / "c", state)
    md = pickle.loads((src / METADATA_KEY).read_bytes())
    assert all(isinstance(m, TensorStorageMetadata) for m in md.state_dict_metadata.values())
    info, skipped = from_dcp(str(src), str(tmp_path / "out"))
    assert not skipped and info is not None


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path):
    """A size grown past its one chunk (4 of 8 elements covered): the rest would come
    back as elements never read. Refused at parse, naming the key."""
    src = dcp_dir(tmp_path / "c", {"w": torch.arange(4.0) + 1})

    def grow(md: Any) -> None:
        md.state_dict_metadata["w"].size = torch.Size([8])

    rewrite_metadata(src, grow)
    with pytest.raises(FormatError, match=r"'w': its chunks do not tile its size \(8,\): .*hold 4 elements of its 8"):
        from_dcp(str(src), str(tmp_path / "out"))


@pytest.mark.parametrize(("size", "message"), [((2**64,), "not a tensor shape"), ((0, 2**62, 2**62), "past what")])
def test_a_size_past_int64_is_a_format_error_naming_the_key(tmp_path, size, message):
    """Failed before: an OverflowError from numpy (the chunks' tiling check), naming nothing."""
    src = dcp_dir(tmp_path / "c", {"w": torch.arange(4.0) + 1})

    def grow(md: Any) -> None:
        md.state_dict_metadata["w"].size = torch.Size(size)

    rewrite_metadata(src, grow)
    with pytest.raises(FormatError, match=rf"DCP metadata gives 'w' the size .*{message}"):
        from_dcp(str(src), str(tmp_path / "out"))


def test_a_data_file_that_is_a_link_is_refused_in_convert(tmp_path):
    """The data file replaced by a link to a copy elsewhere: the import never follows it."""
    src = dcp_dir(tmp_path / "c")
    data = only_data_file(src)
    elsewhere = tmp_path / "elsewhere.distcp"
    elsewhere.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(elsewhere)
    with pytest.raises(FormatError, match=r"\.distcp: not a data file bcp reads .*links are never followed"):
        from_dcp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
