"""The share_reads plan as each rank receives it: compact by rank class, versioned,
checked on arrival.

Split from :mod:`.shared_read` (which plans): the coordinator's plan is kept per rank
class (ranks wanting identical boxes, data-parallel replicas), never expanded into
every shared fragment's needing ranks. Every rank of a class takes part in the same
fragments, so its part carries the class's arrays (the same objects for each of its
ranks) and, for the fragments this rank owns, the classes that need them with those
classes' ranks: the receivers (every needing rank but the owner, ascending) are
decoded on the rank. The coordinator's work and memory grow with (fragment, class)
pairs, not (fragment, rank) ones. A rank refuses a part that is not of this version,
not for it, or not self-consistent, with a one-line CheckpointError saying what
is wrong (:meth:`SharePart.check`): the plan crosses a process boundary."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from bcp.errors import CheckpointError
from bcp.gc_pause import gc_paused
from bcp.io_scheduler.share_owners import narrow_stable_order
from bcp.metadata.geometry import Box, window_positions
from bcp.numpy_pages import with_ordinary_pages

SharedKey = tuple[str, Box]

#: the layout of :class:`SharePart`; a rank refuses a part of another
SHARE_PART_VERSION = 2


def _expand(values: np.ndarray, starts: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values[starts[i]:starts[i + 1]]`` for each i of ``which``, flat, and each
    one's count."""
    n = starts[which + 1] - starts[which]
    pos = window_positions(starts[which].astype(np.int64), n.astype(np.int64))
    return values[pos], n


@dataclasses.dataclass(frozen=True)
class SharePart:
    """What one rank does in the exchange, in tag order (a tag is the fragment's index
    in the job-wide plan): for each shared fragment it takes part in, the tensor, the
    stored box and the owner; for each one it owns (in tag order), the classes needing
    it, ``send_classes[send_starts[j]:send_starts[j + 1]]``, numbered into
    ``peer_starts`` (class ``c``'s ranks are ``peer_ranks[peer_starts[c]:peer_starts[c + 1]]``).
    ``receivers_of(i)`` decodes the ranks this rank sends its i-th fragment to."""

    version: int
    rank: int
    world: int
    tags: np.ndarray  # int64 (K,)
    tensors: np.ndarray  # int32 (K,)
    offsets: np.ndarray  # int64 (K, D), padded past each tensor's ndim
    lengths: np.ndarray  # int64 (K, D)
    owners: np.ndarray  # int32 (K,)
    send_classes: np.ndarray  # int64, flat
    send_starts: np.ndarray  # int64 (owned + 1,)
    peer_ranks: np.ndarray  # int64, flat
    peer_starts: np.ndarray  # int64 (peer classes + 1,)

    def check(self, *, rank: int, world: int, ndims: Sequence[int] | None = None) -> None:
        """CheckpointError, one line, unless this is a part of this version for ``rank`` of
        ``world`` ranks whose arrays agree with each other (and, with ``ndims``, the
        number of dimensions of each tensor of the catalog, name real tensors)."""
        where = f"share_reads plan part for rank {rank}"
        if not isinstance(self.version, int) or self.version != SHARE_PART_VERSION:
            raise CheckpointError(f"{where}: version {self.version!r}, this bcp reads version {SHARE_PART_VERSION}")
        if (self.rank, self.world) != (rank, world):
            raise CheckpointError(f"{where}: made for rank {self.rank} of {self.world}, this is rank {rank} of {world}")
        arrays = [
            "tags",
            "tensors",
            "offsets",
            "lengths",
            "owners",
            "send_classes",
            "send_starts",
            "peer_ranks",
            "peer_starts",
        ]
        for name in arrays:
            a = getattr(self, name)
            want = 2 if name in ("offsets", "lengths") else 1
            if not isinstance(a, np.ndarray) or a.ndim != want or a.dtype.kind not in "iu":
                raise CheckpointError(f"{where}: {name} is not a {want}-D integer array")
        k = len(self.tags)
        if not (len(self.tensors) == len(self.owners) == k and self.offsets.shape == self.lengths.shape):
            raise CheckpointError(f"{where}: tags, tensors, owners, offsets and lengths differ in length")
        if len(self.offsets) != k:
            raise CheckpointError(f"{where}: {len(self.offsets)} boxes for {k} tags")
        if k and (int(self.tags[0]) < 0 or not bool((self.tags[1:] > self.tags[:-1]).all())):
            raise CheckpointError(f"{where}: tags are not ascending from 0")
        if k and (int(self.owners.min()) < 0 or int(self.owners.max()) >= world):
            raise CheckpointError(f"{where}: an owner is not a rank of {world}")
        if bool((self.offsets < 0).any()) or bool((self.lengths < 0).any()):
            raise CheckpointError(f"{where}: a box has a negative offset or length")
        if ndims is not None and k:
            if int(self.tensors.min()) < 0 or int(self.tensors.max()) >= len(ndims):
                raise CheckpointError(f"{where}: a tensor index is not in the catalog's {len(ndims)} tensors")
            if int(np.asarray(ndims, np.int64)[self.tensors].max()) > self.offsets.shape[1]:
                raise CheckpointError(f"{where}: boxes have fewer dimensions than their tensors")
        owned = int(np.count_nonzero(self.owners == rank))
        self._check_starts(where, "send_starts", self.send_starts, owned + 1, len(self.send_classes))
        n_peers = len(self.peer_starts) - 1
        self._check_starts(where, "peer_starts", self.peer_starts, max(n_peers, 0) + 1, len(self.peer_ranks))
        if len(self.send_classes) and (int(self.send_classes.min()) < 0 or int(self.send_classes.max()) >= n_peers):
            raise CheckpointError(f"{where}: a sending class is not one of its {n_peers} peer classes")
        if len(self.peer_ranks) and (int(self.peer_ranks.min()) < 0 or int(self.peer_ranks.max()) >= world):
            raise CheckpointError(f"{where}: a peer is not a rank of {world}")

    @staticmethod
    def _check_starts(where: str, name: str, starts: np.ndarray, n: int, total: int) -> None:
        if len(starts) != n or int(starts[0]) != 0 or int(starts[-1]) != total or bool((np.diff(starts) < 0).any()):
            raise CheckpointError(f"{where}: {name} does not run from 0 to {total} in {n - 1} steps")

    @functools.cached_property
    def _receivers(self) -> tuple[np.ndarray, np.ndarray]:
        """(receivers flat, starts (K + 1,)): every needing rank of each owned tag but
        this one, ascending; none for the others."""
        mine = np.flatnonzero(self.owners == self.rank)
        classes, per_tag = _expand(self.send_classes, self.send_starts, np.arange(len(mine)))
        ranks, per_class = _expand(self.peer_ranks, self.peer_starts, classes)
        tag_of = np.repeat(np.repeat(np.arange(len(mine)), per_tag), per_class)
        if len(ranks) > 1 and not bool((np.diff(ranks) > 0)[tag_of[1:] == tag_of[:-1]].all()):
            order = np.lexsort((ranks, tag_of))
            ranks, tag_of = ranks[order], tag_of[order]
        keep = ranks != self.rank
        ranks, tag_of = ranks[keep], tag_of[keep]
        counts = np.zeros(len(self.tags), np.int64)
        counts[mine] = np.bincount(tag_of, minlength=len(mine))
        starts = np.zeros(len(self.tags) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        return ranks.astype(np.int64), starts

    @property
    def receivers(self) -> np.ndarray:
        return self._receivers[0]

    @property
    def recv_starts(self) -> np.ndarray:
        return self._receivers[1]

    def receivers_of(self, i: int) -> np.ndarray:
        """The ranks this rank sends its i-th fragment to (empty unless it owns it)."""
        rs, starts = self._receivers
        return rs[starts[i] : starts[i + 1]]

    def keys(self, names: Sequence[str], ndims: Mapping[int, int]) -> list[SharedKey]:
        out = []
        for t, o, n in zip(self.tensors.tolist(), self.offsets.tolist(), self.lengths.tolist(), strict=True):
            d = ndims[t]
            out.append((names[t], (tuple(o[:d]), tuple(n[:d]))))
        return out


#: rows of a run of classes gathered at once in :func:`class_parts`, in bytes of a box array
_RUN_BYTES = (4 << 20) - 4096

#: keys past 8 a pair plus this many are numbered by a sort, not a table of every key
_TABLE_SLACK = 1 << 22


def _sent_by_owner(
    world: int, owners: np.ndarray, pair_classes: np.ndarray, pair_starts: np.ndarray, n_classes: int
) -> tuple[list[int], np.ndarray, np.ndarray, list[int], np.ndarray]:
    """What every rank sends, for every rank at once: tags by owner (tag order within),
    each with the classes needing it. Returns the tags' bounds per owner, the starts of
    each owned tag's classes (owner order), those classes as indices into their
    owner's peer classes, the peers' bounds per owner and the peer classes (the distinct
    classes an owner sends to, ascending). One numbering of the (owner, class) keys for
    all owners, by a table of the keys seen where it is small: no sort per rank. Bounds
    are as plain ints, at each owner (``world + 1`` of them)."""
    span = max(world, int(owners.max()) + 1) if len(owners) else world  # ranks past ``world`` own nothing here
    if len(owners) and int(owners.min()) < 0:
        raise ValueError("a shared fragment's owner is not a rank")
    by_owner = narrow_stable_order(owners)
    # each owner's first place in that order: a search of the sorted owners (np.bincount
    # of int32 owners copies them to intp first, 3x the cost)
    obounds = np.searchsorted(owners[by_owner], np.arange(span + 1, dtype=owners.dtype if len(owners) else np.int64))
    first = pair_starts[:-1][by_owner]  # each tag's first pair, tags by owner
    per_tag = pair_starts[1:][by_owner]
    per_tag -= first
    del by_owner
    sstarts = np.zeros(len(first) + 1, np.int64)
    np.cumsum(per_tag, out=sstarts[1:])
    n = int(sstarts[-1])
    key = pair_classes[_windows(first, per_tag, sstarts, n)]  # each tag's classes, tags by owner
    del first, per_tag
    if key.dtype != np.int64:
        key = key.astype(np.int64)
    pairs_at = sstarts[obounds].tolist()  # each owner's pairs: key[pairs_at[o]:pairs_at[o + 1]]
    owning = np.flatnonzero(np.diff(obounds)).tolist()  # the owners of some tag
    for o in owning:  # (owner, class), in place: no array as long as the pairs
        key[pairs_at[o] : pairs_at[o + 1]] += o * n_classes
    bound = span * n_classes
    if n and bound <= 8 * n + _TABLE_SLACK:
        seen = np.zeros(bound, bool)
        seen[key] = True
        number = np.cumsum(seen, dtype=np.int32 if bound < 1 << 31 else np.int64)
        uniq = np.flatnonzero(seen)
        del seen
        local = number[key].astype(np.int64)
        del number
        local -= 1
    else:
        uniq, inverse = np.unique(key, return_inverse=True)
        local = inverse.reshape(-1).astype(np.int64, copy=False)
    del key
    ubounds = np.searchsorted(uniq, np.arange(span + 1, dtype=np.int64) * n_classes)
    for o in owning:  # numbered from 0 per owner
        local[pairs_at[o] : pairs_at[o + 1]] -= int(ubounds[o])
    at = obounds[: world + 1]
    return at.tolist(), sstarts, local, ubounds[: world + 1].tolist(), uniq % max(n_classes, 1)


def _windows(first: np.ndarray, width: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """:func:`~bcp.metadata.geometry.window_positions` (``starts``: the running sum of
    ``width``, ``n`` its total), or ``first`` itself where every width is 1 (no copy)."""
    if n == len(first) and bool((width == 1).all()):
        return first
    return window_positions(first, width, starts[:-1])


@gc_paused  # as inside the load that calls it: a part per rank, the caller's heap not walked
@with_ordinary_pages  # its arrays: no huge-page compaction stalls (bcp.numpy_pages)
def class_parts(
    world: int,
    tensors: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    owners: np.ndarray,
    pair_classes: np.ndarray,
    pair_starts: np.ndarray,
    rank_class: np.ndarray,
    class_tags: np.ndarray | None = None,
) -> list[SharePart]:
    """Each rank's part of a plan whose shared fragment k (tag k) is needed by classes
    ``pair_classes[pair_starts[k]:pair_starts[k + 1]]`` (ascending), ranks in classes
    as ``rank_class`` says. Arrays per class, a few small operations per rank.
    ``class_tags``: the pairs' tags in order of class then tag, where the caller has
    them (saves sorting the pairs back by class)."""
    n_classes = int(rank_class.max()) + 1 if len(rank_class) else 0
    members = narrow_stable_order(rank_class).astype(np.int64)  # ranks by class, ascending within
    sizes = np.bincount(rank_class, minlength=n_classes).astype(np.int64)
    mstarts = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    k = len(owners)
    if class_tags is None:
        tag_of_pair = np.repeat(np.arange(k, dtype=np.int64), np.diff(pair_starts))
        by_class = narrow_stable_order(pair_classes)  # pairs by class, tag order within
        class_tags = tag_of_pair[by_class]
        del tag_of_pair, by_class
    cbounds = np.r_[0, np.cumsum(np.bincount(pair_classes, minlength=n_classes))].tolist()
    obounds, sstarts, sends_all, ubounds, peer_cls = _sent_by_owner(world, owners, pair_classes, pair_starts, n_classes)
    # the peer classes' ranks, every owner's peers one after another
    peer_sizes = sizes[peer_cls]
    pstarts = np.zeros(len(peer_cls) + 1, np.int64)
    np.cumsum(peer_sizes, out=pstarts[1:])
    at = np.repeat(mstarts[peer_cls] - pstarts[:-1], peer_sizes)
    at += np.arange(int(pstarts[-1]), dtype=np.int64)
    peer_ranks = members[at]
    del at, peer_sizes, peer_cls
    width = offsets.shape[1]
    # the classes' arrays gathered a run of classes at a time, each class a slice: runs of
    # under 4 MiB an array (numpy asks for huge pages from 4 MiB, and where the host's
    # huge-page defrag is "madvise" a first touch of those may stall to compact memory);
    # joining offsets and lengths first (one gather) would cost a copy of every shared box
    # at the peak of the coordinator's memory
    per_class: list[tuple[np.ndarray, ...]] = []
    run = max(1, _RUN_BYTES // (8 * max(width, 1)))
    c = 0
    while c < n_classes:
        end = c + 1
        while end < n_classes and cbounds[end + 1] - cbounds[c] <= run:
            end += 1
        lo, hi = cbounds[c], cbounds[end]
        mine = class_tags[lo:hi].astype(np.int64, copy=False)
        run_arrays = (mine, tensors[mine], np.take(offsets, mine, axis=0), np.take(lengths, mine, axis=0), owners[mine])
        per_class += [
            tuple(x[a - lo : b - lo] for x in run_arrays) for a, b in itertools.pairwise(cbounds[c : end + 1])
        ]
        c = end
    none = (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros((0, width), np.int64))
    nothing = (none[0], none[1], none[2], none[2], none[1])
    pairs_at = sstarts[obounds].tolist()  # each owner's first pair sent
    peers_at = pstarts[ubounds].tolist()  # each owner's first peer rank
    class_of = rank_class.tolist()
    out = []
    for r in range(world):
        c = class_of[r] if r < len(class_of) else -1
        mine, c_tensors, c_off, c_len, c_owners = per_class[c] if c >= 0 else nothing
        a, b = obounds[r], obounds[r + 1]
        if a < b:
            sa, sb = pairs_at[r], pairs_at[r + 1]
            ranks_of = peer_ranks[peers_at[r] : peers_at[r + 1]]
            peer_starts = pstarts[ubounds[r] : ubounds[r + 1] + 1] - peers_at[r]
            sends, send_starts = sends_all[sa:sb], sstarts[a : b + 1] - sa
        else:
            ranks_of, peer_starts, sends, send_starts = none[0], np.zeros(1, np.int64), none[0], np.zeros(1, np.int64)
        out.append(
            SharePart(
                SHARE_PART_VERSION,
                r,
                world,
                mine,
                c_tensors,
                c_off,
                c_len,
                c_owners,
                sends,
                send_starts,
                ranks_of,
                peer_starts,
            )
        )
    return out
