"""Replicas must agree: a tensor every rank holds in full is stored once.

A plain tensor (or a DTensor box replicated over a mesh dimension) is written by
one of its holders only (``bcp.planning`` deduplicates it), so a value that
differs per rank (an RNG state, a per-rank counter) would come back from one rank
to all, silently. Each rank therefore sends, in the ``Hello`` it sends at every save,
a CRC32C of the logical row-major bytes of each replicated box it holds (only the
small ones by default: ``SaveOptions.check_replicas``); the coordinator compares the
copies of each box and refuses the save, naming the keys and ranks, before anything
is written. Bytes, not values, are compared: NaNs with equal bits agree.

The sums are computed while the save is prepared, before ``save``/``async_save``
touch anything else, so they are of the values at the call.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from bcp.errors import ReplicaMismatchError, UnsupportedStateError
from bcp.metadata.checksum import crc32c_raw
from bcp.metadata.geometry import Box
from bcp.options import REPLICA_CHECKS
from bcp.planning import LayoutMeta
from bcp.state import clashing_keys
from bcp.tensor_io import flat_bytes, host_contiguous, raw

#: "small": boxes of at most this many bytes are checked (RNG states, counters, small
#: buffers). Measured (docs/benchmarks.md, bench/replica_check_bench.py --sweep): up to
#: here a tensor's check costs about its fixed part (a few microseconds, against 40-100
#: to save the tensor); above, the CRC grows with the size, towards a fifth or more of
#: the save's own time per byte (2 ranks, local disk).
SMALL_REPLICA_BYTES = 16 << 10

#: largest device-to-host copy a checksum makes at once (for "all" on large CUDA tensors)
_DEVICE_CHUNK_BYTES = 64 << 20
#: keys, and ranks per key, named in the error before "and N more"
_LISTED = 8


class ReplicaSums(NamedTuple):
    """One rank's checksums of the replicated boxes it holds, one entry per box."""

    #: the tensor's index in the rank's layout metadata (``LayoutMeta.fqns``)
    tensors: np.ndarray
    #: 0 for a box covering the whole tensor, else a hash of the box (equal boxes, equal hash)
    boxes: np.ndarray
    #: CRC32C of the box's bytes in row-major order
    sums: np.ndarray


def box_key(box: Box, shape: tuple[int, ...]) -> int:
    """0 for the whole tensor; else a hash of the box, the same in every process (tuples
    of ints hash deterministically) and never 0."""
    offsets, lengths = box
    if lengths == tuple(shape) and not any(offsets):
        return 0
    return hash((offsets, lengths)) or 1


class ReplicaSummer:
    """Collects one rank's replicated boxes while the save is prepared, then checksums
    them: CPU tensors at once, device tensors batched into one host copy per device."""

    def __init__(self, mode: str) -> None:
        if mode not in REPLICA_CHECKS:
            raise ValueError(f"check_replicas must be one of {', '.join(REPLICA_CHECKS)}; got {mode!r}")
        self.limit = math.inf if mode == "all" else SMALL_REPLICA_BYTES if mode == "small" else -1
        self.tensors: list[int] = []
        self.boxes: list[int] = []
        self.sums: list[int] = []
        #: device -> [(entry index, tensor)] waiting for one batched host copy
        self.pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}

    @property
    def enabled(self) -> bool:
        return self.limit >= 0

    def add(self, tensor_index: int, box: Box, shape: tuple[int, ...], t: torch.Tensor) -> None:
        """Checksum ``t``, the local memory of ``box`` of tensor ``tensor_index`` (of
        ``shape``), when its size is one this mode checks."""
        # runs for every small replicated tensor at every save: about 2 us each on CPU
        nbytes = t.nbytes
        if not 0 < nbytes <= self.limit:
            return
        self.tensors.append(tensor_index)
        self.boxes.append(box_key(box, shape))
        if t.is_cpu:
            self.sums.append(_cpu_crc(t, nbytes))
        elif nbytes <= SMALL_REPLICA_BYTES:
            self.pending.setdefault(t.device, []).append((len(self.sums), t))
            self.sums.append(0)
        else:
            self.sums.append(_device_crc(t))

    def finish(self) -> ReplicaSums:
        for entries in self.pending.values():
            flats = [flat_bytes(_dense(t)) for _i, t in entries]
            host = torch.cat(flats).cpu()  # one device-to-host copy per device
            at = host.data_ptr()
            for (i, _t), flat in zip(entries, flats, strict=True):
                self.sums[i] = crc32c_raw((ctypes.c_char * flat.numel()).from_address(at))
                at += flat.numel()
        self.pending.clear()
        return ReplicaSums(
            np.array(self.tensors, dtype=np.int32),
            np.array(self.boxes, dtype=np.int64),
            np.array(self.sums, dtype=np.uint32),
        )


def _cpu_crc(t: torch.Tensor, nbytes: int) -> int:
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = host_contiguous(t)
    # the dense tensor's bytes, read in place (a ctypes array over its memory costs a
    # third of a tensor or numpy view, and this runs for every small replica at every save)
    return crc32c_raw((ctypes.c_char * nbytes).from_address(t.data_ptr()))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values, row-major and contiguous, on its own device."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else raw(t).contiguous()


def _device_crc(t: torch.Tensor) -> int:
    """A large device tensor, copied to the host a chunk at a time."""
    flat = flat_bytes(_dense(t))
    value = 0
    for at in range(0, flat.numel(), _DEVICE_CHUNK_BYTES):
        host = flat[at : at + _DEVICE_CHUNK_BYTES].cpu()
        value = crc32c_raw((ctypes.c_char * host.numel()).from_address(host.data_ptr()), value)
    return value


def check_replicas(
    sums: Sequence[ReplicaSums | None], meta_digests: Sequence[bytes], metas: Mapping[bytes, LayoutMeta]
) -> None:
    """(coordinator) Raise ReplicaMismatchError when two ranks' copies of a replicated
    box differ. ``sums[r]`` is rank r's (None: it checked nothing), ``meta_digests[r]``
    its layout metadata's digest, found in ``metas``. Columnar: one sort over every
    rank's entries, no Python object per entry unless something differs."""
    present = [(r, s) for r, s in enumerate(sums) if s is not None and len(s.sums)]
    if len(present) < 2:
        return
    # a job-wide id per FQN, built once per distinct metadata
    gid_of: dict[str, int] = {}
    gids: dict[bytes, np.ndarray] = {}
    for r, _s in present:
        d = meta_digests[r]
        if d not in gids:
            gids[d] = np.array([gid_of.setdefault(f, len(gid_of)) for f in metas[d].fqns], dtype=np.int64)
    gid = np.concatenate([gids[meta_digests[r]][s.tensors] for r, s in present])
    box = np.concatenate([s.boxes for _r, s in present])
    crc = np.concatenate([s.sums for _r, s in present])
    rank = np.concatenate([np.full(len(s.sums), r, dtype=np.int64) for r, s in present])
    order = np.lexsort((rank, box, gid))  # by tensor, then box, then rank
    gid, box, crc, rank = gid[order], box[order], crc[order], rank[order]
    start = np.ones(len(gid), dtype=bool)
    start[1:] = (gid[1:] != gid[:-1]) | (box[1:] != box[:-1])
    first = np.flatnonzero(start)
    group = np.cumsum(start) - 1
    differs = crc != crc[first][group]  # against the group's lowest rank
    if not differs.any():
        return
    names = list(gid_of)
    reference = rank[first][group]
    found: dict[str, dict[int, list[int]]] = {}  # fqn -> {reference rank: ranks that differ from it}
    for i in np.flatnonzero(differs).tolist():
        per_ref = found.setdefault(names[gid[i]], {})
        per_ref.setdefault(int(reference[i]), []).append(int(rank[i]))
    raise ReplicaMismatchError(_message(found), differing=found)


def _message(found: dict[str, dict[int, list[int]]]) -> str:
    parts = []
    for fqn in list(found)[:_LISTED]:
        sides = "; ".join(
            f"{_ranks(sorted(set(rs)))} differ{'s' if len(set(rs)) == 1 else ''} from rank {ref}"
            for ref, rs in sorted(found[fqn].items())
        )
        parts.append(f"{fqn!r} ({sides})")
    more = f", and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    return (
        f"replicated tensors differ between ranks: {', '.join(parts)}{more}. A plain tensor (or a DTensor "
        "replicated over a mesh dimension) is stored once, so loading would give every rank one rank's copy. "
        "Wrap values that are meant to differ per rank in bcp.PerRank (RNG states, per-rank counters: saved "
        "once per rank), wrap a tensor whose copies may differ in bcp.LowestRankCopy to store the lowest rank's "
        "(BatchNorm statistics: bcp.TrainingState does), save tensors that are split over ranks as a DTensor or "
        "bcp.TensorShard, or make the copies equal; check_replicas='off' turns this check off"
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:_LISTED]))
    more = f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


#: the tensors' places of the last few sets of layouts (by their digests: a digest names its
#: metadata for good), so that a save of a kept plan checks only its objects against them
_PLACES: dict[tuple[bytes, ...], tuple[dict[str, Any], frozenset[str]]] = {}


def _tensor_places(meta_digests: Sequence[bytes], metas: Mapping[bytes, LayoutMeta]) -> tuple[dict, frozenset[str]]:
    """fqn -> key path of every rank's tensors, and every dot-prefix of their FQNs."""
    key = tuple(meta_digests)
    found = _PLACES.get(key)
    if found is None:
        tensors: dict[str, Any] = {}
        for d in dict.fromkeys(meta_digests):
            tensors.update(zip(metas[d].fqns, metas[d].key_paths, strict=True))
        prefixes: set[str] = set()
        for fqn in tensors:
            while "." in fqn and (fqn := fqn.rpartition(".")[0]) not in prefixes:
                prefixes.add(fqn)  # a prefix seen before had its own added then
        found = _PLACES[key] = (tensors, frozenset(prefixes))
        while len(_PLACES) > 4:
            del _PLACES[next(iter(_PLACES))]
    return found


def check_places(
    objects: Mapping[str, Sequence[Any]],
    meta_digests: Sequence[bytes],
    metas: Mapping[bytes, LayoutMeta],
    *,
    tensors_checked: bool = False,
) -> None:
    """(coordinator) UnsupportedStateError, before anything is written, when the ranks'
    states give two entries one place (:func:`bcp.state.clashing_keys`): rank 0 saving
    ``{"model": {"w": t}}`` and rank 1 ``{"model": {}}`` made a checkpoint no load could
    read. ``objects``: the save's object entries (fqn -> entries with ``key_path`` and
    ``rank``); the tensors' from every rank's layout metadata. ``tensors_checked``: these
    layouts passed before (a kept plan): only an object where a tensor is, around one or
    under one is looked at closely (a set lookup an object, not a pass over the tensors)."""
    tensors, prefixes = _tensor_places(meta_digests, metas)
    if tensors_checked and not any(
        fqn in tensors or fqn in prefixes or any(fqn[:i] in tensors for i, c in enumerate(fqn) if c == ".")
        for fqn in objects
    ):
        return
    clash = clashing_keys(tensors, {fqn: entries[0].key_path for fqn, entries in objects.items()})
    if clash is None:
        return
    inner, outer = clash

    def held_by(fqn: str, kind: str) -> str:
        if kind == "tensor":
            return f"a tensor on rank(s) {[r for r, d in enumerate(meta_digests) if fqn in metas[d].fqns]}"
        ranks = [e.rank for e in objects[fqn]]
        return "a value on every rank" if None in ranks else f"a value on rank(s) {ranks}"

    inside = held_by(outer, "value") if outer in objects else held_by(outer, "tensor")
    where = f"{inner!r} is {held_by(inner, 'tensor' if inner in tensors else 'value')}"
    where += f" and {held_by(inner, 'value')}" if inner == outer else f" inside {outer!r}, {inside}"
    raise UnsupportedStateError(
        f"the ranks' states give two entries one place: {where}; every rank must save a key as the same kind "
        "(a torch full_state_dict=True state holds tensors on rank 0 alone and {} elsewhere: save the sharded "
        "state, which bcp reshards at load, or rank 0's with process_group=bcp.LOCAL)"
    )
