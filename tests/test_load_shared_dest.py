"""Load destinations that share memory (tied weights). Two keys loaded into
overlapping memory with different stored data are refused before any read, with a
ValueError naming both (before: one reader thread's checksum ran while another wrote
the same memory, a false CorruptCheckpointError blaming an intact file, or silently
whichever landed last). The same memory filled with bytes the catalog records as the
same (bcp stores tied tensors once; or equal fragments and checksums) is read once."""

from __future__ import annotations

import re
import uuid
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp import reader as reader_module
from bcp.errors import StateMismatchError
from bcp.io_scheduler import whole_reads
from bcp.io_scheduler.shared_dest import Span, destination_overlaps, without_shared_destinations


def _paths(monkeypatch: pytest.MonkeyPatch, path: str) -> dict[str, int]:
    """Count the bulk and planned reads; ``path`` "planned" sends every tensor there."""
    if path == "planned":
        monkeypatch.setattr(whole_reads, "BULK_LARGEST", 0)
    calls = {"bulk": 0, "planned": 0}
    bulk, planned = reader_module.execute_whole_reads, reader_module.execute_reads

    def count_bulk(backend, whole, *args, **kwargs):
        calls["bulk"] += len(whole)
        return bulk(backend, whole, *args, **kwargs)

    def count_planned(backend, plans, *args, **kwargs):
        calls["planned"] += len(plans)
        return planned(backend, plans, *args, **kwargs)

    monkeypatch.setattr(reader_module, "execute_whole_reads", count_bulk)
    monkeypatch.setattr(reader_module, "execute_reads", count_planned)
    return calls


@pytest.mark.parametrize("path", ["bulk", "planned"])
def test_tied_destinations_with_different_stored_values_are_refused(tmp_path, monkeypatch, path):
    """embed.weight and head.weight stored different; the caller ties them: a
    ValueError naming both keys, before a byte is read."""
    uri = str(tmp_path / "ck")
    bcp.save({"embed.weight": torch.randn(64, 32), "head.weight": torch.randn(64, 32), "x": torch.ones(3)}, uri)
    calls = _paths(monkeypatch, path)
    tied = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"'embed\.weight' and 'head\.weight'.*share memory"):
        bcp.load({"embed.weight": tied, "head.weight": tied, "x": torch.zeros(3)}, uri)
    assert calls == {"bulk": 0, "planned": 0}
    assert not tied.any()


@pytest.mark.parametrize("path", ["bulk", "planned"])
def test_partly_overlapping_destinations_are_refused(tmp_path, monkeypatch, path):
    """Views of one storage that overlap in part (even of one key's two boxes)."""
    uri = str(tmp_path / "ck")
    bcp.save({"a": torch.randn(8, 4), "b": torch.randn(8, 4)}, uri)
    _paths(monkeypatch, path)
    memory = torch.zeros(12, 4)
    with pytest.raises(ValueError, match=r"'a' and 'b'.*bytes 0\.\.128 and 64\.\.192"):
        bcp.load({"a": memory[:8], "b": memory[4:]}, uri)
    with bcp.open(uri) as reader, pytest.raises(ValueError, match=r"'a' and 'a'"):
        reader.fill([("a", ((0, 0), (4, 4)), memory[:4]), ("a", ((4, 0), (4, 4)), memory[2:6])])


@pytest.mark.parametrize("path", ["bulk", "planned"])
@pytest.mark.parametrize("stored_once", [True, False])
def test_tied_destinations_with_equal_stored_values_load(tmp_path, monkeypatch, path, stored_once):
    """A tied model saved by bcp (one copy stored) or with equal copies (equal
    checksums): loads, read once, both keys hold the value."""
    uri = str(tmp_path / "ck")
    weight = torch.randn(64, 32)
    bcp.save({"embed.weight": weight, "head.weight": weight if stored_once else weight.clone()}, uri)
    calls = _paths(monkeypatch, path)
    tied = torch.zeros(64, 32)
    loaded = bcp.load({"embed.weight": tied, "head.weight": tied}, uri)
    assert loaded["embed.weight"] is tied and torch.equal(tied, weight)
    assert calls[path] == 1 and sum(calls.values()) == 1  # read once


def test_same_key_and_box_twice_into_one_tensor_is_read_once(tmp_path):
    uri = str(tmp_path / "ck")
    value = torch.randn(16)
    bcp.save({"a": value}, uri)
    dest = torch.zeros(16)
    with bcp.open(uri) as reader:
        reader.fill([("a", ((0,), (16,)), dest), ("a", ((0,), (16,)), dest)])
    assert torch.equal(dest, value)


def test_separate_views_of_one_storage_are_fine(tmp_path):
    """Neighbouring views (touching, not overlapping) and strided views are not refused."""
    uri = str(tmp_path / "ck")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    bcp.save({"a": a, "b": b, "c": a.t().contiguous(), "d": b.t().contiguous()}, uri)
    memory = torch.zeros(8, 4)
    square = torch.zeros(4, 8)
    bcp.load({"a": memory[:4], "b": memory[4:], "c": square[:, :4].t(), "d": square[:, 4:].t()}, uri)
    assert torch.equal(memory, torch.cat([a, b])) and torch.equal(square, torch.cat([a, b], 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=0, max_size=8))
def test_overlaps_match_pairwise_comparison(spans):
    """The one sort finds an overlap exactly when some pair overlaps, and every pair
    it names does."""
    memory = torch.zeros(64, dtype=torch.int16)
    views = [memory[start : start + length] for start, length in spans]
    views.append(torch.zeros(4, dtype=torch.int16))  # another storage
    pairs = destination_overlaps(views)

    def overlap(i: int, j: int) -> bool:
        (s1, n1), (s2, n2) = spans[i], spans[j]
        return n1 > 0 and n2 > 0 and s1 < s2 + n2 and s2 < s1 + n1

    assert bool(pairs) == any(overlap(i, j) for i in range(len(spans)) for j in range(i))
    assert all(i != j and overlap(i, j) for i, j in pairs)


def test_10000_disjoint_views_of_one_storage_do_not_overlap_and_one_shared_row_does():
    """(speed lives in the benchmarks: bench/tensor_count_scale.py loads 10,000 tensors)"""
    memory = torch.zeros(10_000 * 4)
    views = list(memory.view(10_000, 4))
    assert destination_overlaps(views) == []
    assert destination_overlaps([*views, memory[8:12]]) != []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tied_cuda_destinations_are_checked_as_host_ones(tmp_path):
    uri = str(tmp_path / "ck")
    weight = torch.randn(64, 32)
    bcp.save({"a": weight, "b": weight, "c": torch.randn(64, 32)}, uri)
    tied = torch.zeros(64, 32, device="cuda")
    bcp.load({"a": tied, "b": tied}, uri, strict=False)
    assert torch.equal(tied.cpu(), weight)
    with pytest.raises(ValueError, match=r"'a' and 'c'.*share memory"):
        bcp.load({"a": tied, "c": tied}, uri, strict=False)


def test_destination_spans_are_address_and_bytes_of_dense_ones_only():
    """Failed before (no ``spans``): the bulk read takes each destination's address and
    size from the overlap check instead of asking the tensor again; a strided, empty
    or meta destination, or a tied repeat dropped, has none / no entry."""
    memory = torch.zeros(16)
    square = torch.zeros(4, 4)
    dests = [memory[:4], square.t(), torch.zeros(0), torch.zeros(3, device="meta"), memory[4:8]]
    spans: list[Span] = []
    assert destination_overlaps(dests, spans) == []
    base = memory.data_ptr()
    f32 = torch.float32
    assert spans == [(base, 16, f32), (0, 0, None), (0, 0, None), (0, 0, None), (base + 16, 16, f32)]
    stored = torch.arange(4.0)
    uri = f"memory://spans-{uuid.uuid4().hex[:8]}/ck"
    bcp.save({"w": stored, "tied": stored}, uri)
    reader = bcp.open(uri)
    tied = memory[8:12]
    requests = [("w", ((0,), (4,)), tied), ("tied", ((0,), (4,)), tied), ("w", ((0,), (4,)), memory[:4])]
    got: list[Span] = []
    kept = without_shared_destinations(requests, reader.catalog, lambda f: reader.catalog.tensors[f], got)
    assert [r[2].data_ptr() for r in kept] == [base + 32, base]
    assert got == [(base + 32, 16, f32), (base, 16, f32)]


#: how each destination of the fused-pass property test is made
KINDS = ("fresh", "shared", "strided", "wrong_dtype", "wrong_shape", "negated", "zero_dim")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(1, 6), st.integers(0, 30)), min_size=1, max_size=8))
def test_a_random_mix_of_destinations_loads_or_raises_as_checked_one_by_one(specs):
    """The one pass over the destinations (overlap check and bulk pick together) gives
    what checking each destination on its own gives: a shape mismatch or two keys
    whose dense destinations overlap raise naming the keys, else every destination
    holds its stored values (cast where its dtype differs), and each span holds the
    dtype exactly for a dense CPU tensor without a lazy negation."""
    pool = torch.zeros(64)  # the storage the "shared" views are cut from (they may overlap)
    stored, dests, spans_of = {}, {}, {}
    for i, (kind, n, at) in enumerate(specs):
        key = f"k{i}"
        shape: tuple[int, ...] = () if kind == "zero_dim" else (n,)
        stored[key] = torch.arange(float(n if shape else 1)).reshape(shape) + 100 * i
        if kind == "shared":
            dests[key] = pool[at : at + n]
        elif kind == "strided":
            dests[key] = torch.zeros(2 * n)[::2]
        elif kind == "wrong_dtype":
            dests[key] = torch.zeros(n, dtype=torch.float64)
        elif kind == "wrong_shape":
            dests[key] = torch.zeros(n + 1)
        elif kind == "negated":  # a lazily negated one-element view: dense, and never taken by the bulk read
            stored[key] = stored[key][:1]
            dests[key] = torch.zeros(1, dtype=torch.complex64).conj().imag
        else:
            dests[key] = torch.zeros(shape)
    for key, dest in dests.items():
        dense = dest.is_contiguous() and dest.nbytes > 0
        plain = dense and not dest.is_neg()
        spans_of[key] = (dest.data_ptr(), dest.nbytes, dest.dtype if plain else None) if dense else (0, 0, None)
    spans: list[Span] = []
    destination_overlaps(list(dests.values()), spans)
    assert spans == list(spans_of.values())
    uri = f"memory://mix-{uuid.uuid4().hex[:8]}/ck"
    bcp.save(stored, uri)
    keys = list(dests)
    overlapping = [
        (a, b)
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
        if spans_of[a][1] and spans_of[b][1]
        for (pa, na, _), (pb, nb, _) in [(spans_of[a], spans_of[b])]
        if pa < pb + nb and pb < pa + na
    ]
    wrong = [k for k, (kind, _n, _at) in zip(keys, specs, strict=True) if kind == "wrong_shape"]
    if wrong:
        with pytest.raises(StateMismatchError, match=re.escape(wrong[0])):
            bcp.load(dests, uri, strict=False)
        return
    if overlapping:
        with pytest.raises(ValueError, match="share memory") as raised:
            bcp.load(dests, uri, strict=False)
        assert any(f"{a!r}" in str(raised.value) and f"{b!r}" in str(raised.value) for a, b in overlapping)
        return
    bcp.load(dests, uri, strict=False)
    for key, dest in dests.items():
        assert torch.equal(dest, stored[key].to(dest.dtype)), key


class _Asked(torch.Tensor):
    """A tensor that records each accessor the overlap check asks of it."""

    asked: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.asked.append(getattr(getattr(func, "__self__", None), "__name__", None) or func.__name__)
        return super().__torch_function__(func, types, args, kwargs)


def test_a_cpu_destination_is_asked_six_things_and_never_its_device():
    """Failed before (8 asked, ``device`` among them: a new object a tensor, 0.2 us of
    a 10,000-tensor load's main thread; then 7, its lazy conjugation too, which only a
    complex tensor can hold): the usual destination, dense in CPU memory, is asked
    whether it is on the CPU, dense, its bytes, dtype, address and lazy negation; a
    complex one its lazy conjugation as well; the spans and overlaps stay as before."""
    memory = torch.zeros(8)
    dests = [memory[:4].as_subclass(_Asked), memory[2:6].as_subclass(_Asked)]
    _Asked.asked.clear()
    spans: list[Span] = []
    assert destination_overlaps(dests, spans) == [(1, 0)]
    asked = _Asked.asked
    assert "device" not in asked and "is_conj" not in asked and len(asked) == 2 * 6, asked
    pair = torch.zeros(4, dtype=torch.complex64)
    plain, conjugated = pair[:2].as_subclass(_Asked), pair[2:].conj().as_subclass(_Asked)
    _Asked.asked.clear()
    complex_spans: list[Span] = []
    assert destination_overlaps([plain, conjugated], complex_spans) == []
    assert _Asked.asked.count("is_conj") == 2 and len(_Asked.asked) == 2 * 7, _Asked.asked
    assert complex_spans == [(pair.data_ptr(), 16, torch.complex64), (pair.data_ptr() + 16, 16, None)]
    assert spans == [(memory.data_ptr(), 16, torch.float32), (memory.data_ptr() + 8, 16, torch.float32)]


@pytest.mark.parametrize("dest", [torch.zeros(1).expand(4), torch.zeros(2, 1).expand(2, 2).t()])
def test_a_destination_whose_elements_share_memory_is_refused_naming_it_before_any_write(tmp_path, dest):
    """An expand()ed destination: the copy into it failed only after the reads, with
    torch's message (no key) and every other key of the state already overwritten."""
    uri = str(tmp_path / "ck")
    bcp.save({"a": torch.arange(4.0), "b": torch.arange(4.0).view(dest.shape) + 10, "c": torch.ones(3)}, uri)
    a, c = torch.zeros(4), torch.zeros(3)
    with pytest.raises(ValueError, match=r"'b': its destination's elements share memory .*clone\(\) it"):
        bcp.load({"a": a, "b": dest, "c": c}, uri)
    assert not a.any() and not c.any(), "nothing was written"
