"""Zero-redundant load: a stored fragment that several ranks need is read from
storage once, by one of them, and sent to the others over the process group.

Every rank gathers every rank's requested boxes and computes the same plan: for
each stored fragment (one replica per box) the ranks whose boxes overlap it; where
that is more than one rank, the one with the fewest bytes to fetch so far reads the
whole fragment (verifying every checksum block) and sends it point-to-point. The
receivers then copy their parts from memory. Costs memory for the shared fragments
in flight; saves storage bandwidth and request count, which is what object stores
charge for.
"""

from __future__ import annotations

import math

import torch

from bcp.metadata import itemsize

from ..boxes import Box, intersect
from ..collectives import GroupCoordinator
from ..reader import CheckpointReader
from .read_exec import ReadStats
from .read_plan import choose_replicas

SharedKey = tuple[str, Box]


def plan_sharing(
    reader: CheckpointReader, wanted_by_rank: list[list[tuple[str, Box]]]
) -> dict[SharedKey, tuple[int, list[int]]]:
    """(fqn, stored box) -> (owner rank, receiving ranks) for fragments some of whose
    bytes several ranks want. Fragments that ranks split between them (a reshard
    cutting a fragment into disjoint parts) are not shared: nothing would be saved."""
    needers: dict[SharedKey, list[int]] = {}
    wanted_elems: dict[SharedKey, int] = {}
    for rank, wanted in enumerate(wanted_by_rank):
        for fqn, (b_off, b_len) in wanted:
            for frag in choose_replicas(reader.catalog.tensors[fqn]):
                key = (fqn, (frag.offsets, frag.lengths))
                region = intersect(b_off, b_len, frag.offsets, frag.lengths)
                if region is not None and math.prod(frag.lengths) != 0:
                    wanted_elems[key] = wanted_elems.get(key, 0) + math.prod(region[1])
                    ranks = needers.setdefault(key, [])
                    if not ranks or ranks[-1] != rank:
                        ranks.append(rank)
    redundant = [k for k, ranks in needers.items() if len(ranks) > 1 and wanted_elems[k] > math.prod(k[1][1])]
    load = [0] * len(wanted_by_rank)
    plan: dict[SharedKey, tuple[int, list[int]]] = {}
    for key in sorted(redundant):
        ranks = needers[key]
        owner = min(ranks, key=lambda r: (load[r], r))
        entry = reader.catalog.tensors[key[0]]
        load[owner] += math.prod(key[1][1]) * itemsize(entry.dtype)
        plan[key] = (owner, [r for r in ranks if r != owner])
    return plan


def fetch_shared(
    reader: CheckpointReader, coord: GroupCoordinator, wanted: list[tuple[str, Box]]
) -> tuple[dict[SharedKey, torch.Tensor], ReadStats]:
    """(all ranks) Read the shared fragments this rank owns, exchange them, and return
    every shared fragment this rank needs, as tensors shaped like their boxes."""
    dist = coord.dist
    plan = plan_sharing(reader, coord.all_gather(wanted))
    stats = ReadStats()
    held: dict[SharedKey, torch.Tensor] = {}
    owned = [(k, receivers) for k, (owner, receivers) in plan.items() if owner == coord.rank]
    for key, _receivers in owned:
        fqn, box = key
        held[key] = reader.empty(fqn, box)  # after checking the files holding it
        stats.add(reader.fill([(fqn, box, held[key])]))
    works = []
    ranks = dist.get_process_group_ranks(coord.group)
    for tag, (key, (owner, receivers)) in enumerate(sorted(plan.items())):
        if owner == coord.rank:
            wire = held[key].reshape(-1).view(torch.uint8) if held[key].numel() else None
            if wire is not None:
                works += [dist.isend(wire, dst=ranks[r], group=coord.group, tag=tag) for r in receivers]
        elif coord.rank in receivers:
            fqn, box = key
            held[key] = reader.empty(fqn, box)  # bounded like the owner's: by the bytes stored
            if held[key].numel():
                works.append(
                    dist.irecv(held[key].reshape(-1).view(torch.uint8), src=ranks[owner], group=coord.group, tag=tag)
                )
    for work in works:
        work.wait()
    return held, stats
