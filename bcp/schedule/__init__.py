"""When to save: the per-step decisions of ``CheckpointManager.step`` (preemption
notices, and the interval that wastes the least). Its modules, one line each:
docs/architecture.md."""
