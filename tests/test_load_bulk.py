"""The bulk load path (issue 37, per-tensor costs): tensors stored whole in one row and
wanted whole are read without a TensorEntry, Fragment or run object each
(Catalog.whole_rows, read_exec.execute_whole_reads); every byte still lands and is
verified, a corrupt byte names its tensor, file and offset, and every other request
(a part, a cast, a strided destination, a tensor in several rows) takes the planned path."""

from __future__ import annotations

import itertools
import threading
import uuid

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import bcp
from bcp import reader as reader_module
from bcp.backends import backend_for
from bcp.errors import CorruptCheckpointError
from bcp.io_scheduler import read_exec, whole_reads
from bcp.metadata import Catalog, Fragment, crc32c
from bcp.metadata.checksum import combine_blocks
from bcp.metadata.rows import TensorEntry
from helpers import examples
from recording_backend import Recording as Resident


def uri_of(name: str) -> str:
    return f"memory://bulk-{name}-{uuid.uuid4().hex[:8]}/ck"


def flip(uri: str, file: str, at: int) -> None:
    backend = backend_for(uri)
    data = bytearray(backend.read(file))
    data[at] ^= 0x5A
    backend.write(file, bytes(data))


def counting_bulk(monkeypatch) -> list[int]:
    """How many reads each call of execute_whole_reads was given."""
    seen: list[int] = []
    real = whole_reads.execute_whole_reads

    def wrapper(backend, reads, *a, **k):
        seen.append(len(reads))
        return real(backend, reads, *a, **k)

    monkeypatch.setattr(reader_module, "execute_whole_reads", wrapper)
    return seen


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8]


def make(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 200, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float32 if dtype != torch.complex64 else dtype).to(dtype)


tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.one_of(st.just(()), st.tuples(st.integers(0, 700)), st.tuples(st.integers(1, 40), st.integers(1, 40))),
        st.sampled_from(["dense", "dense", "dense", "strided", "cast"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=examples(50), deadline=None)
@given(
    specs=tensor_specs,
    block=st.sampled_from([64, 1024, 1 << 16]),
    resident=st.booleans(),
    streams=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_bulk_and_planned_loads_give_the_saved_values(specs, block, resident, streams, seed):
    """Random counts, sizes (empty, 0-d, up to a few blocks), dtypes numpy lacks
    (bfloat16) and destinations the bulk path must leave to the planner (strided, of
    another dtype): every value loads exactly; the dense ones went through the bulk path."""
    g = torch.Generator().manual_seed(seed)
    state = {f"t{i}": make(dtype, shape, g) for i, (dtype, shape, _how) in enumerate(specs)}
    uri = uri_of("prop")
    bcp.save(state, uri, checksum_block_bytes=block)
    dest: dict[str, torch.Tensor] = {}
    for i, (dtype, shape, how) in enumerate(specs):
        t = state[f"t{i}"]
        if how == "strided" and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1:
            dest[f"t{i}"] = torch.zeros(t.shape[1], t.shape[0], dtype=dtype).t()  # not contiguous
        elif how == "cast" and dtype == torch.float32:
            dest[f"t{i}"] = torch.zeros(shape, dtype=torch.float64)
        else:
            dest[f"t{i}"] = torch.zeros_like(t)
    backend = Resident(backend_for(uri), resident)
    mp = pytest.MonkeyPatch()
    try:
        real = whole_reads.execute_whole_reads
        seen: list[int] = []

        def bulk(backend, reads, *a, **k):
            seen.append(len(reads))
            return real(backend, reads, *a, **{**k, "streams": streams})

        mp.setattr(reader_module, "execute_whole_reads", bulk)
        bcp.load(dest, backend, strict=False)
    finally:
        mp.undo()
    for k, v in state.items():
        assert torch.equal(dest[k], v.to(dest[k].dtype)), k
    dense = sum(1 for k, v in state.items() if v.numel() and dest[k].is_contiguous() and dest[k].dtype == v.dtype)
    assert sum(seen) == dense


@pytest.mark.parametrize("resident", [True, False])
def test_a_corrupt_byte_in_one_tiny_tensor_among_many_names_it(resident, monkeypatch):
    """300 adjacent tensors of 7 floats: a flipped byte in one of them fails the load
    with an error naming that tensor, its file and the offset of its block."""
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}.bias": torch.randn(7, generator=g) for i in range(300)}
    uri = uri_of("corrupt")
    bcp.save(state, uri)
    frag = bcp.open(uri).catalog.tensors["layer211.bias"].fragment(0)
    flip(uri, frag.file, frag.byte_offset + 9)
    seen = counting_bulk(monkeypatch)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError, match=r"'layer211\.bias'") as info:
        bcp.load(dest, Resident(backend_for(uri), resident))
    assert info.value.fqn == "layer211.bias"
    assert info.value.file == frag.file and info.value.offset == frag.byte_offset
    assert f"[{frag.byte_offset}, {frag.byte_offset + 28})" in str(info.value)
    assert seen == [300]


def test_a_corrupt_byte_in_a_later_block_names_that_block(monkeypatch):
    """A tensor of several blocks read in pieces from memory: the block holding the
    flipped byte is named, not the first."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 1024)
    t = torch.randn(2000)  # 8,000 bytes: 8 blocks of 1 KiB (the last short), 8 pieces
    uri = uri_of("blocks")
    bcp.save({"w": t, "b": torch.randn(3)}, uri, checksum_block_bytes=1024)
    frag = bcp.open(uri).catalog.tensors["w"].fragment(0)
    flip(uri, frag.file, frag.byte_offset + 5 * 1024 + 17)
    seen = counting_bulk(monkeypatch)
    backend = Resident(backend_for(uri), True)
    with pytest.raises(CorruptCheckpointError) as info:
        bcp.load({"w": torch.zeros(2000), "b": torch.zeros(3)}, backend)
    assert info.value.fqn == "w" and info.value.offset == frag.byte_offset + 5 * 1024
    assert seen == [2]
    assert max(n for _k, _o, n in backend.reads) <= 1024  # in pieces, each checked as it landed


def test_a_load_of_tensors_stored_whole_builds_no_entry_and_plans_no_runs(monkeypatch):
    """The per-tensor work of the usual load: no TensorEntry (so no Fragment) built and
    no run planned for a tensor stored whole in one row and wanted whole."""
    state = {f"p{i}": torch.full((i % 5 + 1,), float(i)) for i in range(200)}
    uri = uri_of("count")
    bcp.save(state, uri)
    built: list[str] = []
    real_init = TensorEntry.__init__

    def counting_init(self, fqn, *a, **k):
        built.append(fqn)
        real_init(self, fqn, *a, **k)

    monkeypatch.setattr(TensorEntry, "__init__", counting_init)
    monkeypatch.setattr(reader_module, "plan_tensor_reads", lambda *a, **k: pytest.fail("a run was planned"))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(dest, uri)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert built == []


def test_whole_rows_answers_only_single_whole_rows():
    """Catalog.whole_rows: a tensor in two rows, a name not stored and a row that does
    not span its tensor get -1; whole rows (a scalar, a matrix) come with their columns."""

    def frag(fqn, shape, off, lens, at, nbytes):
        return Fragment(fqn, "[]", "float32", shape, off, lens, "data/f.bin", at, nbytes, (crc32c(b"x"),) * 1)

    frags = [
        frag("split", (4,), (0,), (2,), 0, 8),
        frag("split", (4,), (2,), (2,), 64, 8),
        frag("m", (2, 3), (0, 0), (2, 3), 128, 24),
        frag("s", (), (), (), 192, 4),
        frag("half", (4,), (0,), (2,), 256, 8),  # spans half its tensor: never read whole
    ]
    given = Catalog(frags)
    assert given.whole_rows(["m"]).rows == [-1]  # built from Fragment objects: never the bulk path
    catalog = Catalog.from_arrow(given.to_arrow(), where="test", checksum_block_bytes=1 << 16)
    got = catalog.whole_rows(["split", "nothing", "m", "s", "m", "half"])
    assert [r >= 0 for r in got.rows] == [False, False, True, True, True, False]
    assert got.byte_offsets[2] == 128 and got.nbytes[2] == 24 and got.shapes[2] == (2, 3)
    assert got.byte_offsets[3] == 192 and got.nbytes[3] == 4 and got.shapes[3] == ()
    assert got.file_names[got.files[2]] == "data/f.bin"
    assert got.sum_stops[2] - got.sum_starts[2] == 1 and int(got.sums[got.sum_starts[2]]) == crc32c(b"x")
    assert catalog.shapes_and_dtypes(["m", "nothing", "s"]) == [((2, 3), "float32"), None, ((), "float32")]
    # the same answers as int64 arrays, for split_whole's checks over every request at once
    assert got.row_array.dtype == got.nbytes_array.dtype == got.blocks_array.dtype == np.int64
    assert got.row_array.tolist() == got.rows and got.nbytes_array.tolist() == got.nbytes
    assert got.blocks_array.tolist() == [b - a for a, b in zip(got.sum_starts, got.sum_stops, strict=True)]


def test_a_bulk_load_keeps_no_reference_to_its_destinations(tmp_path):
    """Failed before: the bulk reader's batch closure called itself, a reference cycle that
    kept every destination alive until the garbage collector ran (a DCP export's bound
    on resident tensors counts on them being freed at once)."""
    import gc
    import weakref

    import numpy as np

    bcp.save({"a": torch.ones(256), "b": torch.ones(256)}, str(tmp_path / "c"))
    reader = bcp.open(str(tmp_path / "c"))
    freed: list[int] = []
    gc.disable()
    try:
        buffer = np.empty(1024, np.uint8)
        weakref.finalize(buffer, freed.append, 1)
        dest = torch.from_numpy(buffer).view(torch.float32)
        reader.fill([("a", ((0,), (256,)), dest)])
        assert torch.equal(dest, torch.ones(256))
        del dest, buffer
        assert freed == [1]
    finally:
        gc.enable()


def test_destination_views_write_through_to_each_tensor():
    """destination_views: one view over the destinations' address range, sliced at each
    data_ptr(); a write into a slice lands in its tensor (one with grad included) only."""
    a, b = torch.zeros(3), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    views = whole_reads.destination_views([b.data_ptr(), a.data_ptr()], [b.nbytes, a.nbytes])
    assert [len(v) for v in views] == [16, 12] and whole_reads.destination_views([], []) == []
    views[1][:] = torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes()
    views[0][:] = torch.tensor([4.0, 5.0], dtype=torch.float64).numpy().tobytes()
    assert a.tolist() == [1.0, 2.0, 3.0] and b.detach().tolist() == [4.0, 5.0]


def test_the_bulk_path_takes_no_numpy_view_per_destination(monkeypatch):
    """Failed before: each destination's bytes came through its own ``numpy()`` and
    memoryview (a third of the per-tensor cost of a load of 10,000 tensors); now one
    view over the destinations' addresses is sliced per destination."""
    state = {f"p{i}": torch.full((i % 7 + 1,), float(i)) for i in range(200)}
    uri = uri_of("views")
    bcp.save(state, uri)
    calls: list[int] = []
    real = torch.Tensor.numpy

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", counting)
    seen = counting_bulk(monkeypatch)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(dest, uri)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert seen == [200] and calls == []


@settings(max_examples=examples(40), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=30),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.complex64, torch.int64, torch.bool]),
    gaps=st.lists(st.integers(0, 40), min_size=30, max_size=30),
    shuffle=st.randoms(use_true_random=False),
    requires_grad=st.booleans(),
)
def test_destinations_in_one_storage_in_any_order_each_get_their_bytes(sizes, dtype, gaps, shuffle, requires_grad):
    """Destinations that are views of one buffer, in an order unlike the file's, some
    touching and some with untouched elements between: each gets exactly its own
    bytes through the one address-range view, and the elements between stay as they were."""
    g = torch.Generator().manual_seed(len(sizes))
    state = {f"t{i}": make(dtype, (n,), g) for i, n in enumerate(sizes)}
    uri = uri_of("one-storage")
    bcp.save(state, uri)
    order = list(range(len(sizes)))
    shuffle.shuffle(order)
    starts, at = {}, 0
    for i in order:
        at += gaps[i]
        starts[i] = at
        at += sizes[i]
    sentinel = make(dtype, (at,), torch.Generator().manual_seed(99))
    buffer = sentinel.clone()
    dest = {f"t{i}": buffer[starts[i] : starts[i] + n] for i, n in enumerate(sizes)}
    if requires_grad and dtype.is_floating_point:
        dest = {k: torch.nn.Parameter(v, requires_grad=True) for k, v in dest.items()}
    bcp.load(dest, uri)
    covered = torch.zeros(at, dtype=torch.bool)
    for i, n in enumerate(sizes):
        assert torch.equal(buffer[starts[i] : starts[i] + n], state[f"t{i}"]), i
        covered[starts[i] : starts[i] + n] = True
    assert torch.equal(buffer[~covered], sentinel[~covered])


@settings(max_examples=examples(40), deadline=None)
@given(
    sizes=st.lists(st.integers(1, 80), min_size=2, max_size=25),
    which=st.integers(0, 24),
    at=st.floats(0, 1, exclude_max=True),
    resident=st.booleans(),
)
@example(sizes=[1, 19, 5], which=1, at=0.9, resident=True)  # in the short block after a whole one
@example(sizes=[1, 19, 5], which=1, at=0.1, resident=True)  # in the whole block before it
@example(sizes=[3, 32, 7], which=1, at=0.7, resident=True)  # whole blocks only
@example(sizes=[3, 10, 7], which=1, at=0.5, resident=True)  # one short block
@example(sizes=[1, 19, 5], which=1, at=0.9, resident=False)
def test_a_flipped_byte_anywhere_is_named_by_tensor_and_block(sizes, which, at, resident):
    """Blocks of 64 bytes, tensors of 4 to 320 bytes adjacent in one file: shorter than a
    block, whole blocks only, or whole blocks and a short one (the three checks of the
    bulk path's one loop). A byte flipped anywhere in one of them fails the load with the
    error naming that tensor and the block holding the byte; the others load as saved."""
    state = {f"t{i}": torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(sizes)}
    uri = uri_of("flip")
    bcp.save(state, uri, checksum_block_bytes=64)
    victim = f"t{which % len(sizes)}"
    frag = bcp.open(uri).catalog.tensors[victim].fragment(0)
    inside = int(at * frag.nbytes)
    flip(uri, frag.file, frag.byte_offset + inside)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError) as info:
        bcp.load(dest, Resident(backend_for(uri), resident))
    assert info.value.fqn == victim and info.value.file == frag.file
    assert info.value.offset == frag.byte_offset + inside // 64 * 64


def test_lazily_conjugated_and_negated_destinations_get_the_stored_values():
    """A conjugate view of a complex tensor and a real view carrying the negative bit
    (``z.conj().imag``) are dense but their raw bytes are not their values: they take
    the planned path and receive the stored values, next to plain ones read in bulk."""
    z, r = torch.randn(5, dtype=torch.complex64), torch.randn(5)
    uri = uri_of("lazy")
    bcp.save({"z": z, "r": r, "i": z.imag.clone()}, uri)
    conj = torch.zeros(5, dtype=torch.complex64).conj()
    neg = torch.zeros(5, dtype=torch.complex64).conj().imag
    plain = torch.zeros(5)
    assert conj.is_conj() and neg.is_neg() and neg.dtype == torch.float32
    bcp.load({"z": conj, "r": plain, "i": neg}, uri)
    assert torch.equal(conj, z) and torch.equal(plain, r) and torch.equal(neg, z.imag)


def test_each_bulk_read_holds_its_destination_while_its_view_is_written(monkeypatch):
    """The bulk path's byte views hold no reference to their tensors: each WholeRead
    carries its destination, so a destination only the reads refer to stays alive until
    its bytes land (a caller's list of temporaries may be freed as soon as it is split)."""
    import gc
    import weakref

    state = {"w": torch.arange(64.0), "s": torch.arange(8.0).reshape(2, 4)}
    uri = uri_of("holds")
    bcp.save(state, uri)
    reader = bcp.open(uri)
    seen: list[list[bool]] = []
    real = reader_module.execute_whole_reads

    def after_dropping_the_callers_references(backend, reads, *a, **k):
        refs = [weakref.ref(r.dest) for r in reads]
        gc.collect()
        seen.append([ref() is not None for ref in refs])
        return real(backend, reads, *a, **k)

    monkeypatch.setattr(reader_module, "execute_whole_reads", after_dropping_the_callers_references)
    dests = [torch.zeros(64), torch.zeros(2, 4)]
    requests = [("w", ((0,), (64,)), dests[0]), ("s", ((0, 0), (2, 4)), dests[1])]
    spans = [(t.data_ptr(), t.nbytes, t.dtype) for t in dests]
    whole, _sums, rest = whole_reads.split_whole(reader.catalog, 1 << 16, requests, {}, spans)
    assert rest == [] and [r.dest for r in whole] == dests  # each read holds the very tensor it fills
    reader.fill(requests)
    assert seen == [[True, True]] and torch.equal(dests[0], state["w"]) and torch.equal(dests[1], state["s"])


def test_a_reader_threads_scratch_is_reused_aligned_and_its_own():
    """ThreadScratch: one buffer per reader thread for a load's coalesced storage reads
    (a fresh one a batch page-faulted every byte of a cold load again), each view placed
    so its address agrees with the file offset modulo the page (O_DIRECT straight in)."""
    import threading

    scratch = whole_reads.ThreadScratch(1 << 16)
    page = read_exec.PAGE
    a = scratch.get(1000, 123)
    b = scratch.get(5000, 7)
    address = lambda view: np.frombuffer(view, np.uint8).ctypes.data  # noqa: E731
    assert len(a) == 1000 and len(b) == 5000
    assert address(a) % page == 123 and address(b) % page == 7
    assert abs(address(a) - address(b)) < page  # the same buffer, not a new one a batch
    big = scratch.get(1 << 17, 0)  # past the size given: grown
    assert len(big) == 1 << 17 and address(big) % page == 0
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(address(scratch.get(1000, 123))))
    t.start()
    t.join()
    assert other[0] != address(scratch.get(1000, 123))  # another thread's own buffer


class _CountedRead(whole_reads.WholeRead):
    """A bulk read that counts how often its destination view is asked for by name."""

    asked = 0

    @property
    def target(self) -> memoryview:
        type(self).asked += 1
        return tuple.__getitem__(self, 5)


def test_the_readers_ask_no_read_for_its_destination_per_tensor(monkeypatch):
    """Failed before (600 asked: twice a tensor): the reader threads'
    per-tensor work (grouping adjacent tensors, one CRC32C each) takes every read's
    destination, offset and expected checksum from lists made once per load; every
    byte still lands and is verified (a flipped byte is named as before: the tests above)."""
    assert whole_reads.WholeRead._fields[5] == "target"
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}.bias": torch.randn(7, generator=g) for i in range(300)}
    uri = uri_of("asked")
    bcp.save(state, uri)
    real = whole_reads.execute_whole_reads

    def counted(backend, reads, *a, **k):
        return real(backend, [_CountedRead._make(r) for r in reads], *a, **k)

    monkeypatch.setattr(reader_module, "execute_whole_reads", counted)
    _CountedRead.asked = 0
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(dest, Resident(backend_for(uri), True))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert _CountedRead.asked < 10, _CountedRead.asked


def batches_one_by_one(files, offsets, nbytes, pad, limit):
    """The batching as it was: each read, in order, joins the batch before or starts one."""
    out: list[list[int]] = []
    end, file, size = -1, -1, 0
    for i, (f, o, nb) in enumerate(zip(files, offsets, nbytes, strict=True)):
        gap = o - end
        if f == file and 0 <= gap < pad and size + gap + nb <= limit and out:
            out[-1].append(i)
            size += gap + nb
        else:
            out.append([i])
            file, size = f, nb
        end = o + nb
    return [(b[0], b[-1] + 1) for b in out]


@settings(max_examples=examples(60))
@given(
    reads=st.lists(st.tuples(st.integers(0, 2), st.integers(-100, 300), st.integers(1, 200)), min_size=0, max_size=60),
    pad=st.integers(1, 100),
    limit=st.integers(1, 2000),
)
def test_batches_found_in_numpy_are_those_added_one_by_one(reads, pad, limit):
    """whole_reads.batch_bounds (a Python step a batch) gives the batches the loop of a
    step a read gave, overlapping reads (gaps below 0), holes and reads over the limit
    included. Failed before: there was no such function (the loop ran once a tensor)."""
    files, gaps, nbytes = (list(c) for c in zip(*reads, strict=True)) if reads else ([], [], [])
    order = sorted(range(len(reads)), key=lambda i: files[i])
    offsets, at = [], 0
    for i in order:  # each file's reads in offset order, the gap before each drawn
        at = max(0, at + gaps[i])
        offsets.append(at)
        at += nbytes[i]
    f = np.array([files[i] for i in order], np.int64)
    o, n = np.array(offsets, np.int64), np.array([nbytes[i] for i in order], np.int64)
    assert whole_reads.batch_bounds(f, o, n, pad, limit) == batches_one_by_one(
        f.tolist(), offsets, n.tolist(), pad, limit
    )


@settings(max_examples=examples(60))
@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=50), data=st.data(), piece=st.integers(1, 3000))
def test_pieces_of_a_batch_from_memory_cut_as_before(sizes, data, piece):
    """whole_reads.greedy_cuts cuts a batch where its bytes reach ``piece``, as the loop
    of a step a read did. Failed before: no such function."""
    first = data.draw(st.integers(0, len(sizes) - 1))
    end = data.draw(st.integers(first + 1, len(sizes)))
    cum = np.concatenate(([0], np.cumsum(sizes)))
    want, start, size = [], first, 0
    for k in range(first, end):
        size += sizes[k]
        if size >= piece or k == end - 1:
            want.append((start, k + 1))
            start, size = k + 1, 0
    assert whole_reads.greedy_cuts(cum, first, end, piece) == want


@settings(max_examples=examples(60))
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    residents=st.lists(st.booleans(), min_size=30, max_size=30),
    batch=st.integers(1, 8),
    memory=st.integers(1, 12),
    storage=st.integers(1, 12),
)
def test_large_reads_are_cut_into_ranges_that_cover_each_byte_once(sizes, residents, batch, memory, storage):
    """whole_reads.split_large: every read larger than its task's range size (from memory
    or from storage) becomes ranges of at most that size covering its bytes once, in
    order; the smaller reads stay batched, in order, never beside a cut one."""
    nbytes = np.array(sizes, np.int64)
    order = list(range(len(sizes)))
    tasks = [(order[a : a + batch], residents[a]) for a in range(0, len(order), batch)]
    out = whole_reads.split_large(tasks, nbytes, memory, storage)
    covered: list[tuple[int, int, int]] = []
    for reads, resident, lo, hi in out:
        sub = memory if resident else storage
        if hi:
            assert len(reads) == 1 and nbytes[reads[0]] > sub and 0 <= lo < hi <= nbytes[reads[0]] and hi - lo <= sub
            covered.append((reads[0], lo, hi))
        else:
            assert reads and all(nbytes[i] <= sub for i in reads)
            covered += [(i, 0, int(nbytes[i])) for i in reads]
    assert [i for i, _lo, _hi in covered] == sorted(i for i, _lo, _hi in covered)  # the reads' order kept
    for i, size in enumerate(sizes):
        ranges = [(lo, hi) for j, lo, hi in covered if j == i]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("where", [None, 5 * 1024 + 17, 31_999])
def test_a_large_tensor_is_read_in_ranges_on_several_streams_each_block_verified(resident, where, streams, monkeypatch):
    """A tensor larger than a stream's share (here 32,000 bytes, blocks of 1 KiB, the
    last short) is read in ranges shared out among the streams (on one, still in ranges:
    a retry repeats one), from memory or from storage: it loads exactly; a flipped byte in
    a middle range or in the short last block names that block. Before, such a tensor
    went whole to one stream (or to the planner)."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 1024)
    monkeypatch.setattr(whole_reads, "SPLIT_ABOVE", 4096)
    t = torch.randn(8000)
    uri = uri_of("ranges")
    bcp.save({"w": t, "b": torch.randn(3)}, uri, checksum_block_bytes=1024)
    frag = bcp.open(uri).catalog.tensors["w"].fragment(0)
    if where is not None:
        flip(uri, frag.file, frag.byte_offset + where)
    real = whole_reads.execute_whole_reads
    monkeypatch.setattr(reader_module, "execute_whole_reads", lambda *a, **k: real(*a, **{**k, "streams": streams}))
    backend = Resident(backend_for(uri), resident)
    dest = {"w": torch.zeros(8000), "b": torch.zeros(3)}
    if where is not None:
        with pytest.raises(CorruptCheckpointError) as info:
            bcp.load(dest, backend)
        assert info.value.fqn == "w" and info.value.offset == frag.byte_offset + where // 1024 * 1024
        return
    bcp.load(dest, backend)
    assert torch.equal(dest["w"], t)
    mine = sorted((o, n) for k, o, n in backend.data_reads if frag.byte_offset <= o < frag.byte_offset + frag.nbytes)
    assert len(mine) > 4 and max(n for _o, n in mine) <= 4096  # in ranges (from memory: in chunks of them)
    assert sum(n for _o, n in mine) == frag.nbytes  # each byte read once


@settings(max_examples=examples(60))
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    block=st.sampled_from([4, 8, 12]),
    per_chunk=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_piece_checksums_are_each_pieces_whole_blocks_combined(sizes, block, per_chunk, seed):
    """whole_reads.piece_checksums, one pass for every read: for each read larger than a
    chunk, each chunk-sized piece's whole blocks combined (what one CRC32C over them must
    give), as combining them piece by piece does; its first piece's index."""
    chunk = block * per_chunk
    nbytes = np.array(sizes, np.int64) * 4
    blocks = -(-nbytes // block)
    starts = np.concatenate(([0], np.cumsum(blocks)[:-1]))
    rng = np.random.default_rng(seed)
    sums = rng.integers(0, 2**32, int(blocks.sum()), dtype=np.uint64).astype(np.uint32)
    first, wants = whole_reads.piece_checksums(sums, starts, nbytes, block, chunk)
    expected: list[int] = []
    for i, n in enumerate(nbytes.tolist()):
        if n <= chunk:
            continue
        assert first[i] == len(expected)
        whole = n // block * block
        for a in range(0, n, chunk):
            top = max(a, min(a + chunk, whole))
            expected.append(combine_blocks(sums[starts[i] + a // block : starts[i] + top // block], block))
    assert wants == expected


def test_a_load_from_memory_combines_its_pieces_checksums_once_before_the_readers(monkeypatch):
    """Tensors read from memory in pieces on several streams: their pieces' expected
    values are combined in one numpy pass in the calling thread, not one a tensor in the
    reader threads (where it held the others back: 4-11 ms a 2 GiB load here)."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 4096)
    threads: list[str] = []
    real = whole_reads.combine_block_runs
    monkeypatch.setattr(
        whole_reads, "combine_block_runs", lambda *a, **k: threads.append(threading.current_thread().name) or real(*a)
    )
    real_bulk = whole_reads.execute_whole_reads
    monkeypatch.setattr(reader_module, "execute_whole_reads", lambda *a, **k: real_bulk(*a, **{**k, "streams": 3}))
    state = {f"w{i}": torch.randn(64, 256) for i in range(4)}  # 64 KiB each: 16 pieces
    uri = uri_of("pieces")
    bcp.save(state, uri, checksum_block_bytes=1024)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    bcp.load(dest, Resident(backend_for(uri), True))
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert threads == [threading.main_thread().name]


@pytest.mark.parametrize("at", [5 * 1024 + 17, 7_999])
def test_a_large_tensor_read_whole_from_storage_names_its_flipped_block(at, monkeypatch):
    """A tensor over a chunk read whole from storage (not cut into ranges) is checked with
    its blocks combined after it lands: a flipped byte in a whole block or in the short
    last block fails the load naming that block."""
    monkeypatch.setattr(read_exec, "IN_MEMORY_CHUNK", 1024)
    t = torch.randn(2000)  # 8,000 bytes: 7 whole blocks of 1 KiB and a short one
    uri = uri_of("whole-storage")
    bcp.save({"w": t}, uri, checksum_block_bytes=1024)
    frag = bcp.open(uri).catalog.tensors["w"].fragment(0)
    flip(uri, frag.file, frag.byte_offset + at)
    with pytest.raises(CorruptCheckpointError) as info:
        bcp.load({"w": torch.zeros(2000)}, Resident(backend_for(uri), False))
    assert info.value.fqn == "w" and info.value.offset == frag.byte_offset + at // 1024 * 1024
