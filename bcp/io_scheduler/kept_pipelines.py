"""A save's write pipeline (``bcp.io_scheduler.write_pipeline``) with its plan (file
layout, chunks, copies) kept per prepared structure and the settings the plan depends
on, so a save of the same structure plans nothing again."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import numpy as np

from bcp.backends import Backend
from bcp.io_scheduler.chunk_plan import PipelinePlan
from bcp.io_scheduler.staging import StagingPool, default_pool
from bcp.io_scheduler.write_pipeline import WriteItem, WritePipeline

#: Pipeline plans kept per prepared structure (this rank's writes x backend and pool settings).
KEEP_PIPELINE_PLANS = 4


def make_pipeline(
    backend: Backend,
    data_key: str,
    rank: int,
    items: Sequence[WriteItem],
    block: int,
    *,
    pool: StagingPool | None = None,
    streams: int | None = None,
    stage_all: bool = False,
    deferred: bool = False,
    plans: MutableMapping[Any, PipelinePlan] | None = None,
    writes: np.ndarray | None = None,
) -> WritePipeline:
    """A pipeline on ``pool`` (default: the process-wide one) with ``streams`` writers
    (default: the backend's hint). ``plans``: pipeline plans kept for the structure of
    ``items`` (``bcp.kept_plans``), by ``writes`` (the indices ``items`` were taken
    from) and the settings the plan depends on; used when there, else kept there."""
    pool = pool or default_pool()
    if pool.slab_bytes % block:
        raise ValueError(f"staging slab size {pool.slab_bytes} must be a multiple of the checksum block {block}")
    key = None
    if plans is not None and writes is not None:
        hints = backend.hints
        key = (np.asarray(writes).tobytes(), stage_all, hints.aligned_writes, hints.part_size, block, pool.slab_bytes)
    plan = plans.get(key) if plans is not None and key is not None else None
    pipeline = WritePipeline(
        backend,
        data_key,
        rank,
        items,
        block=block,
        pool=pool,
        streams=streams or backend.hints.concurrency,
        stage_all=stage_all,
        deferred=deferred,
        plan=plan,
    )
    if plans is not None and key is not None and plan is None:
        plans[key] = pipeline.plan
        while len(plans) > KEEP_PIPELINE_PLANS:
            del plans[next(iter(plans))]
    return pipeline
