"""Incremental checkpoints through a CheckpointManager: bytes and time against full saves.

Ten consecutive saves (keep_last=5) of three training states, each through two
managers side by side, ``incremental=True`` and ``incremental=False``, interleaved
(at each step one then the other, the order alternating) so the shared disk and CPU
treat both alike:

* ``frozen99``: a model whose weights are frozen and LoRA-style adapters (rank
  d/256) train under AdamW (the adapters and their moments change; over 99% of the
  parameters never do);
* ``moe``: an MoE layer (16 experts stored one tensor per matrix, Mixtral-style, a
  router and an embedding) where a quarter of the experts and half of the embedding
  rows change per interval, the rows as two contiguous ranges at random places (a
  piece is whole rows: scattered single-row updates would rewrite every piece they
  touch); parameters only (AdamW moments decay everywhere at every step);
* ``dense``: a dense model under AdamW (every byte changes).

For each it prints, per save, the bytes written and the save's wall and CPU seconds
(process CPU, all threads: the machine may be loaded), then the bytes stored under
each root with 5 kept (retired generations included), the medians after the first
save, and whether every kept step of both managers loads bit-exactly. It ends with

    incremental_bench: frozen99 <x> fewer bytes, moe <x> fewer bytes, dense time <r>x, exact True

Targets (issue 39): frozen99 at least 20x fewer bytes written after the first save;
moe's written bytes within 1.2x of the bytes that changed; dense at most 1.05x the
time and 1.01x the bytes of a full save.

    python bench/incremental_bench.py [--mib 192] [--dir /tmp/bcp-incremental-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import bcp
from bcp.target import resolve_backend

SAVES = 10
KEEP = 5
MiB = 1 << 20


@dataclasses.dataclass
class Workload:
    name: str
    what: str
    #: the state saved at each step (built anew from live tensors: updated in place)
    state: Callable[[int], dict]
    #: one training interval: updates the live tensors; returns the bytes it changed
    advance: Callable[[int], int]


def _adamw_state(named: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict:
    return {n: dict(opt.state[p].items()) for n, p in named.items()}


def _grads(params: list[torch.nn.Parameter], gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def frozen99(mib: int) -> Workload:
    """Frozen d x d weights; adapters A (r x d) and B (d x r) per weight, AdamW on them."""
    d = 1024 if mib >= 64 else 128
    r = max(1, d // 256)
    layers = max(1, mib * MiB // (2 * d * d * 4))
    gen = torch.Generator().manual_seed(1)
    frozen = {f"layers.{i}.{m}.weight": torch.randn(d, d, generator=gen) for i in range(layers) for m in ("q", "v")}
    adapters = {}
    for name in frozen:
        stem = name.removesuffix(".weight")
        adapters[f"{stem}.lora_a"] = torch.nn.Parameter(torch.randn(r, d, generator=gen) * 0.01)
        adapters[f"{stem}.lora_b"] = torch.nn.Parameter(torch.zeros(d, r))
    opt = torch.optim.AdamW(list(adapters.values()), lr=1e-3, foreach=False)
    _grads(list(adapters.values()), gen)
    opt.step()
    trainable = sum(p.numel() for p in adapters.values())
    total = trainable + sum(t.numel() for t in frozen.values())

    def state(step: int) -> dict:
        model = {**frozen, **{n: p.data for n, p in adapters.items()}}
        return {"model": model, "optim": _adamw_state(adapters, opt), "step": step}

    def advance(step: int) -> int:
        _grads(list(adapters.values()), gen)
        opt.step()
        return 3 * trainable * 4  # the adapters and both moments

    what = f"{layers * 2} frozen {d}x{d} weights, rank-{r} adapters: {100 * (1 - trainable / total):.2f}% frozen"
    return Workload("frozen99", what, state, advance)


def moe(mib: int) -> Workload:
    """16 experts (w1, w2, w3 each d x f), a router, an embedding of V x d; half the
    bytes in the experts, half in the embedding."""
    d = 512 if mib >= 64 else 64
    experts = 16
    f = max(1, mib * MiB // 2 // experts // (3 * d * 4))
    vocab = max(8, mib * MiB // 2 // (d * 4))
    gen = torch.Generator().manual_seed(2)
    model = {
        "embed.weight": torch.randn(vocab, d, generator=gen),
        "router.weight": torch.randn(experts, d, generator=gen),
    }
    for e in range(experts):
        for m in ("w1", "w2", "w3"):
            shape = (f, d) if m != "w2" else (d, f)
            model[f"experts.{e}.{m}.weight"] = torch.randn(shape, generator=gen)

    def state(step: int) -> dict:
        return {"model": model, "step": step}

    def advance(step: int) -> int:
        changed = model["router.weight"].numel() * 4
        model["router.weight"].add_(1e-3)
        for e in torch.randperm(experts, generator=gen)[: experts // 4].tolist():
            for m in ("w1", "w2", "w3"):
                t = model[f"experts.{e}.{m}.weight"]
                t.add_(1e-3)
                changed += t.numel() * 4
        # half the rows, as two ranges of a quarter each, at random non-overlapping places
        quarter = vocab // 4
        a = int(torch.randint(0, vocab - 2 * quarter + 1, (1,), generator=gen))
        b = int(torch.randint(a + quarter, vocab - quarter + 1, (1,), generator=gen))
        for lo in (a, b):
            model["embed.weight"][lo : lo + quarter].add_(1e-3)
            changed += quarter * d * 4
        return changed

    what = f"{experts} experts of 3 x {d}x{f}, a router, an embedding of {vocab}x{d}"
    return Workload("moe", what, state, advance)


def dense(mib: int) -> Workload:
    """d x d weights under AdamW: the parameters and both moments, a third of the bytes each."""
    d = 1024 if mib >= 64 else 128
    layers = max(1, mib * MiB // 3 // (d * d * 4))
    gen = torch.Generator().manual_seed(3)
    params = {f"layers.{i}.weight": torch.nn.Parameter(torch.randn(d, d, generator=gen)) for i in range(layers)}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, foreach=False)
    _grads(list(params.values()), gen)
    opt.step()

    def state(step: int) -> dict:
        return {"model": {n: p.data for n, p in params.items()}, "optim": _adamw_state(params, opt), "step": step}

    def advance(step: int) -> int:
        _grads(list(params.values()), gen)
        opt.step()
        return 3 * layers * d * d * 4

    return Workload("dense", f"{layers} {d}x{d} weights under AdamW", state, advance)


# -- measuring ------------------------------------------------------------------------------------


def snapshot(state: Any) -> Any:
    """A deep copy of ``state``'s tensors (what the step saved)."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    return state.detach().clone() if isinstance(state, torch.Tensor) else state


def template(state: Any) -> Any:
    """A state of the same structure to load into (zeros, so nothing is left over)."""
    if isinstance(state, dict):
        return {k: template(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def bit_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    return a == b


def stored_bytes(root: str) -> int:
    backend = resolve_backend(root)
    return sum(backend.size(k) for k in backend.list(""))


@dataclasses.dataclass
class Run:
    written: list[int] = dataclasses.field(default_factory=list)
    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    stored: int = 0
    exact: bool = False


def measure(w: Workload, directory: str) -> tuple[dict[str, Run], list[int]]:
    """Ten saves through both managers, interleaved; then each kept step loaded and compared."""
    roots = {kind: os.path.join(directory, w.name, kind) for kind in ("incremental", "full")}
    managers = {
        kind: bcp.CheckpointManager(root, keep_last=KEEP, async_save=False, incremental=kind == "incremental")
        for kind, root in roots.items()
    }
    runs = {kind: Run() for kind in roots}
    saved: dict[int, Any] = {}
    changed: list[int] = []
    for step in range(SAVES):
        if step:
            changed.append(w.advance(step))
        state = w.state(step)
        saved[step] = snapshot(state)
        saved.pop(step - KEEP, None)
        order = ["incremental", "full"] if step % 2 == 0 else ["full", "incremental"]
        for kind in order:
            os.sync()  # both start with the same dirty pages: none
            wall, cpu = time.perf_counter(), time.process_time()
            info = managers[kind].save(step, state)
            runs[kind].wall.append(time.perf_counter() - wall)
            runs[kind].cpu.append(time.process_time() - cpu)
            assert info is not None
            runs[kind].written.append(info.bytes_written)
    for kind, m in managers.items():
        m.close()
        kept = m.steps()
        runs[kind].stored = stored_bytes(roots[kind])
        runs[kind].exact = kept == list(range(SAVES - KEEP, SAVES)) and all(
            bit_equal(bcp.load(template(saved[s]), m.uri(s)), saved[s]) for s in kept
        )
    return runs, changed


def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def report(w: Workload, runs: dict[str, Run], changed: list[int]) -> dict[str, float]:
    inc, full = runs["incremental"], runs["full"]
    print(f"\n{w.name}: {w.what}")
    print(
        f"{'save':>4} {'incr MiB':>10} {'full MiB':>10} {'changed MiB':>12} {'incr s':>7} {'full s':>7} "
        f"{'incr cpu-s':>10} {'full cpu-s':>10}"
    )
    for s in range(SAVES):
        ch = mib(changed[s - 1]).removesuffix(" MiB") if s else "-"
        print(
            f"{s:>4} {inc.written[s] / MiB:>10.1f} {full.written[s] / MiB:>10.1f} {ch:>12} "
            f"{inc.wall[s]:>7.3f} {full.wall[s]:>7.3f} {inc.cpu[s]:>10.3f} {full.cpu[s]:>10.3f}"
        )
    after = slice(1, None)
    fewer = sum(full.written[after]) / max(1, sum(inc.written[after]))
    of_changed = sum(inc.written[after]) / max(1, sum(changed))
    med = {k: (statistics.median(r.wall[after]), statistics.median(r.cpu[after])) for k, r in runs.items()}
    time_x = med["incremental"][0] / med["full"][0]
    cpu_x = med["incremental"][1] / med["full"][1]
    bytes_x = sum(inc.written) / sum(full.written)
    print(
        f"{w.name}: after the first save wrote {mib(sum(inc.written[after]))} against {mib(sum(full.written[after]))} "
        f"({fewer:.1f}x fewer; {of_changed:.3f}x the {mib(sum(changed))} that changed); "
        f"all saves {bytes_x:.4f}x the bytes"
    )
    print(
        f"{w.name}: stored with {KEEP} kept: incremental {mib(inc.stored)}, full {mib(full.stored)}; "
        f"median save (saves 1-{SAVES - 1}) incremental {med['incremental'][0]:.3f} s / "
        f"{med['incremental'][1]:.3f} cpu-s, "
        f"full {med['full'][0]:.3f} s / {med['full'][1]:.3f} cpu-s: time {time_x:.3f}x, cpu {cpu_x:.3f}x; "
        f"kept steps bit-exact: incremental {inc.exact}, full {full.exact}"
    )
    return {
        "fewer": fewer,
        "of_changed": of_changed,
        "time": time_x,
        "cpu": cpu_x,
        "bytes": bytes_x,
        "exact": inc.exact and full.exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=192, help="each state's size in MiB (about)")
    ap.add_argument("--dir", default="/tmp/bcp-incremental-bench")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"incremental_bench: {time.strftime('%Y-%m-%d %H:%M')}, load average {load}, {os.cpu_count()} CPUs, {args.dir}"
    )
    out = {}
    try:
        for make in (frozen99, moe, dense):
            w = make(args.mib)
            runs, changed = measure(w, args.dir)
            out[w.name] = report(w, runs, changed)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    f, m, d = out["frozen99"], out["moe"], out["dense"]
    print(
        f"\ntargets: frozen99 >= 20x fewer bytes {f['fewer'] >= 20}; moe <= 1.2x the changed bytes "
        f"{m['of_changed'] <= 1.2} ({m['of_changed']:.3f}x); dense <= 1.05x the time {d['time'] <= 1.05} "
        f"({d['time']:.3f}x, cpu {d['cpu']:.3f}x), <= 1.01x the bytes {d['bytes'] <= 1.01} ({d['bytes']:.4f}x); "
        f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    exact = all(r["exact"] for r in out.values())
    print(
        f"incremental_bench: frozen99 {f['fewer']:.1f}x fewer bytes, moe {m['fewer']:.1f}x fewer bytes, "
        f"dense time {d['time']:.3f}x, exact {exact}"
    )


if __name__ == "__main__":
    main()
