"""SIGKILL at random points of a tiered job's saves, replication and drains
(docs/tiers.md, "Failures each configuration survives").

Each case (seeded: the seed fixes the layout, the victim and the delay) runs a job of
2 simulated hosts x 1-2 ranks (tests/tier_jobs.py) saving steps 1..8 with
``replicas=1`` and a drain every 1 or 2 steps, and kills one rank, or one whole host
(its ranks; sometimes its local directory too: the host's memory lost), with SIGKILL
at a random moment (a random step's save began, then up to 0.3 s); the other ranks are killed a second
later, as a launcher tears a job down. Then:

* every local step that the hosts' copies hold entirely (the inventory's rule) and
  every committed persistent step loads bit-exactly as one of the saves of that step
  (never a torn step), a persistent step passes ``bcp verify``, and nothing partial
  in the persistent root is listed as committed;
* a fresh job at the same world size, then one at a smaller world size, recovers the
  newest of those steps, never older than the last step the killed job had finished
  (its replication agreed) or drained;
* the smaller job saves two more steps with other values (a second run of the same
  step numbers), and a job at the full world size recovers the newest, from the newest
  save: a stale copy on a host that sat out is never mixed in or preferred.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import bcp
import tier_jobs
from bcp.discovery import committed_steps
from bcp.metadata.keys import MANIFEST_KEY
from bcp.target import resolve_backend
from bcp.tiers.holding import read_holding, verify
from bcp.tiers.inventory import choose_local, list_local
from bcp.tiers.paths import local_root, local_steps, step_dir
from bcp.verify import verify_checkpoint
from test_tiers_save import _saved_files

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

STEPS = list(range(1, 9))
#: seeded cases: a bounded number (each runs five jobs, about 4-8 s on 2 loaded cores);
#: BCP_TIER_KILL_CASES=N runs more by hand
CASES = int(os.environ.get("BCP_TIER_KILL_CASES", "6"))


def _plan(seed: int) -> dict:
    rnd = random.Random(seed)
    rph = rnd.choice([1, 2])
    victim = rnd.randrange(2)
    whole_host = rnd.random() < 0.5
    ranks = list(range(victim * rph, (victim + 1) * rph)) if whole_host else [rnd.randrange(2 * rph)]
    lost = whole_host and rnd.random() < 0.5
    if rph == 1:
        smaller = [f"host{1 - victim if lost else rnd.randrange(2)}"]
    else:
        options = [["host0", "host1"], *([[f"host{h}"] * 2 for h in range(2) if not (lost and h == victim)])]
        smaller = rnd.choice(options)
    return {
        "rph": rph,
        "persist_every": rnd.choice([1, 2]),
        "start_at": rnd.randint(1, 6),
        "kill": {"ranks": ranks, "after": rnd.uniform(0.0, 0.3), "grace": 1.0},
        "lost": f"host{victim}" if lost else None,
        "smaller": smaller,
    }


def _root(cfg: dict, host: str) -> str:
    return local_root(os.path.join(cfg["base"], host), cfg["root"])


def _check_holdings(cfg: dict, host: str) -> None:
    """Every file a host lists for a step is whole, and a list is never another save's than the manifest's."""
    root = _root(cfg, host)
    for s in local_steps(root):
        d = step_dir(root, s)
        doc = read_holding(d)
        if doc is None or not os.path.exists(os.path.join(d, MANIFEST_KEY)):
            continue  # nothing listed, or a step not (or no longer) known on this host
        manifest, spans = _saved_files(d)
        assert doc.save_id == manifest.save_id, f"{host} step {s}: holding.json of another save"
        entries = {e.path: e for e in manifest.data_files}
        for path in doc.files:
            problem = verify(os.path.join(d, *path.split("/")), entries[path], spans, manifest.checksum_block_bytes)
            assert problem is None, f"{host} step {s} lists {path}: {problem}"


def _matching_run(out: dict, step: int, runs: list[int], where: str) -> int:
    for run in runs:
        want = tier_jobs.expected(step, run)
        if all(torch.equal(out[k], want[k]) for k in ("w", "bias", "emb")) and out["step"] == step:
            return run
    raise AssertionError(f"{where}: step {step} loads as none of the runs {runs} saved: a torn or mixed step")


def _complete_local(cfg: dict, hosts: list[str], runs: list[int], scratch: str) -> dict[int, list[tuple[str, int]]]:
    """Per step, (save id, run) of each save the hosts' copies hold entirely, each loaded
    bit-exactly from the files the inventory counts (gathered into one directory)."""
    listings = [list_local(_root(cfg, h)) for h in hosts]
    out: dict[int, list[tuple[str, int]]] = {}
    saves = {(c.step, c.save_id, c.manifest_crc32c, c.n_files) for listing in listings for c in listing}
    for step, save_id, crc, n in sorted(saves):
        only = [[c for c in listing if (c.step, c.save_id, c.manifest_crc32c, c.n_files) == (step, save_id, crc, n)]
                for listing in listings]  # fmt: skip
        choice = choose_local(only)
        if choice is None:
            continue
        target = os.path.join(scratch, f"{step}-{save_id}")
        source = step_dir(_root(cfg, hosts[choice.source]), step)
        manifest = bcp.open(source).manifest
        os.makedirs(os.path.join(target, manifest.generation, "data"))
        for name in (MANIFEST_KEY, manifest.catalog.path):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
        for entry, holders in zip(manifest.data_files, choice.holders, strict=True):
            held = step_dir(_root(cfg, hosts[holders[0]]), step)
            shutil.copyfile(os.path.join(held, entry.path), os.path.join(target, entry.path))
        loaded = bcp.load(tier_jobs.template(), target)
        run = _matching_run(loaded, step, runs, f"local step {step} (save {save_id}) on {hosts}")
        out.setdefault(step, []).append((save_id, run))
    return out


def _check_persistent(cfg: dict, runs: list[int]) -> dict[int, int]:
    """Run of each committed persistent step; a step directory without a manifest is never listed."""
    backend = resolve_backend(cfg["root"])
    committed = committed_steps(backend)
    dirs = sorted(n for n in os.listdir(cfg["root"]) if n.startswith("step_")) if os.path.isdir(cfg["root"]) else []
    for name in dirs:
        has_manifest = os.path.exists(os.path.join(cfg["root"], name, MANIFEST_KEY))
        assert (int(name[len("step_") :]) in committed) == has_manifest, f"{name}: listed committed without a manifest"
    out = {}
    for s in committed:
        uri = os.path.join(cfg["root"], f"step_{s:010d}")
        report = verify_checkpoint(uri)
        assert report["ok"], f"persistent step {s}: {report['problems']}"
        out[s] = _matching_run(bcp.load(tier_jobs.template(), uri), s, runs, f"persistent step {s}")
    return out


def _oracle(local: dict[int, list[tuple[str, int]]], persistent: dict[int, int]) -> tuple[int | None, int | None]:
    """What a recovery must load: the newest step either tier holds (a tie: the local
    one), from the newest run that saved it."""
    newest_local = max(local, default=None)
    newest_persistent = max(persistent, default=None)
    if newest_local is not None and (newest_persistent is None or newest_local >= newest_persistent):
        return newest_local, max(run for _sid, run in local[newest_local])
    return newest_persistent, None if newest_persistent is None else persistent[newest_persistent]


def _recovered(cfg: dict, world: int) -> tuple[int | None, int | None]:
    import json

    seen = set()
    for r in range(world):
        with open(os.path.join(cfg["base"], f"recovered-rank{r}.json")) as f:
            got = json.load(f)
        seen.add((got["step"], got["run"]))
        os.unlink(os.path.join(cfg["base"], f"recovered-rank{r}.json"))
    assert len(seen) == 1, f"the ranks recovered different steps or values: {seen}"
    return seen.pop()


def _done_before_kill(cfg: dict) -> int | None:
    """The last step whose local save (replication included) the killed job finished."""
    path = os.path.join(cfg["base"], "progress")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        done = [int(line.split()[1]) for line in f if line.startswith("local ")]
    return max(done, default=None)


def _recover(cfg: dict, hosts: list[str], runs: list[int], scratch: str, **job) -> tuple[int | None, int | None]:
    """Run a recovering job on ``hosts`` (one rank each); check it loaded what the oracle says."""
    local = _complete_local(cfg, sorted(set(hosts)), runs, scratch)
    want = _oracle(local, _check_persistent(cfg, runs))
    job_cfg = {**cfg, "host_of_rank": hosts, "recover": True, "runs": runs, **job}
    codes = tier_jobs.run(len(hosts), job_cfg)
    assert codes == [0] * len(hosts), f"the recovering job on {hosts} failed: {codes}"
    got = _recovered(cfg, len(hosts))
    assert got == want, f"recovered {got} on {hosts}; the hosts and the root hold {want} (local: {local})"
    return got


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(CASES))
def test_a_job_killed_at_random_recovers_its_last_good_step_at_any_world_size(seed, tmp_path):
    plan = _plan(seed)
    rph = plan["rph"]
    hosts = [f"host{r // rph}" for r in range(2 * rph)]
    cfg = {
        "base": str(tmp_path / "hosts"),
        "root": str(tmp_path / "persist"),
        "ranks_per_host": rph,
        "persist_every": plan["persist_every"],
        "timeout": 20,
    }
    codes = tier_jobs.run(2 * rph, {**cfg, "steps": STEPS, "start_at": plan["start_at"]}, kill=plan["kill"])
    assert all(codes[r] in (-9, 0) for r in plan["kill"]["ranks"]), f"{plan}: {codes}"
    for host in sorted(set(hosts)):
        _check_holdings(cfg, host)
    if plan["lost"] is not None:  # the host's memory is gone with it
        shutil.rmtree(os.path.join(cfg["base"], plan["lost"]))
    floor = max(
        (s for s in (_done_before_kill(cfg), max(_check_persistent(cfg, [0]), default=None)) if s is not None),
        default=None,
    )
    scratch = str(tmp_path / "scratch")
    print(f"seed {seed}: {plan}, exit codes {codes}, finished before the kill: {floor}")
    for phase, on in (("same world size", hosts), ("smaller world size", plan["smaller"])):
        step, run = _recover(cfg, on, [0], os.path.join(scratch, phase))
        assert floor is None or (step is not None and step >= floor), (
            f"{plan}, {phase}: recovered step {step}, but step {floor} was finished before the kill"
        )
        assert run == (None if step is None else 0)
        print(f"  {phase}: recovered step {step}")
    # the smaller job saves two more steps (values of run 1), ends cleanly; the whole job comes back
    first, _ = _recover(cfg, plan["smaller"], [0], os.path.join(scratch, "again"), run=1, then_save=2)
    last = (first or 0) + 2
    for host in sorted(set(hosts)):
        _check_holdings(cfg, host)
    step, run = _recover(cfg, hosts, [0, 1], os.path.join(scratch, "after"))
    assert step is not None and step >= last, f"{plan}: the steps {last - 1}, {last} saved by the smaller job are lost"
    if step == last:
        assert run == 1, f"{plan}: step {last} recovered from the earlier run's copies, not the newest save"
