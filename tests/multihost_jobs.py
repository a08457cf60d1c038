"""One rank of a simulated multi-host job, run by tests/test_multihost_network.py as
``ip netns exec <host> python tests/multihost_jobs.py CASE RANK WORLD IFACE URI``.

The job's default group is gloo created with ``GLOO_SOCKET_IFNAME`` set to the
host's link (what an admin configures for NCCL); then, as in an NCCL-only job, the
variable is gone (or wrong) when bcp creates its own group. Prints one JSON line: what
happened, how long bcp took, what the environment was afterwards."""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    case, rank, world, iface, uri = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if os.environ.get("JOB_DUMP_AFTER"):  # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["JOB_DUMP_AFTER"]), exit=True)
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    if case == "wrong-ifname":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # set by the user, reaches no other host
    else:
        del os.environ["GLOO_SOCKET_IFNAME"]
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the job's own group works across the hosts
    assert flag.item() == world

    import bcp

    lines = Lines()
    logging.getLogger("bcp.coordination.gloo_network").addHandler(lines)
    logging.getLogger("bcp.coordination.gloo_network").setLevel(logging.INFO)
    full = torch.arange(world * 4 * 3, dtype=torch.float32).reshape(world * 4, 3)
    rows = slice(rank * 4, (rank + 1) * 4)
    report: dict = {"rank": rank}
    if case == "late" and rank == world - 1:
        time.sleep(float(os.environ["LATE_RANK_SLEEP"]))  # evaluating, writing logs: longer than the bound
    started = time.monotonic()
    try:
        bcp.save({"w": bcp.TensorShard(full[rows].clone(), tuple(full.shape), (rank * 4, 0)), "step": 7}, uri)
        report["saved_s"] = time.monotonic() - started
        # another layout on load: every rank asks for the whole tensor
        got = bcp.load({"w": torch.zeros_like(full), "step": 0}, uri)
        report["exact"] = bool(torch.equal(got["w"], full)) and got["step"] == 7
        report["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        report.update(ok=False, error_type=type(e).__name__, message=str(e))
    report["elapsed_s"] = time.monotonic() - started
    report["env_after"] = os.environ.get("GLOO_SOCKET_IFNAME")
    report["log"] = lines.lines
    print("REPORT " + json.dumps(report), flush=True)
    if report["ok"]:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
