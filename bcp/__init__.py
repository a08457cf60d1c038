"""bcp: parallelism-independent, storage-agnostic checkpoints for PyTorch training.

Usage:

    import bcp
    info = bcp.save({"model": model.state_dict(), "step": 100}, "/ckpt/step100")
    bcp.load(state, "/ckpt/step100")          # fills tensors in place
    reader = bcp.open("/ckpt/step100")        # no template needed
    bcp.delete("/ckpt/step100")               # its objects only; refuses what is not a checkpoint
"""

from bcp import backends, dataloader, metadata
from bcp._version import __version__
from bcp.async_save import AsyncSaveHandle, async_save, reserve_staging
from bcp.coordination.lanes import LOCAL
from bcp.deletion import delete, exists
from bcp.errors import (
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
from bcp.loader import LoadInfo, load, load_with_info
from bcp.manager import CheckpointManager
from bcp.metrics import LoggingMetrics, MetricsRecord, TensorBoardMetrics
from bcp.options import LoadOptions, SaveOptions
from bcp.reader import CheckpointReader, TensorMeta
from bcp.reader import open_checkpoint as open  # noqa: A004 - the public name is bcp.open
from bcp.saver import SaveInfo, save
from bcp.schedule.interval import IntervalPolicy, IntervalReport
from bcp.schedule.preemption import Preemption
from bcp.shards import FlatShard, LowestRankCopy, PerRank, RankValues, TensorShard
from bcp.tiers import LocalTier
from bcp.training import TrainingState, reshard_per_rank

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
    "IntervalPolicy",
    "IntervalReport",
    "LoadInfo",
    "LoadOptions",
    "LocalTier",
    "LoggingMetrics",
    "LowestRankCopy",
    "MetricsRecord",
    "PerRank",
    "PickleNotAllowedError",
    "Preemption",
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
