"""bcp: parallelism-independent, storage-agnostic checkpoints for PyTorch training.

Usage:

    import bcp
    info = bcp.save({"model": model.state_dict(), "step": 100}, "/ckpt/step100")
    bcp.load(state, "/ckpt/step100")          # fills tensors in place
    reader = bcp.open("/ckpt/step100")        # no template needed
    bcp.delete("/ckpt/step100")               # its objects only; refuses what is not a checkpoint
"""

from . import backends, dataloader, metadata
from ._version import __version__
from .async_save import AsyncSaveHandle, async_save, reserve_staging
from .deletion import delete, exists
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    IncompleteCheckpointError,
    PickleNotAllowedError,
    RankFailedError,
    RanksMissingError,
    ReplicaMismatchError,
    ShardingError,
    StateMismatchError,
    StorageError,
    UnsupportedStateError,
)
from .lanes import LOCAL
from .loader import LoadInfo, load, load_with_info
from .manager import CheckpointManager
from .metrics import LoggingMetrics, MetricsRecord, TensorBoardMetrics
from .options import LoadOptions, SaveOptions
from .reader import CheckpointReader, TensorMeta
from .reader import open_checkpoint as open  # noqa: A004 - the public name is bcp.open
from .saver import SaveInfo, save
from .shards import FlatShard, PerRank, RankValues, TensorShard
from .tiers import LocalTier
from .training import TrainingState, reshard_per_rank

__all__ = [
    "LOCAL",
    "AsyncSaveHandle",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CorruptCheckpointError",
    "FlatShard",
    "FormatError",
    "IncompleteCheckpointError",
    "LoadInfo",
    "LoadOptions",
    "LocalTier",
    "LoggingMetrics",
    "MetricsRecord",
    "PerRank",
    "PickleNotAllowedError",
    "RankFailedError",
    "RankValues",
    "RanksMissingError",
    "ReplicaMismatchError",
    "SaveInfo",
    "SaveOptions",
    "ShardingError",
    "StateMismatchError",
    "StorageError",
    "TensorBoardMetrics",
    "TensorMeta",
    "TensorShard",
    "TrainingState",
    "UnsupportedStateError",
    "__version__",
    "async_save",
    "backends",
    "dataloader",
    "delete",
    "exists",
    "load",
    "load_with_info",
    "metadata",
    "open",
    "reserve_staging",
    "reshard_per_rank",
    "save",
]
