"""Multi-process jobs for tests/test_tiers_save.py: simulated hosts, each a group of
gloo processes with its own ``BCP_HOST_ID`` and local directory.

Unlike dist_jobs.spawn, :func:`run` tolerates a rank killed on purpose (a fault
point, ``os._exit`` from inside bcp, or a SIGKILL sent by :func:`run` itself after a
delay: its ``kill`` argument): it returns every process's exit code, and the test
checks what the surviving hosts' directories hold. Fault points are installed by the
job from its configuration (the ``faults`` entry, rank -> name), by wrapping the
seams bcp.tiers leaves for them (``replicate._write_chunk``, ``drain._upload_part``).

A job may also start by recovering (``recover``: ``load_latest`` through the tier,
the step and the run it matched written to ``recovered-rank<r>.json``) and save the
steps after the one it recovered; values carry a ``run`` number, so a step saved
again by a later job differs from the earlier save of the same step number. With
``metrics``, each rank writes the manager's metrics records (``metrics-rank<r>.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
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


def expected(step: int, run: int = 0) -> dict[str, Any]:
    """The whole state at ``step`` as saved by the job numbered ``run``, as one process would load it."""
    w = torch.arange(W_SHAPE[0] * W_SHAPE[1], dtype=torch.float32).reshape(W_SHAPE) + 1000 * step + 100000 * run
    return {
        "w": w,
        "bias": torch.arange(5, dtype=torch.float64) + step + 0.25 * run,
        "emb": (torch.arange(24, dtype=torch.float32).reshape(6, 4) * step + run).to(torch.bfloat16),
        "step": step,
    }


def local_state(rank: int, world: int, step: int, run: int = 0) -> dict[str, Any]:
    """This rank's part of :func:`expected`: rows of ``w`` sharded over the ranks, the rest replicated."""
    full = expected(step, run)
    rows = W_SHAPE[0] // world
    return {
        "w": bcp.TensorShard(full["w"][rank * rows : (rank + 1) * rows].clone(), W_SHAPE, (rank * rows, 0)),
        "bias": full["bias"],
        "emb": full["emb"],
        "step": step,
    }


#: (``frozen`` jobs) a row-sharded tensor that never changes, and a replicated one changed at step 1 only
FROZEN_SHAPE = (64, 512)


def frozen_state(rank: int, world: int, step: int, run: int = 0) -> dict[str, Any]:
    """This rank's part of the unchanging tensors of a ``frozen`` job (an incremental local tier reuses them)."""
    full = torch.arange(FROZEN_SHAPE[0] * FROZEN_SHAPE[1], dtype=torch.float32).reshape(FROZEN_SHAPE) + 7 * run
    rows = FROZEN_SHAPE[0] // world
    return {
        "frozen": bcp.TensorShard(full[rank * rows : (rank + 1) * rows].clone(), FROZEN_SHAPE, (rank * rows, 0)),
        "slow": torch.full((8, 64), float(min(step, 1) + 10 * run)),
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
    elif name == "kill-drain-commit":  # dies once the uploads are agreed, as the coordinator commits
        real_decide = drain.decide

        def die_at_commit(coord, phase, *args, **kwargs):
            if phase == "draining: committing":
                os._exit(KILLED)
            return real_decide(coord, phase, *args, **kwargs)

        drain.decide = die_at_commit
    else:
        raise ValueError(f"unknown fault {name!r}")


class _FakeStatvfs:
    """statvfs of a file system with ``free`` bytes free of ``total``."""

    def __init__(self, free: int, total: int) -> None:
        self.free, self.total = free, total

    def __call__(self, _path: str) -> SimpleNamespace:
        return SimpleNamespace(f_frsize=4096, f_bavail=self.free // 4096, f_blocks=self.total // 4096)


# -- the job ------------------------------------------------------------------------------


def host_of(rank: int, cfg: dict[str, Any]) -> str:
    """The simulated host of ``rank``: ``host_of_rank`` when given, else ``ranks_per_host`` consecutive ranks."""
    if "host_of_rank" in cfg:
        return cfg["host_of_rank"][rank]
    return f"host{rank // cfg['ranks_per_host']}"


def matched_run(got: dict[str, Any], rank: int, world: int, step: int, runs: list[int]) -> int | None:
    """The run whose save of ``step`` this rank's loaded state equals bit for bit (None: none of them)."""
    for run in runs:
        want = local_state(rank, world, step, run)
        if (
            got["step"] == step
            and torch.equal(got["w"].local, want["w"].local)
            and torch.equal(got["bias"], want["bias"])
            and torch.equal(got["emb"], want["emb"])
            and _same_frozen(got, rank, world, step, run)
        ):
            return run
    return None


def _same_frozen(got: dict[str, Any], rank: int, world: int, step: int, run: int) -> bool:
    if "frozen" not in got:
        return True
    want = frozen_state(rank, world, step, run)
    return torch.equal(got["frozen"].local, want["frozen"].local) and torch.equal(got["slow"], want["slow"])


def _state(cfg: dict[str, Any], rank: int, world: int, step: int, run: int = 0) -> dict[str, Any]:
    state = local_state(rank, world, step, run)
    if cfg.get("frozen"):
        state.update(frozen_state(rank, world, step, run))
    return state


def _count_uploads(cfg: dict[str, Any], rank: int) -> None:
    """Each byte a drain uploads is counted in ``uploads-rank<r>`` (one line per part)."""
    from bcp.tiers import drain

    real = drain._upload_part
    path = os.path.join(cfg["base"], f"uploads-rank{rank}")

    def counted(writer, offset, data):
        real(writer, offset, data)
        with open(path, "a") as f:
            f.write(f"{len(data)}\n")

    drain._upload_part = counted


def _progress(cfg: dict[str, Any], line: str) -> None:
    """Append one line to the job's progress file (rank 0): what is known done, for a test that kills the job."""
    fd = os.open(os.path.join(cfg["base"], "progress"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def tier_job(rank: int, world: int, cfg: dict[str, Any], started: Any = None) -> None:
    """Save cfg["steps"] through a CheckpointManager with a local tier; each host
    (``ranks_per_host`` consecutive ranks, or ``host_of_rank``) has its own
    BCP_HOST_ID and directory. With ``recover``, first load the newest step and save
    ``then_save`` steps after it instead. ``started`` (an event) is set as the save of
    step ``start_at`` (default: the first) begins."""
    host = host_of(rank, cfg)
    os.environ["BCP_HOST_ID"] = host
    tier = bcp.LocalTier(
        dir=os.path.join(cfg["base"], host),
        every=cfg.get("every", 1),
        replicas=cfg.get("replicas", 1),
        persist_every=cfg.get("persist_every", 2),
        keep=cfg.get("keep", 2),
        chunk_bytes=cfg.get("chunk_bytes", 4096),
        incremental=cfg.get("incremental", False),
        keep_free=0.0,  # the test machine's disk may be nearly full: room is decided by _FakeStatvfs alone
    )
    if cfg.get("count_uploads"):
        _count_uploads(cfg, rank)
    records: list[bcp.MetricsRecord] = []
    manager = bcp.CheckpointManager(cfg["root"], tier=tier, metrics=records.append if cfg.get("metrics") else None)
    fault = cfg.get("faults", {}).get(str(rank))
    if fault is not None:
        _install_fault(fault)
    no_room = cfg.get("no_room", {}).get(host.removeprefix("host"))
    if no_room is not None and "no_room_from" not in cfg:
        manager._tier.statvfs = _FakeStatvfs(free=no_room, total=1 << 30)
    steps = cfg.get("steps", [])
    run = cfg.get("run", 0)
    if cfg.get("recover"):
        step, got = manager.load_latest(_state(cfg, rank, world, 0, -1))
        found = None if step is None else matched_run(got, rank, world, step, cfg.get("runs", [run]))
        with open(os.path.join(cfg["base"], f"recovered-rank{rank}.json"), "w") as f:
            json.dump({"step": step, "run": found}, f)
        first = 1 if step is None else step + 1
        steps = list(range(first, first + cfg.get("then_save", 0)))
    persisted_after: dict[str, list[int]] = {}
    fast: dict[str, bool] = {}  # whether each save took the local tier's fast path (bcp.tiers.fast_save)
    previous = None
    for step in steps:
        if started is not None and rank == 0 and step == cfg.get("start_at", steps[0]):
            started.set()
        if no_room is not None and cfg.get("no_room_from") == step:
            manager.wait()  # the save before reads the free space in its own thread
            manager._tier.statvfs = _FakeStatvfs(free=no_room, total=1 << 30)
        state = _state(cfg, rank, world, step, run)
        if step >= cfg.get("grow_at", step + 1):  # the state's layout changes: one tensor more
            state["extra"] = torch.full((3,), float(step))
        manager.save(step, state)
        fast[str(step)] = manager._tier.last_fast
        if rank == 0 and previous is not None:  # save() waited for the previous local save, replication included
            _progress(cfg, f"local {previous}")
        previous = step
        if cfg.get("wait_each"):
            manager.wait()
            persisted_after[str(step)] = manager.steps()
    manager.close()
    if rank == 0 and previous is not None:
        _progress(cfg, f"local {previous}")
    if cfg.get("load_back"):  # every drained step, at the world size that saved it
        for step in manager.steps():
            want = local_state(rank, world, step)
            got = bcp.load(_state(cfg, rank, world, 0, -1), manager.uri(step))
            assert torch.equal(got["w"].local, want["w"].local), f"rank {rank}: step {step} differs"
            assert torch.equal(got["bias"], want["bias"]) and torch.equal(got["emb"], want["emb"])
            assert got["step"] == step and _same_frozen(got, rank, world, step, 0), f"rank {rank}: step {step} differs"
    if cfg.get("metrics"):
        with open(os.path.join(cfg["base"], f"metrics-rank{rank}.json"), "w") as f:
            json.dump(
                [{f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | {"gbps": dict(r.gbps)} for r in records],
                f,
            )
    if rank == 0 and persisted_after:
        with open(os.path.join(cfg["base"], "persisted_after.json"), "w") as f:
            json.dump(persisted_after, f)
    if rank == 0:
        with open(os.path.join(cfg["base"], "fast.json"), "w") as f:
            json.dump(fast, f)


# -- running ranks ------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, cfg: dict[str, Any], started: Any, settings) -> None:
    adopt(settings)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["BCP_COLLECTIVE_TIMEOUT"] = str(cfg.get("timeout", 60))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    import faulthandler

    faulthandler.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    killing = cfg.get("killed", False) or any(f.startswith("kill") for f in cfg.get("faults", {}).values())
    status = 0
    try:
        tier_job(rank, world, cfg, started)
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


def run(world: int, cfg: dict[str, Any], timeout: float = 90, kill: dict[str, Any] | None = None) -> list[int | None]:
    """Start ``world`` ranks of :func:`tier_job`; every process's exit status (None: killed at the timeout).

    ``kill``: ``{"ranks": [...], "after": seconds, "grace": seconds}``: once rank 0
    is about to save step ``cfg["start_at"]`` (default: its first), wait ``after`` seconds, SIGKILL those ranks (a
    process, or a whole simulated host, dying at a random point of a save, its
    replication or its drain), then give the others ``grace`` seconds to end and
    SIGKILL the rest (as a launcher tears a job down): their status is -9."""
    ctx = fork_context()  # ranks fork from a server that imported torch and bcp once
    port, settings = free_port(), parent_settings()
    started = ctx.Event()
    if kill is not None:
        cfg = {**cfg, "killed": True}
    procs = [ctx.Process(target=_entry, args=(r, world, port, cfg, started, settings)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    if kill is not None:
        while not started.wait(0.05):  # rank 0 reaches its first save, or the job ended without one
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                break
        else:
            time.sleep(kill["after"])
        for r in kill["ranks"]:
            if procs[r].pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[r].pid, signal.SIGKILL)
        deadline = min(deadline, time.monotonic() + kill.get("grace", 1.0))
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None if kill is None else p.exitcode)
        else:
            codes.append(p.exitcode)
    return codes
