"""One process per rank, waited for together within one deadline (for the bench/
scripts that run gloo jobs; bench/ is not a package).

Ranks start from a fork server that has imported torch and bcp once: each rank is a
fresh process (the script re-imported, nothing of the parent's state but what
``args_of`` gives it), without paying the seconds of a torch import per rank, which
the measured phases never included but every run (and its smoke test) waited for."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

#: Imported once by the fork server, with a script's own ``preload`` (a module that
#: fails to import is skipped).
PRELOAD = ("numpy", "torch", "torch.distributed", "bcp")


def start_fork_server(preload: tuple[str, ...] = ()) -> None:
    """Start the fork server now (with :data:`PRELOAD` and ``preload``) instead of at the
    first rank: a script that calls this before importing torch itself has both imports
    run side by side."""
    import multiprocessing.forkserver

    mp.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    multiprocessing.forkserver.ensure_running()


def run_ranks(
    target: Callable[..., None],
    args_of: Callable[[int], tuple[Any, ...]],
    world: int,
    timeout: float,
    what: str,
    preload: tuple[str, ...] = (),
) -> None:
    """Run ``target(*args_of(rank))`` in ``world`` processes started from the fork
    server (which imports :data:`PRELOAD` and ``preload`` when it starts: the first
    call of a process decides); kill those still running after ``timeout`` seconds;
    SystemExit naming ``what`` unless every one exits 0."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    procs = [ctx.Process(target=target, args=args_of(rank)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise SystemExit(f"{what} failed (exit codes {codes})")


def gloo_rank(rank: int, world: int, out: str, body: Callable[[], Any]) -> None:
    """(in a spawned rank; MASTER_ADDR/MASTER_PORT set) Join the gloo group, run
    ``body``, rank 0 writes its result as JSON to ``out``; exit 0, or 1 with the
    traceback printed (the parent's :func:`run_ranks` reports it)."""
    import json
    import os
    import sys
    import traceback

    import torch.distributed as dist

    status = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = body()
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the exit status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
