"""The states the benchmarks save and load, shared by every script in bench/.

Three shapes, each built the same way in every benchmark so their rows compare:

* :func:`transformer_state` -- a Llama-shaped training state: embedding, per layer the
  q/k/v/o attention matrices with their biases, the gate/up/down MLP matrices, two RMS
  norms, a final norm and an untied ``lm_head``; and for every parameter the AdamW
  ``exp_avg`` / ``exp_avg_sq`` moments and a 0-dim float32 ``step``. Laid out as a
  training loop saves it: ``{"model": model.state_dict(), "optim": opt.state_dict()}``
  (optimizer state keyed by parameter index, ``param_groups`` with the index list,
  exactly the nesting ``torch.optim.AdamW.state_dict()`` gives). Hundreds to
  thousands of tensors from a few KiB to hundreds of MiB.
* :func:`equal_state` -- the old benchmark state: ``tensors`` equal float32 matrices.
* :func:`count_state` -- ``n`` float32 tensors of mixed sizes (log-uniform over three
  decades) adding to exactly ``total_bytes``: the same bytes at 100, 1,000 or 10,000
  tensors isolates the per-tensor fixed costs.

The transformer sizes (float32 parameters + two moments + one step per parameter; MHA,
``f`` the MLP width, ``V`` the vocabulary; printed by ``python bench/shapes.py``):

| --gib | layers | d | f | V | tensors | bytes |
|---:|---:|---:|---:|---:|---:|---:|
| 1 | 18 | 512 | 1376 | 32000 | 948 | 1.00 GiB |
| 2 | 18 | 768 | 2048 | 32000 | 948 | 1.97 GiB |
| 4 | 23 | 1024 | 2816 | 32000 | 1208 | 4.04 GiB |
| 8 | 22 | 1536 | 4096 | 32000 | 1156 | 8.06 GiB |

The width is chosen by size band (:data:`WIDTHS`) and the layers to come nearest to
``gib``; ``layers=`` / ``d=`` override it. Below 0.5 GiB the widths are small (smoke
runs). A model with the same names and shapes as real modules is :func:`llama_module`
(names as transformers' ``LlamaForCausalLM`` with ``attention_bias=True``).

    python bench/shapes.py [--gib 1 2 4 8]     # the table above, computed (nothing allocated)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: (largest gib of the band, d, f, vocabulary): the width a transformer_state of that size uses
WIDTHS: tuple[tuple[float, int, int, int], ...] = (
    (0.05, 64, 176, 512),
    (0.5, 256, 688, 4096),
    (1.5, 512, 1376, 32000),
    (3.0, 768, 2048, 32000),
    (6.0, 1024, 2816, 32000),
    (12.0, 1536, 4096, 32000),
    (math.inf, 2048, 5632, 32000),
)

#: AdamW's defaults, as its state_dict() writes them in param_groups
ADAMW_GROUP: dict[str, Any] = {
    "lr": 1e-4,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


@dataclass(frozen=True)
class TransformerSpec:
    """A Llama-shaped model: ``layers`` blocks of width ``d``, MLP width ``f``, vocabulary ``vocab``."""

    layers: int
    d: int
    f: int
    vocab: int

    def params(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, in ``model.state_dict()`` order."""
        d, f = self.d, self.f
        yield "model.embed_tokens.weight", (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}"
            for proj in ("q", "k", "v", "o"):
                yield f"{p}.self_attn.{proj}_proj.weight", (d, d)
                yield f"{p}.self_attn.{proj}_proj.bias", (d,)
            yield f"{p}.mlp.gate_proj.weight", (f, d)
            yield f"{p}.mlp.up_proj.weight", (f, d)
            yield f"{p}.mlp.down_proj.weight", (d, f)
            yield f"{p}.input_layernorm.weight", (d,)
            yield f"{p}.post_attention_layernorm.weight", (d,)
        yield "model.norm.weight", (d,)
        yield "lm_head.weight", (self.vocab, d)

    @property
    def n_params(self) -> int:
        """Parameter tensors (the model's state_dict entries)."""
        return 13 * self.layers + 3

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _n, s in self.params())

    def tensors(self, optim: bool = True) -> int:
        """Tensors in the state: parameters, and with ``optim`` two moments and a step each."""
        return self.n_params * (4 if optim else 1)

    def nbytes(self, optim: bool = True, element_size: int = 4) -> int:
        """Bytes of the state's tensors (parameters and moments of ``element_size``, float32 steps)."""
        if not optim:
            return self.numel * element_size
        return 3 * self.numel * element_size + 4 * self.n_params


def transformer_spec(gib: float, *, layers: int | None = None, d: int | None = None) -> TransformerSpec:
    """The spec nearest ``gib`` GiB of float32 state (parameters + AdamW moments)."""
    if gib <= 0:
        raise ValueError(f"gib must be > 0, got {gib}")
    _top, width, f, vocab = next(w for w in WIDTHS if gib <= w[0])
    if d is not None:
        width, f = d, 16 * math.ceil(8 * d / 3 / 16)
    if layers is None:
        fixed = TransformerSpec(0, width, f, vocab).nbytes()
        per = TransformerSpec(1, width, f, vocab).nbytes() - fixed
        layers = max(1, round((gib * 2**30 - fixed) / per))
    return TransformerSpec(layers, width, f, vocab)


def _filled(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, g: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.uniform_(-1, 1, generator=g) if t.numel() else t


def transformer_state(
    gib: float,
    *,
    layers: int | None = None,
    d: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    optim: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of a Llama-shaped model near ``gib`` GiB (see the
    module's table), every tensor filled (touched) with random values. Parameters and
    moments are ``dtype``; each ``step`` is a 0-dim float32 CPU tensor, as AdamW keeps it.
    Without ``optim``: ``{"model": ...}`` only (the same spec)."""
    spec = transformer_spec(gib, layers=layers, d=d)
    g = torch.Generator(device=device).manual_seed(seed)
    model = {name: _filled(shape, dtype, device, g) for name, shape in spec.params()}
    if not optim:
        return {"model": model}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": _filled(t.shape, dtype, device, g).mul_(1e-3),
            "exp_avg_sq": _filled(t.shape, dtype, device, g).abs_().mul_(1e-6),
        }
        for i, t in enumerate(model.values())
    }
    groups = [{**ADAMW_GROUP, "params": list(range(len(model)))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def equal_state(gib: float, tensors: int = 48, *, cols: int = 2736) -> dict[str, torch.Tensor]:
    """``tensors`` equal float32 matrices of ``cols`` columns, ``gib`` GiB in all (the
    state bench/peers.py measured before the transformer shape)."""
    rows = max(1, int(gib * 2**30 / tensors / cols / 4))
    state = {}
    for i in range(tensors):
        t = torch.empty(rows, cols)
        t.uniform_(-1, 1)
        state[f"layer{i:02d}.weight"] = t
    return state


def count_sizes(total_bytes: int, n_tensors: int, *, spread: float = 1000.0) -> list[int]:
    """Element counts of ``n_tensors`` float32 tensors adding to ``total_bytes // 4``:
    log-uniform over ``spread`` (largest/smallest about ``spread``), in a deterministic
    mixed order; the rounding remainder goes to the largest."""
    elems = total_bytes // 4
    if n_tensors < 1 or elems < n_tensors:
        raise ValueError(f"{total_bytes} bytes cannot make {n_tensors} float32 tensors of at least 1 element")
    golden = (math.sqrt(5) - 1) / 2
    weights = [spread ** ((i * golden) % 1.0) for i in range(n_tensors)]
    scale = (elems - n_tensors) / sum(weights)  # one element each, the rest by weight
    sizes = [1 + int(w * scale) for w in weights]
    big = max(range(n_tensors), key=sizes.__getitem__)
    sizes[big] += elems - sum(sizes)  # the rounding remainder: >= 0, since every int() rounded down
    return sizes


def count_state(total_bytes: int, n_tensors: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n_tensors`` 1-D float32 tensors of mixed sizes (:func:`count_sizes`) whose bytes
    add to ``total_bytes`` rounded down to 4: the same bytes at any count. Named as a
    model's are (``layers.<i // 8>.w<i % 8>``): dotted FQNs cost a load's key checks."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i // 8}.w{i % 8}": _filled((n,), torch.float32, "cpu", g)
        for i, n in enumerate(count_sizes(total_bytes, n_tensors))
    }


def tensors(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested state (dicts, lists, tuples), depth first, in order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for v in state.values():
            yield from tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from tensors(v)


def flatten(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state under dotted keys (``optim.state.3.exp_avg``), for
    formats that take one flat dict of tensors (safetensors)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, Mapping):
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def nbytes(state: Any) -> int:
    """Bytes of every tensor in a nested state."""
    return sum(t.numel() * t.element_size() for t in tensors(state))


def map_tensors(state: Any, fn: Any) -> Any:
    """The nested state with every tensor replaced by ``fn(tensor)`` (other values kept)."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, Mapping):
        return {k: map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [map_tensors(v, fn) for v in state]
    if isinstance(state, tuple):
        return tuple(map_tensors(v, fn) for v in state)
    return state


def llama_module(spec: TransformerSpec) -> torch.nn.Module:
    """A module whose parameters have the spec's names and shapes (transformers'
    ``LlamaForCausalLM`` with ``attention_bias=True``), built from real torch modules
    (Embedding, Linear, RMSNorm) without transformers; no forward (benchmarks set
    gradients themselves)."""
    nn = torch.nn
    d, f = spec.d, spec.f

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
            self.down_proj = nn.Linear(f, d, bias=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attention()
            self.mlp = MLP()
            self.input_layernorm = nn.RMSNorm(d)
            self.post_attention_layernorm = nn.RMSNorm(d)

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(spec.vocab, d)
            self.layers = nn.ModuleList(Layer() for _ in range(spec.layers))
            self.norm = nn.RMSNorm(d)

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(d, spec.vocab, bias=False)

    return Llama()


def size_table(gibs: list[float]) -> list[str]:
    """The documentation table's rows, computed."""
    rows = ["| --gib | layers | d | f | V | tensors | bytes |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for gib in gibs:
        s = transformer_spec(gib)
        rows.append(
            f"| {gib:g} | {s.layers} | {s.d} | {s.f} | {s.vocab} | {s.tensors()} | {s.nbytes() / 2**30:.2f} GiB |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    print("\n".join(size_table(args.gib)))


if __name__ == "__main__":
    main()
