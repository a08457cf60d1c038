"""Save planning: what each rank writes.

Each rank sends the coordinator its layout (the tensors and the boxes it holds); the
coordinator's plan says which rank writes which box, replicas stored once and
balanced over their holders, and is kept for the next save of an unchanged layout.
Pure: no process group, no I/O. Box geometry (overlap, tiling) is
:mod:`bcp.metadata.geometry`, shared with the read planner and the catalog. Its
modules, one line each: docs/architecture.md.
"""

from bcp.planning.local_layout import LayoutMeta, LocalLayout, TensorPlan
from bcp.planning.plan import GlobalPlan, plan_save

__all__ = ["GlobalPlan", "LayoutMeta", "LocalLayout", "TensorPlan", "plan_save"]
