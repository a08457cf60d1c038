"""bcp inside training frameworks: each module plugs bcp into one framework's own
checkpointing, and imports that framework, so none is imported by ``import bcp`` or
by this package (import the module you use; a missing framework names its extra).

* :mod:`bcp.integrations.lightning`: ``Trainer(plugins=[BcpCheckpointIO()])``; under
  FSDP and tensor parallelism ``Trainer(strategy=BcpModelParallelStrategy(...))``.
* :mod:`bcp.integrations.accelerate`: ``enable(accelerator, uri)`` sends
  ``Accelerator.save_state`` / ``load_state`` through bcp.
* :mod:`bcp.integrations.transformers`: ``BcpCheckpointCallback(uri)`` keeps the
  Trainer's checkpoints in a bcp store; ``restore_checkpoint`` brings one back.
* :mod:`bcp.integrations.dcp`: ``BcpStorageWriter`` / ``BcpStorageReader`` put DCP
  checkpoints on any bcp backend.

docs/integrations.md says what each saves, and how it differs from the framework's own.
"""
