"""Partial reads: one tensor or a slice of it, or a subset of the state, touching
no other bytes (counted by the read statistics and by a counting backend)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import bcp
from bcp.backends import backend_for
from bcp.backends.wrappers import FaultInjectingBackend
from bcp.metadata import MANIFEST_KEY


class CountingBackend(FaultInjectingBackend):
    """Counts the bytes every read_into returned (no faults)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.bytes = 0

    def read_into(self, key, offset, buffer):
        n = super().read_into(key, offset, buffer)
        if key.endswith(".bin"):
            self.bytes += n
        return n


def full_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(256, 128, generator=g), "b": torch.randn(128, generator=g)},
        "optim": {"m": torch.randn(256, 128, generator=g), "v": torch.randn(256, 128, generator=g)},
        "step": 9,
    }


def test_loading_model_weights_only_reads_only_them(uri):
    bcp.save(full_state(), uri)
    subset = {"model": {"w": torch.empty(256, 128), "b": torch.empty(128)}}
    info = bcp.load_with_info(subset, uri, strict=False)
    assert torch.equal(info.state["model"]["w"], full_state()["model"]["w"])
    assert info.bytes_read == (256 * 128 + 128) * 4, "optimizer bytes were read for a model-only load"
    assert info.unexpected == ("optim.m", "optim.v", "step"), "a non-strict load reports what it skipped"
    assert info.missing == () and info.cast == ()


def test_open_read_of_one_tensor_touches_no_other_bytes(uri):
    bcp.save(full_state(), uri)
    counting = CountingBackend(backend_for(uri))
    reader = bcp.open(counting)
    b = reader.read("model.b")
    assert torch.equal(b, full_state()["model"]["b"]) and counting.bytes == 128 * 4


@given(st.integers(0, 255), st.integers(1, 256), st.integers(0, 127), st.integers(1, 128))
def test_a_box_reads_exactly_its_bytes(row, rows, col, cols):
    rows, cols = min(rows, 256 - row), min(cols, 128 - col)
    uri = "memory://partial-box/ck"
    if not backend_for(uri).exists(MANIFEST_KEY):
        bcp.save(full_state(), uri)
    want = full_state()["optim"]["m"][row : row + rows, col : col + cols]
    counting = CountingBackend(backend_for(uri))
    assert torch.equal(bcp.open(counting, verify=False).read("optim.m", box=((row, col), (rows, cols))), want)
    assert counting.bytes == rows * cols * 4, "without verification a box reads exactly its bytes"
    # With verification (the default), partly read checksum blocks are completed: at
    # most the 64 KiB blocks the box's rows touch.
    checked = CountingBackend(backend_for(uri))
    assert torch.equal(bcp.open(checked).read("optim.m", box=((row, col), (rows, cols))), want)
    block = 64 << 10
    first, last = (row * 128 + col) * 4 // block, ((row + rows - 1) * 128 + col + cols) * 4 // block
    assert rows * cols * 4 <= checked.bytes <= (last - first + 1) * block
