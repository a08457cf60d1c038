"""Save planning: what each rank writes.

* :mod:`.layout`: what a rank sends (:class:`LocalLayout`, :class:`LayoutMeta`,
  :class:`TensorPlan`);
* :mod:`.plan`: the coordinator's plan (:func:`plan_save`, :class:`GlobalPlan`),
  from :mod:`.table` (the job's tensors, layouts checked), :mod:`.matrix` (the FSDP
  fast path), :mod:`.general` (any layout) and :mod:`.balance` (LPT over replicas);
* :mod:`.cache`: plans kept between saves of an unchanged layout;
* :mod:`.writer_rows`: every writer's fragment rows, merged at commit.

Box geometry (overlap, tiling) is :mod:`bcp.metadata.geometry`, shared with the
read planner and the catalog.
"""

from bcp.planning.local_layout import LayoutMeta, LocalLayout, TensorPlan
from bcp.planning.plan import GlobalPlan, plan_save

__all__ = ["GlobalPlan", "LayoutMeta", "LocalLayout", "TensorPlan", "plan_save"]
