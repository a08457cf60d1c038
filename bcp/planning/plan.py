"""The coordinator's save plan (pure; no process group, no I/O).

Every rank sends a :class:`~.layout.LocalLayout`: its tensors' metadata (encoded
once, the same bytes on ranks holding the same tensors) and the boxes it holds as
flat integer arrays. The coordinator checks that ranks agree on each tensor, that the
distinct boxes tile the tensor exactly (no gap, no partial overlap), writes each
distinct box once, and spreads replicated boxes over their holders so bytes per rank
are balanced (largest box to the least-loaded holder).

Boxes stay in numpy arrays throughout (no per-box Python objects). FSDP layouts (one
box per tensor per rank) take a sort-free pass over the (rank x tensor) matrix
(:mod:`.matrix`), linear in the boxes; anything else sorts the boxes once
(:mod:`.general`, O(F log F)); :mod:`.balance` decides who writes replicated boxes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from bcp.planning.balance import Assignments
from bcp.planning.general import gather_all, plan_general
from bcp.planning.local_layout import LayoutMeta, LocalLayout
from bcp.planning.matrix import gather_matrix, plan_matrix
from bcp.planning.table import check_layouts, job_tensors, resolve_meta


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalPlan:
    """Each rank's writes and the bytes it carries (what the coordinator scatters and logs)."""

    #: rank -> indices into that rank's flat box list (LocalLayout.boxes()), ascending
    #: (int32, read-only: ranks' lists may be views of one shared array)
    writes: dict[int, np.ndarray]
    #: rank -> bytes it writes
    bytes_per_rank: dict[int, int]
    tensors: int
    total_bytes: int


def plan_save(
    layouts: Sequence[LocalLayout], *, meta: Mapping[bytes, bytes | LayoutMeta] | None = None, matrix: bool = True
) -> GlobalPlan:
    """Deduplicate, validate and balance (runs on the coordinator). ``layouts[i]`` is
    rank i's. ``meta`` maps meta digests to meta bytes (or decoded LayoutMeta) for
    layouts sent without their meta. ``matrix=False`` forces the general path (the
    tests compare the two).

    Columnar: boxes stay in numpy arrays. When every rank holds the same tensors, one
    box each and nothing is tied (FSDP), a sort-free pass over the (rank x tensor)
    matrix plans the tensors cut along one dimension in rank order; the rest (and
    every other layout) goes through the general path, which sorts boxes to find the
    distinct ones and their holders. LPT runs only over boxes with several holders.
    """
    world = len(layouts)
    metas = resolve_meta(layouts, meta)
    one_each = check_layouts(layouts, metas)
    table, local_gid = job_tensors(layouts, metas)
    acc = Assignments(world, table.lowest)
    m = metas[layouts[0].meta_digest] if world else None
    if matrix and m is not None and len(metas) == 1 and not table.has_alias and one_each:
        fallback = plan_matrix(layouts, m, table, acc)
        if len(fallback):
            plan_general(*gather_matrix(layouts, m, table, fallback), table, acc)
    else:
        plan_general(*gather_all(layouts, metas, local_gid, table), table, acc, everything=True)
    writes, load = acc.finish()
    return GlobalPlan(
        writes=writes, bytes_per_rank=dict(enumerate(load)), tensors=len(table.fqns), total_bytes=sum(load)
    )


__all__ = ["GlobalPlan", "plan_save"]
