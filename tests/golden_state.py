"""The state stored in tests/golden/v1, v2 and v3/base, rebuilt deterministically (no RNG), so the
golden test can compare what it loads against values computed here."""

from __future__ import annotations

import collections

import numpy as np
import torch


def golden_state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7 - 1.5
    tied = torch.linspace(-2, 2, 48).reshape(8, 6)
    return {
        "model": {
            "embed.weight": tied,
            "head.weight": tied,
            "layer.0.w": base,
            "layer.0.b": torch.arange(6, dtype=torch.bfloat16) / 3,
            "layer.1.w_fp16": (base * 3).to(torch.float16).t(),
            "fp8": (base / 4).to(torch.float8_e4m3fn),
            "mask": torch.arange(10) % 3 == 0,
            "count": torch.tensor(12345678901, dtype=torch.int64),
            "empty": torch.empty(0, 3),
            "ids": (torch.arange(5, dtype=torch.int32) * 1000).to(torch.uint16),
            "cplx": torch.complex(torch.arange(3.0), -torch.arange(3.0)),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": base * 0.5}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "name": None}],
        },
        "step": 42,
        "objects": {
            "nan": float("nan"),
            "bytes": b"\x00\xffbcp",
            "set": frozenset({1, 2}),
            "odict": collections.OrderedDict(z=1, a=2),
            "int_keys": {1: "one", 2: "two"},
            "np": np.arange(4, dtype=np.int32),
            "dtype": torch.bfloat16,
            "text": "ünïcode ✓",
        },
    }


def golden_step_state() -> dict:
    """tests/golden/v3/step: the golden state one step on: ``layer.0.b``, one row of
    ``layer.0.w`` and ``step`` changed (written), the rest as in ``base`` (referred to)."""
    state = golden_state()
    state["model"]["layer.0.b"] = state["model"]["layer.0.b"] + 1
    state["model"]["layer.0.w"] = state["model"]["layer.0.w"].clone()
    state["model"]["layer.0.w"][2] += 0.25
    state["step"] = 43
    return state
