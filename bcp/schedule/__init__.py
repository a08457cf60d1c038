"""When to save: the per-step decisions of ``CheckpointManager.step`` (preemption
notices, and the interval). Its modules, one line each: docs/architecture.md."""
