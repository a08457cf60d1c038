"""A sync save's batches from the tensors' own memory (issue 37, per-tensor costs):
each dense host tensor's bytes are a slice of one view over the plan's addresses, and
the batches are cut once per kept plan. What must hold: every byte written is the
tensor's at the time of the save, on a kept plan too (values changed in place, memory
moved, strided and empty tensors beside), and no per-tensor numpy view is made."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bcp
from bcp.io_scheduler import chunk_plan, write_pipeline
from bcp.verify import verify_checkpoint
from helpers import tensor_bytes_equal

BLOCK = 4 << 10


def _state(gen: torch.Generator, sizes: list[int], kinds: list[int]) -> dict[str, torch.Tensor]:
    """Tensors of about ``sizes`` elements: dense float32, bfloat16 (no numpy twin), a
    view at an offset, or a transposed (strided) matrix, by ``kinds``."""
    out: dict[str, torch.Tensor] = {}
    for i, (n, kind) in enumerate(zip(sizes, kinds, strict=False)):
        base = torch.randn(n + 3, generator=gen)
        if kind == 0:
            out[f"t{i}"] = base[:n].clone()
        elif kind == 1:
            out[f"t{i}"] = base[:n].to(torch.bfloat16)
        elif kind == 2:
            out[f"t{i}"] = base[3:]  # a view: its address is not its storage's
        else:
            out[f"t{i}"] = torch.randn(2, n + 1, generator=gen).t()  # strided: copied, not viewed
    return out


def _reads_back(uri: str, state: dict[str, torch.Tensor]) -> None:
    report = verify_checkpoint(uri)
    assert report["ok"], report["problems"]
    r = bcp.open(uri)
    for k, v in state.items():
        assert tensor_bytes_equal(r.read(k), v.contiguous()), k


@settings(max_examples=10, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 120_000), min_size=1, max_size=8),
    kinds=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    batch=st.sampled_from([16 << 10, 64 << 10, 1 << 20]),
)
def test_kept_plans_batches_write_the_bytes_of_each_save(tmp_path_factory, sizes, kinds, batch):
    """Saved three times with one plan kept: as made, after every value changed in
    place (the same addresses: the kept views must see the new bytes), and after one
    tensor moved to new memory (a new plan). Each save reads back exactly."""
    gen = torch.Generator().manual_seed(sum(sizes) + batch)
    state = _state(gen, sizes, kinds)
    root = tmp_path_factory.mktemp("ck")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(write_pipeline, "BATCH_BYTES", batch)
        bcp.save(state, str(root / "a"), checksum_block_bytes=BLOCK)
        _reads_back(str(root / "a"), state)
        with torch.no_grad():
            for v in state.values():
                v.add_(1)
        bcp.save(state, str(root / "b"), checksum_block_bytes=BLOCK)
        _reads_back(str(root / "b"), state)
        first = next(iter(state))
        state[first] = state[first].clone() * 2  # new memory: the kept plan no longer fits
        bcp.save(state, str(root / "c"), checksum_block_bytes=BLOCK)
        _reads_back(str(root / "c"), state)


def test_a_batched_save_makes_no_numpy_view_per_dense_tensor(tmp_path, monkeypatch):
    """Dense host tensors are sliced from one view of their memory: ``Tensor.numpy`` is
    not called once per tensor (it was: a third of the producer's time at 10,000)."""
    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", 1 << 20)
    gen = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randn(100 + i, generator=gen) for i in range(300)}
    calls = [0]
    numpy = torch.Tensor.numpy

    def counted(self, *a, **k):
        calls[0] += 1
        return numpy(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", counted)
    bcp.save(state, str(tmp_path / "ck"), checksum_block_bytes=BLOCK)
    monkeypatch.undo()
    assert calls[0] < 10, f"Tensor.numpy called {calls[0]} times for 300 tensors"
    _reads_back(str(tmp_path / "ck"), state)


def test_a_kept_plan_cuts_its_batches_once(tmp_path, monkeypatch):
    """The second save of the same structure takes the batches its kept plan cut at
    the first (they were cut again at every save: 10 ms at 10,000 tensors)."""
    monkeypatch.setattr(write_pipeline, "BATCH_BYTES", 1 << 20)
    cuts = [0]
    real = chunk_plan.plan_packed_chunks

    def counted(*a, **k):
        cuts[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(chunk_plan, "plan_packed_chunks", counted)
    gen = torch.Generator().manual_seed(8)
    state = {f"t{i}": torch.randn(5000 + i, generator=gen) for i in range(50)}
    bcp.save(state, str(tmp_path / "a"), checksum_block_bytes=BLOCK)
    first = cuts[0]
    assert first >= 1
    bcp.save(state, str(tmp_path / "b"), checksum_block_bytes=BLOCK)
    assert cuts[0] == first, "the batches were cut again for a kept plan"
    _reads_back(str(tmp_path / "b"), state)
