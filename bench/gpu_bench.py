"""bcp on a GPU against its peers, in one run, with the physical limits beside them.

Measured in the same minutes, cases interleaved round by round (bcp, DCP, torch, ...):

* limits: device-to-host copy of the state into reused pinned memory and into
  pageable memory; O_DIRECT write and read of the state's bytes; a buffered cold read;
* bcp: save, async_save (first call of a process, with and without
  ``bcp.reserve_staging``; steady state: blocking and total), cold load into CUDA
  tensors (O_DIRECT reads and buffered reads);
* DCP: save, async_save with the default stager, async_save with a pinned stager
  reused across calls (where this torch has one), cold load into CUDA tensors;
* torch.save (+fsync) and torch.load(map_location=cuda);
* a training loop (Linear layers + AdamW) saving every N steps: stall per save for
  bcp.save, bcp.async_save, bcp.async_save(overlap=optimizer), two overlapped saves
  before one step with user pre-hooks, DCP's async_save;
* runtime limits: the staging budget per process (host memory, cgroup room,
  LOCAL_WORLD_SIZE), peak extra device memory of loads that cast or land in strided
  tensors, CPU seconds of an async save (spinning event waits), side streams and
  reserved device memory across saves, a derived CUDA RNG state restored, pageable
  stand-in slabs a first save used.

First calls run in fresh subprocesses (pinned memory, once allocated, is cached by
torch for the life of a process). Cold loads drop the files from the page cache.

    python bench/gpu_bench.py [--gib 6] [--tensors 24] [--repeats 3] [--dir /tmp/bcp-gpu] [--shape equal]
    python bench/gpu_bench.py --shape transformer --gib 6   # the Llama-shaped state of bench/shapes.py

``--shape equal`` (the default) is ``--tensors`` equal bf16 matrices; ``--shape
transformer`` is bench/shapes.py's ``transformer_state`` on the device: float32
parameters and AdamW moments (a mixed-precision job's master weights and optimizer
state), the 0-dim ``step`` tensors on the CPU as AdamW keeps them; ``--tensors`` is
ignored. Every case's checkpoints are removed once the case has measured them, so the
disk holds at most two copies of the state at once (13 GB at 6 GiB), and the training
loop at most two saves of its model's state.
    python bench/gpu_bench.py --device cpu --gib 0.1 --repeats 1 --hidden 256 --layers 2 --batch 64   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warnings

import torch

import shapes
from peers import drop_cache, fsync_tree

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

import bcp  # noqa: E402 - after the warning filter above


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_state(gib: float, tensors: int, device: torch.device, shape: str = "equal") -> dict:
    if shape == "transformer":
        return shapes.transformer_state(gib, device=device)
    cols = 4096
    rows = max(1, int(gib * 2**30 / tensors / cols / 2))
    g = torch.Generator(device=device).manual_seed(0)
    return {
        f"layer{i:02d}.weight": torch.randn(rows, cols, device=device, generator=g, dtype=torch.bfloat16)
        for i in range(tensors)
    }


def nbytes(state: dict) -> int:
    return shapes.nbytes(state)


def describe(args) -> str:
    if args.shape == "transformer":
        s = shapes.transformer_spec(args.gib)
        return (
            f"transformer: {s.tensors()} float32 tensors ({s.layers} layers, d={s.d}, f={s.f}, vocab {s.vocab}; "
            f"parameters, AdamW exp_avg/exp_avg_sq/step each)"
        )
    return f"equal: {args.tensors} bf16 tensors"


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


# -- one round of every case ------------------------------------------------------------------


class Cases:
    def __init__(self, args, state: dict, device: torch.device) -> None:
        self.args, self.state, self.device = args, state, device
        self.size = nbytes(state)
        self.root = args.dir
        self.sources = list(shapes.tensors(state))
        self.pinned = (
            [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in self.sources]
            if device.type == "cuda"
            else None
        )
        self.pageable = [torch.zeros(v.shape, dtype=v.dtype) for v in self.sources]
        self.templates = shapes.map_tensors(state, torch.empty_like)
        self.pool = bcp.io_scheduler.staging.default_pool()
        bcp.reserve_staging(state).wait()
        self.dcp_stager = _pinned_dcp_stager()

    def limits(self) -> dict:
        out = {}
        if self.pinned is not None:
            for _ in range(2):  # the second copy is into reused (touched, registered) memory
                t = timed(
                    lambda: [d.copy_(s, non_blocking=True) for d, s in zip(self.pinned, self.sources, strict=True)],
                    self.device,
                )
            out["D2H copy into reused pinned memory"] = t
        out["D2H copy into pageable memory"] = timed(
            lambda: [d.copy_(s) for d, s in zip(self.pageable, self.sources, strict=True)], self.device
        )
        out.update(raw_disk(self.root, self.size))
        return out

    def bcp_cases(self) -> dict:
        out = {}
        uri = fresh(os.path.join(self.root, "bcp"))
        out["bcp save"] = timed(lambda: bcp.save(self.state, uri), self.device)
        for k in range(2):
            uri_a = fresh(os.path.join(self.root, f"bcp-async{k}"))
            sync(self.device)
            t0, cpu0 = time.perf_counter(), time.process_time()
            handle = bcp.async_save(self.state, uri_a)
            blocking = time.perf_counter() - t0
            handle.wait()
            out["bcp async_save blocking (steady)"] = blocking
            out["bcp async_save total (steady)"] = time.perf_counter() - t0
            # every thread of the process: writers spinning in cudaEventSynchronize show here
            out["bcp async_save CPU seconds, all threads (steady)"] = time.process_time() - cpu0
            shutil.rmtree(uri_a, ignore_errors=True)  # disk: at most two copies of the state at once
        for label, load_uri in (("O_DIRECT reads", uri), ("buffered reads", f"file://{uri}?direct_reads=false")):
            drop_cache(uri)
            out[f"bcp load into {self.device.type} ({label}, cold)"] = timed(
                lambda load_uri=load_uri: bcp.load(self.templates, load_uri), self.device
            )
        shutil.rmtree(uri, ignore_errors=True)
        return out

    def dcp_cases(self) -> dict:
        import torch.distributed.checkpoint as dcp

        out = {}
        d = fresh(os.path.join(self.root, "dcp"))
        out["DCP save"] = timed(lambda: dcp.save(self.state, storage_writer=dcp.FileSystemWriter(d)), self.device)
        for label, stager in (("default stager", None), ("reused pinned stager", self.dcp_stager)):
            if label != "default stager" and stager is None:
                continue
            da = fresh(os.path.join(self.root, "dcp-async"))
            sync(self.device)
            t0 = time.perf_counter()
            kwargs = {"async_stager": stager} if stager is not None else {}
            try:
                result = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(da), **kwargs)
            except Exception as e:  # noqa: BLE001 - reported as a note
                out[f"DCP async_save ({label}): note"] = f"{type(e).__name__}: {e}"[:160]
                continue
            out[f"DCP async_save blocking ({label})"] = time.perf_counter() - t0
            future = getattr(result, "upload_completion", result)
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - DCP's stager refusing this state: reported as a note
                out[f"DCP async_save ({label}): note"] = f"{type(e).__name__}: {e}"[:160]
                del out[f"DCP async_save blocking ({label})"]
                shutil.rmtree(da, ignore_errors=True)
                continue
            out[f"DCP async_save total ({label})"] = time.perf_counter() - t0
            shutil.rmtree(da, ignore_errors=True)
        drop_cache(d)
        out[f"DCP load into {self.device.type} (cold)"] = timed(
            lambda: dcp.load(self.templates, storage_reader=dcp.FileSystemReader(d)), self.device
        )
        shutil.rmtree(d, ignore_errors=True)
        return out

    def torch_cases(self) -> dict:
        out = {}
        f = os.path.join(self.root, "torch.pt")

        def save():
            torch.save(self.state, f)
            fsync_tree(f) if os.path.isdir(f) else _fsync(f)

        out["torch.save + fsync"] = timed(save, self.device)
        drop_cache(f)
        out[f"torch.load to {self.device.type} (cold)"] = timed(
            lambda: torch.load(f, map_location=self.device, weights_only=True), self.device
        )
        os.remove(f)
        return out


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _pinned_dcp_stager():
    """DCP's DefaultStager with pinned, reused memory and non-blocking copies, where
    this torch has it (2.9+); None otherwise."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=torch.cuda.is_available(),
            )
        )
    except Exception:  # noqa: BLE001 - an older torch: the case is left out
        return None


def raw_disk(root: str, size: int) -> dict:
    import mmap

    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    os.makedirs(root, exist_ok=True)
    f = os.path.join(root, "raw.bin")

    def write():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, size, chunk):
            os.pwrite(fd, memoryview(buf)[: max(4096, min(chunk, size - off) // 4096 * 4096)], off)
        os.fsync(fd)
        os.close(fd)

    def read(flags):
        fd = os.open(f, os.O_RDONLY | flags)
        for off in range(0, size, chunk):
            os.preadv(fd, [memoryview(buf)], off)
        os.close(fd)

    cpu = torch.device("cpu")
    out = {"disk O_DIRECT write": timed(write, cpu), "disk O_DIRECT read": timed(lambda: read(os.O_DIRECT), cpu)}
    drop_cache(f)
    out["disk buffered read (cold)"] = timed(lambda: read(0), cpu)
    os.remove(f)
    return out


# -- first calls (fresh processes) ----------------------------------------------------------------


def first_call(args) -> dict:
    device = torch.device(args.device)
    state = make_state(args.gib, args.tensors, device, args.shape)
    if args.reserve:
        bcp.reserve_staging(state).wait()  # at start-up, while the model is built, before training
    uri = fresh(os.path.join(args.dir, "bcp-first"))
    sync(device)
    t0 = time.perf_counter()
    handle = bcp.async_save(state, uri)
    blocking = time.perf_counter() - t0
    handle.wait()
    total = time.perf_counter() - t0
    pool = bcp.io_scheduler.staging.default_pool()
    shutil.rmtree(uri, ignore_errors=True)
    return {"blocking": blocking, "total": total, "standins": pool.standins_lent}


def run_first_call(args, reserve: bool) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--first-call",
        "--device",
        args.device,
        "--gib",
        str(args.gib),
        "--tensors",
        str(args.tensors),
        "--shape",
        args.shape,
        "--dir",
        args.dir,
    ] + (["--reserve"] if reserve else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- runtime limits of a multi-host job (one figure each) ------------------------------------------


def runtime_limits(args, state: dict, device: torch.device) -> dict:
    """Budget per host, device temporaries of cast/strided loads, side streams and
    reserved device memory across saves, derived CUDA RNG states."""
    from bcp.io_scheduler import staging

    out: dict[str, float] = {
        "host MemAvailable-or-cgroup room (GB)": staging.available_memory() / 1e9,
        f"default staging budget per process (GB), LOCAL_WORLD_SIZE={staging.local_world_size()}": (
            staging.default_budget() / 1e9
        ),
    }
    room = staging.cgroup_available()
    out["cgroup memory room (GB; -1: no limit)"] = room / 1e9 if room is not None else -1.0
    root = fresh(os.path.join(args.dir, "limits"))
    flat = shapes.flatten(state)
    src = {k: v.float() for k, v in list(flat.items())[: max(1, len(flat) // 4)]}  # fp32 checkpoint
    bcp.save(src, os.path.join(root, "fp32"))
    size = nbytes(src)
    del src
    for label, make in (
        ("cast fp32->bf16", lambda v: torch.empty(v.shape, dtype=torch.bfloat16, device=device)),
        ("strided fp32", lambda v: torch.empty(v.shape[::-1], dtype=torch.float32, device=device).t()),
    ):
        template = {k: make(v) for k, v in list(flat.items())[: max(1, len(flat) // 4)]}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        seconds = timed(lambda template=template: bcp.load(template, os.path.join(root, "fp32"), strict=False), device)
        out[f"bcp load {label}: seconds for {size / 1e9:.2f} GB stored"] = seconds
        if device.type == "cuda":
            extra = torch.cuda.max_memory_allocated(device) - base
            out[f"bcp load {label}: peak extra device memory / stored size"] = extra / size
        del template
    if device.type == "cuda":
        from bcp.training import reshard_rng_states, rng_state, set_rng_state

        reserved = torch.cuda.memory_reserved(device)
        tensor_device = next(shapes.tensors(state)).device  # with its index: the side streams' key
        streams = []
        for k in range(6):
            handle = bcp.async_save(state, fresh(os.path.join(root, f"s{k}")))
            streams.append(handle._job.pipeline.copies._side[tensor_device])
            handle.wait()
            shutil.rmtree(os.path.join(root, f"s{k}"), ignore_errors=True)
        out["side streams used by 6 async saves"] = len({id(s) for s in streams})
        out["device memory reserved growth over 6 async saves (GB)"] = (
            torch.cuda.memory_reserved(device) - reserved
        ) / 1e9
        try:
            set_rng_state(reshard_rng_states({0: rng_state()}, 1, 2))
            out["derived CUDA RNG state restores on a new rank (1 = yes)"] = 1.0
        except RuntimeError:
            out["derived CUDA RNG state restores on a new rank (1 = yes)"] = 0.0
    shutil.rmtree(root, ignore_errors=True)
    return out


# -- training loop stall ------------------------------------------------------------------------


def training_stall(args, device: torch.device) -> dict:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.hidden, device=device)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    for _ in range(3):
        step()
    bcp.reserve_staging(state()).wait()
    plain = statistics.median(timed(step, device) for _ in range(10))
    out = {"train step (no save)": plain, "train state GB": nbytes_nested(state()) / 1e9}
    root = os.path.join(args.dir, "loop")

    def bcp_sync(k):
        bcp.save(state(), fresh(f"{root}/s{k}"))
        return None

    def bcp_async(k):
        return bcp.async_save(state(), fresh(f"{root}/a{k}"))

    def bcp_overlap(k):
        return bcp.async_save(state(), fresh(f"{root}/o{k}"), overlap=opt)

    class Both:
        """Two overlapped saves made before one step, waited for together."""

        def __init__(self, handles) -> None:
            self.handles = handles

        def wait(self) -> None:
            for h in self.handles:
                h.wait()

    def bcp_overlap_twice(k):
        first = bcp.async_save(state(), fresh(f"{root}/p{k}"), overlap=opt)
        return Both([first, bcp.async_save(state(), fresh(f"{root}/q{k}"), overlap=opt)])

    def dcp_async(k):
        result = dcp.async_save(state(), storage_writer=dcp.FileSystemWriter(fresh(f"{root}/d{k}")))
        return getattr(result, "upload_completion", result)

    modes = {
        "bcp save": bcp_sync,
        "bcp async_save": bcp_async,
        "bcp async_save overlap=opt": bcp_overlap,
        "bcp 2 x async_save overlap=opt before a step, user pre-hooks": bcp_overlap_twice,
        "DCP async_save (default stager)": dcp_async,
    }
    user_hooks = [opt.register_step_pre_hook(lambda *_: None) for _ in range(2)]  # bcp's comes between
    for name, save in modes.items():
        stalls = []
        pending = None
        for k in range(args.saves):
            for _ in range(args.every - 1):
                step()
            if pending is not None:
                pending.result() if hasattr(pending, "result") else pending.wait()
                pending = None
                shutil.rmtree(root, ignore_errors=True)  # the finished saves: disk holds at most two at once
            sync(device)
            t0 = time.perf_counter()
            pending = save(k)
            step()
            step()
            sync(device)
            stalls.append(time.perf_counter() - t0 - 2 * plain)
        if pending is not None:
            pending.result() if hasattr(pending, "result") else pending.wait()
        shutil.rmtree(root, ignore_errors=True)  # a mode's saves (6+ GB each at the default size) go before the next
        out[f"stall per save: {name} (first)"] = stalls[0]
        out[f"stall per save: {name} (later, median)"] = statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0]
    for hook in user_hooks:
        hook.remove()
    shutil.rmtree(root, ignore_errors=True)
    return out


def nbytes_nested(state) -> int:
    from bcp.state import flatten_state

    return sum(
        leaf.value.numel() * leaf.value.element_size() for leaf in flatten_state(state).values() if leaf.is_tensor
    )


# -- report --------------------------------------------------------------------------------------


def report(rows: dict[str, list], size: int, stall_rows: dict, shape: str = "") -> None:
    med = {k: statistics.median(v) for k, v in rows.items() if v and not isinstance(v[0], str)}
    rounds = max(len(v) for v in rows.values())
    print(f"\nstate: {shape + '; ' if shape else ''}{size / 1e9:.2f} GB; medians of {rounds} interleaved rounds\n")
    print(f"{'case':58s} {'seconds':>9s} {'GB/s':>8s}")
    for k, v in med.items():
        print(f"{k:58s} {v:9.3f} {size / v / 1e9 if v > 0 else float('inf'):8.2f}")
    for k, v in rows.items():
        if v and isinstance(v[0], str):
            print(f"{k}: {v[0]}")
    print()
    for k, v in stall_rows.items():
        print(f"{k:58s} {v:9.3f}")

    def ratio(label, a, b, goal, higher_is_better):
        if a in med and b in med:
            r = med[a] / med[b]
            met = (r >= goal) if higher_is_better else (r <= goal)
            print(
                f"{label:70s} {r:6.2f}x (goal {'>=' if higher_is_better else '<='} {goal}) "
                f"{'met' if met else 'NOT met'}"
            )

    print("\ntargets (ratios of medians from this run):")
    ratio(
        "async_save blocking / pinned D2H copy",
        "bcp async_save blocking (steady)",
        "D2H copy into reused pinned memory",
        1.2,
        False,
    )
    ratio(
        "first async_save blocking (reserved) / steady blocking",
        "bcp async_save blocking (first call, reserved)",
        "bcp async_save blocking (steady)",
        2.0,
        False,
    )
    ratio(
        "first async_save blocking (no reservation) / steady blocking",
        "bcp async_save blocking (first call, no reservation)",
        "bcp async_save blocking (steady)",
        2.0,
        False,
    )
    ratio(
        "async_save CPU seconds (all threads) / total seconds (steady)",
        "bcp async_save CPU seconds, all threads (steady)",
        "bcp async_save total (steady)",
        1.0,
        False,
    )
    for k, v in stall_rows.items():
        if k.endswith("peak extra device memory / stored size"):
            print(f"{k:70s} {v:6.2f}x (goal <= 0.25) {'met' if v <= 0.25 else 'NOT met'}")
    loads = [k for k in med if k.startswith(("DCP load", "torch.load"))]
    best_peer = min((med[k] for k in loads), default=None)
    for k in [k for k in med if k.startswith("bcp load")]:
        if best_peer is not None:
            r = best_peer / med[k]
            print(
                f"{'speed of ' + k + ' / fastest peer load':70s} {r:6.2f}x (goal >= 1.1) "
                f"{'met' if r >= 1.1 else 'NOT met'}"
            )
        for disk in ("disk O_DIRECT read", "disk buffered read (cold)"):
            if disk in med:
                r = med[disk] / med[k]
                print(f"{'speed of ' + k + ' / ' + disk:70s} {r:6.2f}x (goal >= 0.9)")
    if "train step (no save)" in stall_rows:
        step = stall_rows["train step (no save)"]
        key = "stall per save: bcp async_save overlap=opt (later, median)"
        if key in stall_rows:
            r = stall_rows[key] / step
            print(f"{'overlap stall per save / step':70s} {r:6.3f} (goal <= 0.05) {'met' if r <= 0.05 else 'NOT met'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=6.0)
    p.add_argument("--tensors", type=int, default=24, help="tensors of the equal shape")
    p.add_argument("--shape", choices=("equal", "transformer"), default="equal", help="bench/shapes.py's state")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bcp-gpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--every", type=int, default=12)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--no-loop", action="store_true", help="skip the training-loop stall measurement")
    p.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reserve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_call:
        print(json.dumps(first_call(args)))
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run on a GPU machine, or --device cpu for a smoke run of the harness")
    os.makedirs(args.dir, exist_ok=True)
    rows: dict[str, list] = {}
    figures: dict[str, float] = {}

    def add(measured: dict) -> None:
        for k, v in measured.items():
            rows.setdefault(k, []).append(v)

    for reserve in (False, True):
        first = run_first_call(args, reserve)
        tag = "reserved" if reserve else "no reservation"
        add(
            {
                f"bcp async_save blocking (first call, {tag})": first["blocking"],
                f"bcp async_save total (first call, {tag})": first["total"],
            }
        )
        figures[f"pageable stand-in slabs lent by the first call ({tag})"] = first["standins"]
    state = make_state(args.gib, args.tensors, device, args.shape)
    size = nbytes(state)
    cases = Cases(args, state, device)
    for r in range(args.repeats):
        order = [cases.limits, cases.bcp_cases, cases.dcp_cases, cases.torch_cases]
        if r % 2:
            order = [order[0], order[2], order[1], order[3]]  # alternate who goes first
        for case in order:
            add(case())
            print(f"round {r + 1}: {case.__name__} done", file=sys.stderr, flush=True)
    figures.update(runtime_limits(args, state, device))
    del cases, state
    stall_rows = {} if args.no_loop else training_stall(args, device)
    report(rows, size, figures | stall_rows, describe(args))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
