"""What a bcp.TrainingState adds to a save: ``TrainingState.state_dict()`` beside the
plain pair ``model.state_dict()`` + ``optimizer.state_dict()``, in ms per 1,000
tensors of the resulting state (parameters and buffers, AdamW ``exp_avg`` /
``exp_avg_sq`` / ``step`` per parameter), the first call and later ones.

A Llama-shaped model, small widths (the cost is per tensor, not per byte): an
embedding, per layer q/k/v/o, gate/up/down and two norms, then a final norm and the
head; AdamW stepped once. ``plain``: one process; ``fsdp2``: ``fully_shard`` per layer
and on the root, 2 gloo ranks on CPU (rank 0's numbers). Later calls: the median of
``--repeat`` calls, interleaved with the plain pair (bcp, pair, bcp, pair, ...); CPU
seconds (time.process_time) of the calling thread's process.

    python bench/training_state_cost.py --layers 24
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bcp

warnings.filterwarnings("ignore", message=".*set_vital.*")


class Layer(torch.nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o(self.q(h) * self.k(h) + self.v(h))
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def make_model(layers: int, d: int = 32, vocab: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, d),
        *(Layer(d, 2 * d) for _ in range(layers)),
        torch.nn.LayerNorm(d),
        torch.nn.Linear(d, vocab, bias=False),
    )


def count_tensors(state: object) -> int:
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(count_tensors(v) for v in state)
    return int(isinstance(state, torch.Tensor))


def measure(model: torch.nn.Module, repeat: int) -> dict[str, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ts = bcp.TrainingState(model, opt, rng=False)
    t0 = time.process_time()
    state = ts.state_dict()
    first = time.process_time() - t0
    n = count_tensors({"model": state["model"], "optim": state["optim"]})
    later, pair = [], []
    for _ in range(repeat):
        t0 = time.process_time()
        ts.state_dict()
        later.append(time.process_time() - t0)
        t0 = time.process_time()
        model.state_dict()
        opt.state_dict()
        pair.append(time.process_time() - t0)
    per = 1e3 * 1000 / n
    return {
        "tensors": n,
        "first": first * per,
        "later": statistics.median(later) * per,
        "pair": statistics.median(pair) * per,
    }


def row(case: str, r: dict[str, float]) -> str:
    added = r["later"] - r["pair"]
    return f"{case:<14} {r['tensors']:>8} {r['first']:>10.2f} {r['later']:>10.2f} {r['pair']:>10.2f} {added:>10.2f}"


def fsdp_rank(rank: int, world: int, port: int, layers: int, repeat: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = make_model(layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model[1:-2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    r = measure(model, repeat)
    if rank == 0:
        print(row(f"fsdp2 x{world}", r), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    print("ms per 1,000 tensors of the state (CPU): TrainingState.state_dict() first and later, the plain pair")
    print(f"{'case':<14} {'tensors':>8} {'first':>10} {'later':>10} {'pair':>10} {'added':>10}")
    print(row("plain", measure(make_model(a.layers), a.repeat)), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fsdp_rank, args=(a.world, port, a.layers, a.repeat), nprocs=a.world, start_method="spawn")


if __name__ == "__main__":
    main()
