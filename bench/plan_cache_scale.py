"""The save's planning messages and the plan cache at scale (simulated ranks, one process).

FSDP layout of bench/plan_scale.py (every bf16 tensor sharded on dim 0 over all ranks).
Timed, CPU seconds of this process, on the coordinator's side of bcp.saver:
  first save: _coordinate (existing-checkpoint check on a memory backend, objects,
      cache lookup: a miss) + _plan (decode the one metadata sent, plan_save over
      every rank's LocalLayout, remember the plan) + remembering one rank's writes;
  second save, same layout: _coordinate (a hit: nothing else runs on the coordinator).
Every rank also digests its own layout at every save (LocalLayout.digest(), shown per
rank; ranks do it in parallel). Message sizes are pickled bytes, as gather_object sends
them: the old per-rank message (the rank and its TensorPlan objects) beside the hello and
the LocalLayout that replace it.

    python bench/plan_cache_scale.py [--ranks 1024] [--tensors 2000]
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bcp.backends import backend_for
from bcp.options import SaveOptions
from bcp.planning import TensorPlan
from bcp.planning.cache import PlanCache
from bcp.saver import Hello, _coordinate, _plan
from plan_scale import fsdp_layouts


def cpu(fn, *args):
    t = time.process_time()
    out = fn(*args)
    return time.process_time() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    layouts = fsdp_layouts(args.ranks, args.tensors)
    digest_s = []
    digests = []
    for layout in layouts:
        t, d = cpu(layout.digest)
        digest_s.append(t)
        digests.append(d)
    backend = backend_for("memory://plan-cache-scale/ck")
    options = SaveOptions()
    firsts, seconds = [], []
    for _ in range(args.repeat):
        cache = PlanCache()
        hellos = [Hello(d, lay.meta_digest, frozenset(), {}) for d, lay in zip(digests, layouts, strict=True)]
        t0 = time.process_time()
        decision = _coordinate(backend, hellos, options, cache)
        sent = [
            lay if decision.start.meta_from.get(lay.meta_digest) == r else lay.without_meta()
            for r, lay in enumerate(layouts)
        ]
        _decision, plan = _plan(decision, sent, cache)
        cache.remember_writes(decision.start.key, plan.writes[0])
        firsts.append(time.process_time() - t0)
        assert not decision.start.cached
        held = frozenset({decision.start.key})
        hellos = [Hello(d, lay.meta_digest, held, {}) for d, lay in zip(digests, layouts, strict=True)]
        t, again = cpu(_coordinate, backend, hellos, options, cache)
        assert again.start.cached and again.plan is not None
        seconds.append(t)
    first, second = statistics.median(firsts), statistics.median(seconds)
    digest = statistics.median(digest_s)
    print(f"{args.ranks} ranks x {args.tensors} tensors, FSDP, medians of {args.repeat} (CPU s)")
    print(f"  first save, coordinator planning:        {first:8.3f} s")
    print(f"  second save, same layout (cache hit):    {second:8.3f} s  ({second / first:.1%} of the first)")
    print(f"  + each rank's layout digest, every save:  {digest * 1e3:8.3f} ms")
    # messages
    layout = layouts[1]
    meta = layout.decoded
    tensors = tuple(
        TensorPlan(f, k, d, s, (b,))
        for (f, k, d, s), (_fqn, b) in zip(
            zip(meta.fqns, meta.key_paths, meta.dtypes, meta.shapes, strict=True), layout.boxes(), strict=True
        )
    )
    old = len(pickle.dumps((1, tensors)))  # what ranks sent before LocalLayout
    hello = len(pickle.dumps(Hello(digests[1], layout.meta_digest, frozenset({b"k" * 16, b"j" * 16}), {})))
    arrays = len(pickle.dumps(layout.without_meta()))
    print(f"  per-rank message before: TensorPlan pickle    {old:>10,} B")
    print(f"  per-rank message now:    hello (every save)   {hello:>10,} B")
    print(f"                           LocalLayout (miss)   {arrays:>10,} B (+ metadata once: {len(layout.meta):,} B)")
    print(f"                           writes (miss)        {len(pickle.dumps(plan.writes[1])):>10,} B")


if __name__ == "__main__":
    main()
