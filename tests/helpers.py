"""Comparison helpers shared by tests."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hypothesis import settings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from bcp.metadata.geometry import Box
    from bcp.reader import CheckpointReader
    from bcp.shared_read import SharePlan

    SharedKey = tuple[str, Box]


def examples(n: int) -> int:
    """``n`` hypothesis examples in the whole suite, a tenth (at least 10) in the fast
    tier (``pytest -m fast`` loads the "fast" profile: tests/conftest.py)."""
    return max(10, n // 10) if settings.get_current_profile_name() == "fast" else n


def stored_dtypes() -> list[torch.dtype]:
    """Every dtype bcp stores as this torch has them: the format's names
    (``bcp.metadata.DTYPE_ITEMSIZE``) that name a torch dtype here, through bcp's mapping."""
    from bcp.metadata import DTYPE_ITEMSIZE
    from bcp.torch_dtypes import torch_dtype

    names = [n for n in DTYPE_ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)]
    return sorted({torch_dtype(n) for n in names}, key=str)


def tensor_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with equal payloads compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    from bcp.tensor_io import byte_view, host_contiguous

    return bytes(byte_view(host_contiguous(a))) == bytes(byte_view(host_contiguous(b)))


def assert_same(a: Any, b: Any, where: str = "", *, ordered: bool = True) -> None:
    """Deep equality for states: tensors bitwise, floats with NaN == NaN, exact types;
    dict key order too unless ordered=False."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert tensor_bytes_equal(a, b), (
            f"{where}: tensors differ ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})"
        )
        return
    if isinstance(a, np.ndarray):
        assert type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape, f"{where}: ndarray differs"
        assert a.tobytes() == b.tobytes(), f"{where}: ndarray values differ"
        return
    assert type(a) is type(b), f"{where}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, Mapping):
        if ordered:
            assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} vs {list(b)}"
        else:
            assert set(a.keys()) == set(b.keys()), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}", ordered=ordered)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]", ordered=ordered)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: nan vs {b}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def fsdp_catalog_rows(tensors: int = 200, ranks: int = 64) -> list:
    """Catalog rows of an FSDP-like save: ``tensors`` bf16 weights of 4096 x 1024,
    each split on dim 0 over ``ranks`` writers (for catalog size and budget tests)."""
    from bcp.metadata import Fragment

    return [
        Fragment(
            f"model.layers.{i // 8}.w{i % 8}",
            f'[["d","model"],["d","layers"],["d",{i // 8}],["d","w{i % 8}"]]',
            "bfloat16",
            (4096, 1024),
            (r * 16, 0),
            (16, 1024),
            f"gen-x/data/rank{r:05d}-0.bin",
            i * 32768,
            32768,
            (7,),
            r,
        )
        for i in range(tensors)
        for r in range(ranks)
    ]


# -- test-only helpers moved out of the library (issue 38: no library caller) --------------


def share_plan_dict(
    plan: SharePlan, names: Sequence[str], ndims: Sequence[int] | Mapping[int, int]
) -> dict[SharedKey, tuple[int, list[int]]]:
    """A ``SharePlan`` as (fqn, stored box) -> (owner, receiving ranks), for comparing
    it with a reference plan."""
    out: dict[SharedKey, tuple[int, list[int]]] = {}
    needers, starts = plan.needers.tolist(), plan.starts.tolist()
    rows = zip(plan.tensors.tolist(), plan.offsets.tolist(), plan.lengths.tolist(), plan.owners.tolist(), strict=True)
    for k, (t, o, n, owner) in enumerate(rows):
        d = ndims[t]
        out[(names[t], (tuple(o[:d]), tuple(n[:d])))] = (
            owner,
            [r for r in needers[starts[k] : starts[k + 1]] if r != owner],
        )
    return out


def share_plan_pairs(plan: SharePlan) -> int:
    """A ``SharePlan``'s (fragment, needing rank) pairs in all, counted per rank class
    without expanding them."""
    rc = plan.rank_class
    sizes = np.bincount(rc, minlength=int(rc.max()) + 1 if len(rc) else 0)
    return int(sizes[plan.pair_classes].sum()) if len(plan.pair_classes) else 0


def plan_sharing(
    reader: CheckpointReader, wanted_by_rank: list[list[tuple[str, Box]]]
) -> dict[SharedKey, tuple[int, list[int]]]:
    """(fqn, stored box) -> (owner rank, receiving ranks) for the fragments several
    ranks want bytes of (``bcp.shared_read.plan_shares`` as a dict)."""
    from bcp.shared_read import Wanted, plan_shares

    plan = plan_shares(reader, [Wanted.encode(reader, w) for w in wanted_by_rank])
    names = list(reader.catalog.tensors)
    return share_plan_dict(plan, names, [len(reader.catalog.shape(f)) for f in names])


def commit_hand_made(backend: Any, gen: str, frags: list, entries: list, *, writers: int, block: int) -> None:
    """Commit a checkpoint whose catalog rows (``frags``) and data files (``entries``,
    written already) a test laid out by hand: the catalog written, then the manifest."""
    import datetime

    from bcp.commit import commit
    from bcp.metadata import Catalog, FileEntry, Manifest, crc32c
    from bcp.metadata.keys import catalog_key

    cat = Catalog(frags).to_arrow()
    backend.write(catalog_key(gen), cat)
    manifest = Manifest(
        save_id="0" * 24,
        created=datetime.datetime.now(datetime.UTC).isoformat(),
        world_size=writers,
        catalog=FileEntry(catalog_key(gen), len(cat), crc32c(cat)),
        data_files=tuple(entries),
        objects={},
        checksum_block_bytes=block,
        bcp_version="test",
        torch_version=torch.__version__,
    )
    commit(backend, manifest, overwrite=False)


def flip_bit(path: str, at: int, mask: int = 0x08) -> None:
    """Flip the bits ``mask`` of the byte at ``at`` of the file at ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))
