"""Who writes what: boxes held by one rank are that rank's; replicated boxes are
balanced over their holders, largest first, each to its least-loaded holder (LPT),
but those of a ``bcp.LowestRankCopy`` tensor go to their lowest-ranked holder;
zero-byte boxes go to the least-loaded holder at the end, and the boxes of tied
tensors follow their target's."""

from __future__ import annotations

import heapq

import numpy as np

#: Ranks per block of the matrix path (bounds its temporaries to a few times
#: CHUNK x tensors values).
CHUNK = 512


class Assignments:
    """What each rank writes and the bytes it carries, filled in by the paths."""

    def __init__(self, world: int, lowest: np.ndarray | None = None) -> None:
        self.world = world
        #: (G,) tensors whose replicated boxes go to their lowest-ranked holder (None: none)
        self.lowest = lowest
        self.load = np.zeros(world, dtype=np.int64)
        #: the matrix path's (rank x tensor) "writes its own box" mask and the tensors of its columns
        self.mask: np.ndarray | None = None
        self.mask_tensors: np.ndarray | None = None
        #: (rank, index) pairs written
        self.ranks: list[np.ndarray] = []
        self.indices: list[np.ndarray] = []
        #: boxes with several holders: (nbytes, gid, order, holder ranks, holder indices)
        self.replicated: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []
        #: zero-byte boxes with several holders: any holder is as good, the least loaded wins
        self.zero_ranks: list[np.ndarray] = []
        self.zero_indices: list[np.ndarray] = []
        self.zero_counts: list[np.ndarray] = []
        #: matrix columns whose empty boxes (one box, many holders) go to the least loaded
        self.empty_columns: np.ndarray | None = None
        #: boxes of tied tensors, placed once the rest is: ((holder ranks, indices), the
        #: same for the target's same box)
        self.aliases: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = []

    def fixed(self, ranks: np.ndarray, indices: np.ndarray, nbytes: np.ndarray) -> None:
        if len(ranks):
            self.ranks.append(ranks.astype(np.int64, copy=False))
            self.indices.append(indices.astype(np.int64, copy=False))
            np.add.at(self.load, ranks, nbytes)

    def _lpt(self) -> None:
        """Largest first, each to its least-loaded holder (ties by rank)."""
        if not self.replicated:
            return
        self.replicated.sort(key=lambda it: (-it[0], it[1], it[2]))
        load = self.load.tolist()
        world = self.world
        heap: list[tuple[int, int]] | None = None
        out_r, out_i = [], []
        lowest = self.lowest
        for nbytes, g, _o, hr, hi in self.replicated:
            if lowest is not None and lowest[g]:
                j = int(np.argmin(hr))
                r = int(hr[j])
            elif len(hr) == world and world > 1 and hr[0] == 0 and hr[-1] == world - 1 and _distinct(hr):
                if heap is None:
                    heap = [(v, r) for r, v in enumerate(load)]
                    heapq.heapify(heap)
                while True:  # lazy heap: skip entries made stale by later assignments
                    cur, r = heapq.heappop(heap)
                    if cur == load[r]:
                        break
                j = int(np.searchsorted(hr, r))
            else:
                ranks = hr.tolist()
                j = min(range(len(ranks)), key=lambda x: (load[ranks[x]], ranks[x]))
                r = ranks[j]
            load[r] += nbytes
            if heap is not None:
                heapq.heappush(heap, (load[r], r))
            out_r.append(r)
            out_i.append(int(hi[j]))
        self.load = np.array(load, dtype=np.int64)
        self.ranks.append(np.array(out_r, dtype=np.int64))
        self.indices.append(np.array(out_i, dtype=np.int64))

    def _elect_zero_byte(self) -> None:
        """Zero-byte boxes move no load: each goes to its holder with the least final
        load (ties by rank), exactly where LPT, taking them last, would put them."""
        order = np.lexsort((np.arange(self.world), self.load))
        position = np.empty(self.world, dtype=np.int64)
        position[order] = np.arange(self.world)
        if self.zero_ranks:
            hr, hi = np.concatenate(self.zero_ranks), np.concatenate(self.zero_indices)
            counts = np.concatenate(self.zero_counts)
            starts = np.cumsum(counts) - counts
            best = np.minimum.reduceat(position[hr], starts)
            winner = order[best]
            hit = np.flatnonzero(hr == np.repeat(winner, counts))
            seg = np.searchsorted(starts, hit, side="right") - 1
            _u, first = np.unique(seg, return_index=True)
            self.ranks.append(hr[hit[first]])
            self.indices.append(hi[hit[first]])
        if self.empty_columns is not None and len(self.empty_columns):
            assert self.mask is not None and self.mask_tensors is not None
            cols = self.empty_columns
            best = np.full(len(cols), self.world, dtype=np.int64)
            for a in range(0, self.world, CHUNK):
                pos = position[a : a + CHUNK, None]
                best = np.minimum(best, np.where(self.mask[a : a + CHUNK][:, cols], self.world, pos).min(axis=0))
            self.ranks.append(order[best])
            self.indices.append(self.mask_tensors[cols])

    def _place_aliases(self) -> None:
        """A tied tensor's box goes to the rank writing the same box of its target
        (which stores the bytes once) when that rank holds it, else to its first holder."""
        if not self.aliases:
            return
        ranks, indices = np.concatenate(self.ranks), np.concatenate(self.indices)
        # one key per (rank, index): the radix must exceed every index looked up too,
        # or a target row's key could equal another rank's written row
        radix = 1 + max([int(indices.max()) if len(indices) else 0] + [int(ti.max()) for _h, (_tr, ti) in self.aliases])
        written = np.sort(ranks * radix + indices)
        out_r, out_i = [], []
        for (hr, hi), (tr, ti) in self.aliases:
            key = tr * radix + ti
            pos = np.minimum(np.searchsorted(written, key), len(written) - 1)
            owner = tr[written[pos] == key]
            hit = np.flatnonzero(hr == owner[0]) if len(owner) else np.zeros(0, np.int64)
            j = int(hit[0]) if len(hit) else 0
            out_r.append(int(hr[j]))
            out_i.append(int(hi[j]))
        self.ranks.append(np.array(out_r, dtype=np.int64))
        self.indices.append(np.array(out_i, dtype=np.int64))

    def finish(self) -> tuple[dict[int, np.ndarray], list[int]]:
        """Balance what is left; returns each rank's writes (indices into its box list,
        ascending, int32, read-only) and the bytes each rank writes."""
        self._lpt()
        self._elect_zero_byte()
        self._place_aliases()
        ranks = np.concatenate(self.ranks) if self.ranks else np.zeros(0, np.int64)
        indices = np.concatenate(self.indices) if self.indices else np.zeros(0, np.int64)
        order = np.lexsort((indices, ranks))
        ranks, indices = ranks[order], indices[order].astype(np.int32)
        bounds = np.searchsorted(ranks, np.arange(self.world + 1)).tolist()
        writes: dict[int, np.ndarray] = {}
        if self.mask is not None and self.mask_tensors is not None:
            cols = self.mask_tensors.astype(np.int32)
            for a in range(0, self.world, CHUNK):
                rows, at = np.nonzero(self.mask[a : a + CHUNK])
                own = cols[at]  # one array per block; each rank's list is a view of it
                own.flags.writeable = False
                cuts = np.searchsorted(rows, np.arange(min(CHUNK, self.world - a) + 1)).tolist()
                for i in range(len(cuts) - 1):
                    writes[a + i] = own[cuts[i] : cuts[i + 1]]
        else:
            empty = np.zeros(0, dtype=np.int32)
            empty.flags.writeable = False
            writes = dict.fromkeys(range(self.world), empty)
        for r in np.unique(ranks).tolist():
            extra = indices[bounds[r] : bounds[r + 1]]
            writes[r] = np.sort(np.concatenate([writes[r], extra])) if len(writes[r]) else extra
        return writes, self.load.tolist()


def _distinct(ranks: np.ndarray) -> bool:
    return bool((ranks[1:] > ranks[:-1]).all())


__all__ = ["CHUNK", "Assignments"]
