"""Multi-process jobs for tests/test_collective_order.py: sync and async saves, loads,
CheckpointManagers and TrainingStates mixed on the same ranks. Every job runs with a
jitter before each of bcp's collectives (longer on the async-save thread), so that the
background commits really overlap the caller's operations, and with a short
BCP_COLLECTIVE_TIMEOUT set by the test, so that interleaved collectives fail the test
instead of hanging it. Started with dist_jobs.spawn; every job asserts in the workers."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import bcp
import bcp.coordination.collectives

ROWS = 1 << 14  # 256 KiB of float32 per rank and tensor


def jitter(rank: int, seed: int = 0) -> None:
    """Sleep a random 0-3 ms (caller) or 0-15 ms (bcp-async-save thread) before each of
    bcp's collectives, different on each rank: the order in which two threads reach a
    group then differs between ranks, as it does between hosts."""
    rngs: dict[int, random.Random] = {}
    lock = threading.Lock()

    def pause() -> None:
        ident = threading.get_ident()
        with lock:
            rng = rngs.setdefault(ident, random.Random(hash((seed, rank, len(rngs)))))
            background = threading.current_thread().name == "bcp-async-save"
            delay = rng.uniform(0, 0.015 if background else 0.003)
        time.sleep(delay)

    for cls in (
        bcp.coordination.collectives.GroupCoordinator,
        getattr(bcp.coordination.collectives, "OwnGroupCoordinator", None),
    ):
        if cls is None:  # (a bcp without groups of its own)
            continue
        for name in ("all_gather", "gather", "broadcast", "any_failed", "scatter"):
            real = getattr(cls, name)

            def wrapped(self, *args, _real=real, **kwargs):
                pause()
                return _real(self, *args, **kwargs)

            setattr(cls, name, wrapped)


def state(rank: int, world: int, tag: int, rows: int = ROWS) -> dict[str, Any]:
    """A rank's part of checkpoint ``tag``: a row-sharded tensor, a replicated one, a
    per-rank object and a job-wide one, all derived from ``tag``."""
    local = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000.0 * tag + rank
    return {
        "w": bcp.TensorShard(local, (rows * world, 4), (rows * rank, 0)),
        "bias": torch.full((7,), float(tag)),
        "who": bcp.PerRank(f"rank {rank} tag {tag}"),
        "tag": tag,
    }


def template(rank: int, world: int, rows: int = ROWS) -> dict[str, Any]:
    got = state(rank, world, -1, rows)
    got["w"].local.zero_()
    got["who"], got["tag"] = None, None
    return got


def check(uri: str, rank: int, world: int, tag: int, rows: int = ROWS) -> None:
    """(collective) ``uri`` holds checkpoint ``tag`` exactly."""
    want = state(rank, world, tag, rows)
    got = bcp.load(template(rank, world, rows), uri)
    assert torch.equal(got["w"].local, want["w"].local), f"rank {rank}: w differs in {uri} (tag {tag})"
    assert torch.equal(got["bias"], want["bias"]), f"rank {rank}: bias differs in {uri}"
    assert got["who"] == f"rank {rank} tag {tag}" and got["tag"] == tag, f"rank {rank}: objects differ in {uri}"


def _training(tag: int) -> bcp.TrainingState:
    torch.manual_seed(tag)
    model = torch.nn.Linear(5, 3)
    return bcp.TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), extra={"tag": tag}, rng=False)


def check_training(uri: str, tag: int) -> None:
    """(collective) ``uri`` holds TrainingState ``tag`` exactly."""
    want = _training(tag)
    got = _training(tag + 1000)
    got.load(uri)
    for (name, a), b in zip(want.model.state_dict().items(), got.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs in {uri}"
    assert got.extra["tag"] == tag


# -- named interleavings ---------------------------------------------------------------------------


def async_then_sync_job(rank: int, world: int, root: str) -> None:
    """The deadlock of the issue: async_save of a large state, then a sync save of a
    small one before wait(); both commit, then a second round the other way."""
    jitter(rank)
    big = state(rank, world, 1, rows=ROWS * 8)
    handle = bcp.async_save(big, f"{root}/a")
    bcp.save(state(rank, world, 2), f"{root}/b")
    handle.wait()
    second = bcp.async_save(state(rank, world, 3), f"{root}/c")
    third = bcp.async_save(state(rank, world, 4), f"{root}/d")
    bcp.save(state(rank, world, 5), f"{root}/e")
    third.wait()
    second.wait()
    check(f"{root}/a", rank, world, 1, rows=ROWS * 8)
    for name, tag in (("b", 2), ("c", 3), ("d", 4), ("e", 5)):
        check(f"{root}/{name}", rank, world, tag)


def async_then_load_job(rank: int, world: int, root: str) -> None:
    """Loads (with and without shared reads) while an async save commits."""
    jitter(rank)
    bcp.save(state(rank, world, 1), f"{root}/a")
    handle = bcp.async_save(state(rank, world, 2, rows=ROWS * 8), f"{root}/b")
    check(f"{root}/a", rank, world, 1)
    want = state(rank, world, 1)
    got = bcp.load(template(rank, world), f"{root}/a", share_reads=True)
    assert torch.equal(got["w"].local, want["w"].local), f"rank {rank}: shared read differs"
    handle.wait()
    check(f"{root}/b", rank, world, 2, rows=ROWS * 8)


def manager_and_save_job(rank: int, world: int, root: str) -> None:
    """An async CheckpointManager's pending save, committed before its next one,
    while bcp.save and bcp.load run in between; close() commits the last."""
    jitter(rank)
    manager = bcp.CheckpointManager(f"{root}/run", keep_last=2)
    manager.save(1, state(rank, world, 1))
    bcp.save(state(rank, world, 50), f"{root}/plain")
    manager.save(2, state(rank, world, 2))
    check(f"{root}/plain", rank, world, 50)
    manager.save(3, state(rank, world, 3))
    manager.close()
    assert manager.steps() == [2, 3], f"rank {rank}: steps {manager.steps()}"
    step, _ = manager.load_latest(template(rank, world))
    assert step == 3
    for step in (2, 3):
        check(manager.uri(step), rank, world, step)


def two_managers_job(rank: int, world: int, root: str) -> None:
    """Two async managers saving alternately, each load_latest in between."""
    jitter(rank)
    first = bcp.CheckpointManager(f"{root}/first")
    second = bcp.CheckpointManager(f"{root}/second")
    for step in (1, 2, 3):
        first.save(step, state(rank, world, 10 + step))
        second.save(step, state(rank, world, 20 + step))
        if step == 2:
            got, _ = first.load_latest(template(rank, world))
            assert got == 2
    second.wait()
    got, _ = second.load_latest(template(rank, world))
    assert got == 3
    first.close()
    second.close()
    for step in (1, 2, 3):
        check(first.uri(step), rank, world, 10 + step)
        check(second.uri(step), rank, world, 20 + step)


# -- random interleavings ---------------------------------------------------------------------------

#: the operations of a random sequence
OPERATIONS = ("async_save", "save", "load", "wait", "manager_save", "manager_load", "training_save")


def random_sequence(seed: int, length: int) -> list[str]:
    """The same sequence of operations on every rank (a seeded generator)."""
    rng = random.Random(seed)
    return [rng.choice(OPERATIONS) for _ in range(length)]


def random_interleavings_job(rank: int, world: int, root: str, seeds: list[int], length: int) -> None:
    """For each seed: ``length`` operations drawn from OPERATIONS (same on every rank),
    async saves left in flight across the others; then every checkpoint committed
    along the way loads exactly. Writes the sequences run to ``root``/sequences.txt
    (rank 0) for the report."""
    jitter(rank, seed=seeds[0])
    log: list[str] = []
    for seed in seeds:
        base = f"{root}/seed{seed}"
        ops = random_sequence(seed, length)
        log.append(f"seed {seed}: {' '.join(ops)}")
        rng = random.Random(seed + 1)  # same choices on every rank
        managers = [bcp.CheckpointManager(f"{base}/m{i}", keep_last=2) for i in range(2)]
        manager_steps: list[list[int]] = [[], []]
        pending: list[tuple[Any, str, int]] = []
        committed: dict[str, int] = {}
        trained: dict[str, int] = {}
        for i, op in enumerate(ops):
            tag = 100 * seed + i
            uri = f"{base}/op{i}"
            if op == "async_save":
                pending.append((bcp.async_save(state(rank, world, tag), uri), uri, tag))
            elif op == "save":
                bcp.save(state(rank, world, tag), uri)
                committed[uri] = tag
            elif op == "load" and committed:
                done = sorted(committed)
                pick = done[rng.randrange(len(done))]
                check(pick, rank, world, committed[pick])
            elif op == "wait" and pending:
                handle, done_uri, done_tag = pending.pop(rng.randrange(len(pending)))
                handle.wait()
                committed[done_uri] = done_tag
            elif op == "manager_save":
                which = rng.randrange(2)
                managers[which].save(tag, state(rank, world, tag))
                manager_steps[which].append(tag)
            elif op == "manager_load":
                which = rng.randrange(2)
                step, _ = managers[which].load_latest(template(rank, world))
                expected = manager_steps[which][-1] if manager_steps[which] else None
                assert step == expected, f"rank {rank}, seed {seed}, op {i}: latest {step}, expected {expected}"
                if step is not None:
                    check(managers[which].uri(step), rank, world, step)
            elif op == "training_save":
                _training(tag).save(uri)
                trained[uri] = tag
        for handle, done_uri, done_tag in pending:
            handle.wait()
            committed[done_uri] = done_tag
        for which, manager in enumerate(managers):
            manager.close()
            assert manager.steps() == manager_steps[which][-2:], f"rank {rank}, seed {seed}: {manager.steps()}"
            for step in manager.steps():
                check(manager.uri(step), rank, world, step)
        for done_uri, done_tag in sorted(committed.items()):
            check(done_uri, rank, world, done_tag)
        for done_uri, done_tag in sorted(trained.items()):
            check_training(done_uri, done_tag)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "sequences.txt"), "w") as f:
            f.write("\n".join(log) + "\n")
