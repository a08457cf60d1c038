"""Multi-process jobs for tests/test_tiers_save.py: simulated hosts, each a group of
gloo processes with its own ``BCP_HOST_ID`` and local directory.

Unlike dist_jobs.spawn, :func:`run` tolerates a rank killed on purpose (a fault
point, ``os._exit`` from inside bcp): it returns every process's exit code, and the
test checks what the surviving hosts' directories hold. Fault points are installed
by the job from its configuration (the ``faults`` entry, rank -> name), by wrapping
the seams bcp.tiers leaves for them (``replicate._write_chunk``, ``drain._upload_part``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import bcp
from dist_jobs import adopt, fork_context, free_port, parent_settings

#: the exit status of a rank killed by a fault point
KILLED = 17
#: the exit status of a rank that got an error because another was killed
SURVIVED = 3
#: the global tensors' shapes (independent of the world size, so any world size loads them)
W_SHAPE = (64, 256)


def expected(step: int) -> dict[str, Any]:
    """The whole state at ``step``, as one process would load it."""
    w = torch.arange(W_SHAPE[0] * W_SHAPE[1], dtype=torch.float32).reshape(W_SHAPE) + 1000 * step
    return {
        "w": w,
        "bias": torch.arange(5, dtype=torch.float64) + step,
        "emb": (torch.arange(24, dtype=torch.float32).reshape(6, 4) * step).to(torch.bfloat16),
        "step": step,
    }


def local_state(rank: int, world: int, step: int) -> dict[str, Any]:
    """This rank's part of :func:`expected`: rows of ``w`` sharded over the ranks, the rest replicated."""
    full = expected(step)
    rows = W_SHAPE[0] // world
    return {
        "w": bcp.TensorShard(full["w"][rank * rows : (rank + 1) * rows].clone(), W_SHAPE, (rank * rows, 0)),
        "bias": full["bias"],
        "emb": full["emb"],
        "step": step,
    }


def template() -> dict[str, Any]:
    """A one-process load target for :func:`expected`."""
    return {
        "w": torch.zeros(W_SHAPE),
        "bias": torch.zeros(5, dtype=torch.float64),
        "emb": torch.zeros(6, 4, dtype=torch.bfloat16),
        "step": -1,
    }


# -- fault points -------------------------------------------------------------------------


def _install_fault(name: str) -> None:
    from bcp.tiers import drain, replicate

    if name == "corrupt-replica":  # every received chunk gets its first byte flipped
        real_write = replicate._write_chunk

        def corrupt(writer, offset, data):
            changed = bytearray(data)
            changed[0] ^= 0xFF
            real_write(writer, offset, memoryview(changed))

        replicate._write_chunk = corrupt
    elif name == "kill-replication":  # dies once the first received chunk is written
        real_write = replicate._write_chunk

        def die_after_first(writer, offset, data):
            real_write(writer, offset, data)
            os._exit(KILLED)

        replicate._write_chunk = die_after_first
    elif name == "kill-drain":  # dies instead of uploading its data file

        def die(_writer, _offset, _data):
            os._exit(KILLED)

        drain._upload_part = die
    else:
        raise ValueError(f"unknown fault {name!r}")


class _FakeStatvfs:
    """statvfs of a file system with ``free`` bytes free of ``total``."""

    def __init__(self, free: int, total: int) -> None:
        self.free, self.total = free, total

    def __call__(self, _path: str) -> SimpleNamespace:
        return SimpleNamespace(f_frsize=4096, f_bavail=self.free // 4096, f_blocks=self.total // 4096)


# -- the job ------------------------------------------------------------------------------


def tier_job(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Save cfg["steps"] through a CheckpointManager with a local tier; each host
    (``ranks_per_host`` consecutive ranks) has its own BCP_HOST_ID and directory."""
    host = rank // cfg["ranks_per_host"]
    os.environ["BCP_HOST_ID"] = f"host{host}"
    tier = bcp.LocalTier(
        dir=os.path.join(cfg["base"], f"host{host}"),
        every=cfg.get("every", 1),
        replicas=cfg.get("replicas", 1),
        persist_every=cfg.get("persist_every", 2),
        keep=cfg.get("keep", 2),
        chunk_bytes=cfg.get("chunk_bytes", 4096),
    )
    manager = bcp.CheckpointManager(cfg["root"], tier=tier)
    fault = cfg.get("faults", {}).get(str(rank))
    if fault is not None:
        _install_fault(fault)
    if str(host) in cfg.get("no_room", {}):
        manager._tier.statvfs = _FakeStatvfs(free=cfg["no_room"][str(host)], total=1 << 30)
    persisted_after: dict[str, list[int]] = {}
    for step in cfg["steps"]:
        manager.save(step, local_state(rank, world, step))
        if cfg.get("wait_each"):
            manager.wait()
            persisted_after[str(step)] = manager.steps()
    manager.close()
    if cfg.get("load_back"):  # every drained step, at the world size that saved it
        for step in manager.steps():
            want = local_state(rank, world, step)
            got = bcp.load(local_state(rank, world, 0), manager.uri(step))
            assert torch.equal(got["w"].local, want["w"].local), f"rank {rank}: step {step} differs"
            assert torch.equal(got["bias"], want["bias"]) and torch.equal(got["emb"], want["emb"])
            assert got["step"] == step
    if rank == 0 and persisted_after:
        with open(os.path.join(cfg["base"], "persisted_after.json"), "w") as f:
            json.dump(persisted_after, f)


# -- running ranks ------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, cfg: dict[str, Any], settings) -> None:
    adopt(settings)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["BCP_COLLECTIVE_TIMEOUT"] = str(cfg.get("timeout", 60))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    import faulthandler

    faulthandler.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    killing = any(f.startswith("kill") for f in cfg.get("faults", {}).values())
    status = 0
    try:
        tier_job(rank, world, cfg)
    except BaseException as e:  # noqa: BLE001 - a survivor of a killed rank fails as expected; reported by status
        if not killing:
            traceback.print_exc()
            status = 1
        else:
            print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
            status = SURVIVED
    sys.stdout.flush()
    sys.stderr.flush()
    if not killing and status == 0:
        dist.barrier()  # no rank tears down gloo while another still talks to it
        dist.destroy_process_group()
    os._exit(status)  # no gloo teardown with a dead peer


def run(world: int, cfg: dict[str, Any], timeout: float = 90) -> list[int | None]:
    """Start ``world`` ranks of :func:`tier_job`; every process's exit status (None: killed at the timeout)."""
    ctx = fork_context()  # ranks fork from a server that imported torch and bcp once
    port, settings = free_port(), parent_settings()
    procs = [ctx.Process(target=_entry, args=(r, world, port, cfg, settings)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes
