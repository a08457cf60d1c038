"""Local steps laid out per docs/tiers.md, and multi-process recovery jobs, for
tests/test_tiers_recover.py.

The local steps are built without the tier's save code: an ordinary ``bcp.save`` on
4 gloo ranks into a shared directory, then :func:`lay_out` copies it into per-host
local roots (manifest, catalog, the host's ranks' data files, replicas of other
hosts' shares, ``holding.json``). Simulated hosts are processes with their own
``BCP_HOST_ID`` and local root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import shutil

import torch
import torch.distributed as dist

import bcp
from bcp.backends import backend_for
from bcp.metadata import Manifest
from bcp.metadata.keys import MANIFEST_KEY, step_name
from bcp.tiers.holding import add_held
from bcp.tiers.job import job_identity, stamp
from bcp.tiers.paths import HOLDING_NAME, local_root
from dist_jobs import assert_equal_to_reference, full_reference, restore, sharded_model, sharded_state, train

_RANK = re.compile(r"rank(\d+)-\d+\.bin$")
LOCAL_STEP = 10
PERSISTENT_STEP = 5


def manifest_of(ckpt: str) -> Manifest:
    with open(os.path.join(ckpt, MANIFEST_KEY), "rb") as f:
        return Manifest.from_json(f.read(), where=ckpt)


def files_of_ranks(manifest: Manifest, ranks: list[int]) -> list[str]:
    """The manifest's data file paths written by ``ranks``."""
    out = []
    for f in manifest.data_files:
        m = _RANK.search(f.path)
        assert m, f.path
        if int(m.group(1)) in ranks:
            out.append(f.path)
    return out


def lay_out(
    ckpt: str,
    roots: list[str],
    host_ranks: list[list[int]],
    *,
    replicas: int = 1,
    lost: tuple[int, ...] = (),
    step: int = LOCAL_STEP,
    job: str | None = None,
) -> None:
    """Copy the checkpoint ``ckpt`` into the local root of each host as the local tier
    would leave it: host ``h`` holds its ranks' data files and, for ``replicas`` = k,
    the shares of hosts h-1 .. h-k (a share goes to the next hosts). Lost hosts get
    an empty root. Existing contents of a root are kept (other steps). ``job``: the
    job id (bcp.tiers.job) stamped on each root and step, as a tier of that job would."""
    manifest = manifest_of(ckpt)
    n = len(roots)
    for h, root in enumerate(roots):
        os.makedirs(root, exist_ok=True)
        if job is not None:
            stamp(root, job)
        if h in lost:
            continue
        dst = os.path.join(root, step_name(step))
        os.makedirs(os.path.join(dst, manifest.generation, "data"), exist_ok=True)
        if job is not None:
            stamp(dst, job)
        owners = [h] + [(h - k) % n for k in range(1, replicas + 1) if (h - k) % n != h]
        files = [f for o in dict.fromkeys(owners) for f in files_of_ranks(manifest, host_ranks[o])]
        for f in files:
            shutil.copyfile(os.path.join(ckpt, f), os.path.join(dst, f))
        shutil.copyfile(os.path.join(ckpt, manifest.catalog.path), os.path.join(dst, manifest.catalog.path))
        write_holding(dst, manifest, files)
        shutil.copyfile(os.path.join(ckpt, MANIFEST_KEY), os.path.join(dst, MANIFEST_KEY))


def write_holding(step_dir: str, manifest: Manifest, files: list[str], *, save_id: str | None = None) -> None:
    """The step's ``holding.json`` listing exactly ``files`` (manifest paths) with the
    manifest's entries, written by the tier's own writer; ``save_id``: claim another save's."""
    entries = {f.path: f for f in manifest.data_files}
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(step_dir, HOLDING_NAME))
    add_held(step_dir, save_id or manifest.save_id, [entries[f] for f in files])


# -- the saved states -------------------------------------------------------------------------


def template(world: int):
    """An FSDP2 model and AdamW at ``world`` ranks, and the state bcp saves and loads:
    DTensor shards (model and optimizer), a plain replicated tensor, objects."""
    model, opt = sharded_model(world, "fsdp")
    state = sharded_state(model, opt)
    state["extra"] = {"plain": torch.zeros(300, dtype=torch.float64), "note": "", "step": -1}
    return model, opt, state


def _extra(step: int) -> dict:
    return {"plain": torch.arange(300, dtype=torch.float64) * step + 0.5, "note": f"step {step}", "step": step}


def save_job(rank: int, world: int, out: str) -> None:
    """Save step 5 to a persistent manager root, step 10 (save X) and a later save of
    step 10 with other values (save Y) into plain directories; write the references."""
    model, opt, _state = template(world)
    train(model, opt, range(2), rank)
    manager = bcp.CheckpointManager(os.path.join(out, "persistent"), async_save=False)
    manager.save(PERSISTENT_STEP, {**sharded_state(model, opt), "extra": _extra(PERSISTENT_STEP)})
    ref = full_reference(model, opt)  # collective: every rank takes part
    if rank == 0:
        torch.save({**ref, "extra": _extra(PERSISTENT_STEP)}, os.path.join(out, "ref5.pt"))
    train(model, opt, range(2, 3), rank)
    bcp.save({**sharded_state(model, opt), "extra": _extra(LOCAL_STEP)}, os.path.join(out, "x"))
    ref = full_reference(model, opt)
    if rank == 0:
        torch.save({**ref, "extra": _extra(LOCAL_STEP)}, os.path.join(out, "ref10.pt"))
    train(model, opt, range(3, 4), rank)
    bcp.save({**sharded_state(model, opt), "extra": _extra(LOCAL_STEP + 1)}, os.path.join(out, "y"))


# -- recovery scenarios ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    #: BCP_HOST_ID of each rank of the recovering job
    host_of_rank: tuple[str, ...]
    #: local root of each host id
    roots: dict[str, str]
    persistent_root: str
    #: "local" or "persistent": the tier the step must come from
    expect: str
    ref: str = ""
    #: through CheckpointManager.load_latest (else recover_latest_with_info)
    via_manager: bool = True
    #: recover_latest_with_info's bound on a round (small: many rounds of small pieces)
    round_bytes: int | None = None
    #: every host holds every file: assert the recovery's object collectives and that no directory is built
    all_held: bool = False


def scenarios_job(rank: int, world: int, scenarios: list[Scenario]) -> None:
    for sc in scenarios:
        os.environ["BCP_HOST_ID"] = sc.host_of_rank[rank]
        root = sc.roots[sc.host_of_rank[rank]]
        try:
            _run(rank, world, sc, root)
        except BaseException as e:
            e.add_note(f"scenario {sc.name!r}, rank {rank} of {world}")
            raise
        dist.barrier()  # the host's first rank removes the directory once its load is done
        leftovers = [n for n in os.listdir(root) if n.startswith("recover-")] if os.path.isdir(root) else []
        assert not leftovers, f"{sc.name}: recovery directories left in {root}: {leftovers}"


def _run(rank: int, world: int, sc: Scenario, root: str) -> None:
    from bcp.coordination.lanes import coordinator_for
    from bcp.tiers.recover import recover_latest_with_info

    model, opt, state = template(world)
    # root is <dir>/bcp/<job> (bcp.tiers.paths.local_root): the tier finds it from its dir
    tier = bcp.LocalTier(keep_free=0.0, dir=os.path.dirname(os.path.dirname(root)), persist_every=None)
    manager = bcp.CheckpointManager(sc.persistent_root, async_save=False, tier=tier)
    if sc.via_manager and sc.all_held:
        counts = _counted(lambda: manager.load_latest(state))
        step, loaded = counts.pop("result")
        # the choice and the chosen step's metadata travel in one broadcast; every rank agrees
        # with all-reduces only: no metadata broadcast by the load, no all_gather of requests
        assert counts.get("broadcast_object_list", 0) == 1, f"{sc.name}: rank {rank}: {counts}"
        assert counts.get("all_gather_object", 0) == 0, f"{sc.name}: rank {rank}: {counts}"
        # no more collective calls than a load of a step from the persistent root: the inventory's
        # gather and the choice's broadcast stand for the latest step's and the metadata's
        # broadcasts, and no round follows the load's last (whose agreement covers the recovery's)
        from_root = bcp.CheckpointManager(sc.persistent_root, async_save=False)
        plain = _counted(lambda: from_root.load_latest(template(world)[2]))
        from_root.close()
        assert plain.pop("result")[0] == PERSISTENT_STEP
        recovery_calls, plain_calls = sum(counts.values()), sum(plain.values())
        assert recovery_calls <= plain_calls == 7, f"{sc.name}: rank {rank}: recovery {counts}, plain load {plain}"
    elif sc.via_manager:
        step, loaded = manager.load_latest(state)
    else:
        bounds = {} if sc.round_bytes is None else {"round_bytes": sc.round_bytes, "chunk_bytes": sc.round_bytes // 2}
        info = recover_latest_with_info(
            state, local_root=root, persistent_root=sc.persistent_root, coord=coordinator_for(None), **bounds
        )
        assert info is not None, f"{sc.name}: the local tier was not chosen"
        step, loaded = info.step, info.state
        everyone = [None] * world
        dist.all_gather_object(everyone, (info.bytes_received, info.bytes_sent, info.rounds))
        received = sum(r for r, _s, _n in everyone)
        sent = sum(s for _r, s, _n in everyone)
        assert received == sent > 0, f"{sc.name}: bytes received {received} != sent {sent} (or none moved)"
        if sc.round_bytes is not None:
            rounds = max(n for _r, _s, n in everyone)
            assert rounds >= received // sc.round_bytes > 1, f"{sc.name}: {received} bytes in {rounds} rounds"
    want = LOCAL_STEP if sc.expect == "local" else PERSISTENT_STEP
    assert step == want, f"{sc.name}: loaded step {step}, expected {want} ({sc.expect})"
    restore(model, opt, loaded)
    ref = torch.load(sc.ref, weights_only=True)
    extra = ref.pop("extra")
    assert_equal_to_reference(full_reference(model, opt), ref, f"{sc.name}: rank {rank}")
    assert torch.equal(loaded["extra"]["plain"], extra["plain"]), f"{sc.name}: plain tensor differs"
    assert loaded["extra"]["note"] == extra["note"] and loaded["extra"]["step"] == extra["step"]


def _counted(call) -> dict:
    """``call()``'s result (key "result") and how many times it called each of
    torch.distributed's collectives (object ones, all-reduce, barrier), with no recovery
    directory built."""
    import bcp.tiers.recover as recover

    counts: dict = {}
    names = (
        "broadcast_object_list",
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
        "all_reduce",
        "barrier",
    )
    saved = {n: getattr(dist, n) for n in names}
    saved_prepare = recover.prepare

    def counting(name: str):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return saved[name](*args, **kwargs)

        return wrapper

    def no_directory(*_args, **_kwargs):
        raise AssertionError("a recovery directory was built though every host holds every file")

    for n in names:
        setattr(dist, n, counting(n))
    recover.prepare = no_directory
    try:
        counts["result"] = call()
    finally:
        for n in names:
            setattr(dist, n, saved[n])
        recover.prepare = saved_prepare
    return counts


# -- uneven reshards: only the bytes the load reads move --------------------------------------------

#: (global shape, sharded dim, cut points at 4 ranks): uneven row and column shards
UNEVEN = {
    "rows": ((37, 5), 0, (0, 11, 19, 30, 37)),
    "cols": ((13, 29), 1, (0, 2, 15, 16, 29)),
    "flat": ((203,), 0, (0, 90, 91, 150, 203)),
}
#: cut points of the recovering jobs (3 and 2 ranks), uneven and off the saved ones
UNEVEN_AT = {
    3: {"rows": (0, 5, 23, 37), "cols": (0, 10, 11, 29), "flat": (0, 1, 120, 203)},
    2: {"rows": (0, 20, 37), "cols": (0, 7, 29), "flat": (0, 100, 203)},
}
UNEVEN_BLOCK = 64  # checksum block bytes: many blocks per fragment, partial ones at every cut


def uneven_full(name: str) -> torch.Tensor:
    """The whole tensor ``name``: distinct nonzero values (no block of them is all zeros)."""
    shape, _dim, _cuts = UNEVEN[name]
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * 1.25 + 1).reshape(shape)


def uneven_state(rank: int, cuts_of: dict[str, tuple[int, ...]], *, empty: bool = False) -> dict:
    """This rank's shard of each UNEVEN tensor under ``cuts_of`` (zeros when ``empty``)."""
    out: dict = {}
    for name, (shape, dim, _cuts) in UNEVEN.items():
        lo, hi = cuts_of[name][rank], cuts_of[name][rank + 1]
        part = uneven_full(name).narrow(dim, lo, hi - lo).contiguous()
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        out[name] = bcp.TensorShard(torch.zeros_like(part) if empty else part, shape, offsets)
    return out


def uneven_save_job(rank: int, world: int, out: str) -> None:
    bcp.save(uneven_state(rank, {k: v[2] for k, v in UNEVEN.items()}), out, checksum_block_bytes=UNEVEN_BLOCK)


def uneven_recover_job(rank: int, world: int, hosts: tuple[str, ...], roots: dict[str, str]) -> None:
    """:func:`uneven_recover`, then again with one range dropped."""
    for drop in (False, True):
        uneven_recover(rank, world, hosts, roots, drop)
        dist.barrier()


def uneven_recover(rank: int, world: int, hosts: tuple[str, ...], roots: dict[str, str], drop: bool) -> None:
    """Recover the uneven checkpoint at ``world`` ranks on ``hosts``: bit-exact, and the
    rank of the new host (the last) receives exactly the bytes its load reads (its
    runs and the rest of the checksum blocks they touch) and no more than the writers'
    padding besides; with ``drop``, one range
    that rank needs is left out of the exchange and every rank's load must fail on
    its checksum, never read the hole as zeros."""
    from bcp.coordination.lanes import coordinator_for
    from bcp.tiers.exchange import Exchange
    from bcp.tiers.recover import recover_latest_with_info

    os.environ["BCP_HOST_ID"] = hosts[rank]
    newcomer = world - 1
    if drop:
        planned = Exchange.plan

        def plan_without_one(self: Exchange, requests: list) -> None:
            planned(self, requests)
            for pieces in self.rounds_of:  # the same on every rank: each drops the same piece
                mine = [p for p in pieces if p.receiver == newcomer]
                if mine:
                    pieces.remove(mine[len(mine) // 2])
                    return

        Exchange.plan = plan_without_one  # type: ignore[method-assign]
    template = uneven_state(rank, UNEVEN_AT[world], empty=True)
    try:
        info = recover_latest_with_info(
            template, local_root=roots[hosts[rank]], persistent_root=None, coord=coordinator_for(None)
        )
    except (bcp.CorruptCheckpointError, bcp.RankFailedError) as e:
        text = str(e) + "".join(getattr(e, "__notes__", []))
        assert drop and "checksum mismatch" in text, text
        return
    assert not drop, "a range left out of the exchange was loaded without an error"
    assert info is not None, "the local tier was not chosen"
    for name, want in uneven_state(rank, UNEVEN_AT[world]).items():
        assert torch.equal(info.state[name].local, want.local), f"{name} differs on rank {rank} of {world}"
    reads = info.load.bytes_read + info.load.verify_bytes
    if rank == newcomer:
        # the load's reads, and at most the writers' padding between fragments, which its
        # coalesced reads span (fetched so that no read waits for the end of the exchange)
        with bcp.open(os.path.join(roots[hosts[0]], step_name(LOCAL_STEP))) as saved:
            padding = sum(f.nbytes for f in saved.manifest.data_files) - sum(f.nbytes for f in saved.catalog.fragments)
        assert 0 < reads <= info.bytes_received <= reads + padding, (info.bytes_received, padding, info.load)
    else:
        assert info.bytes_received == 0, "host A holds every file (its own and B's replica)"


# -- a corrupt local copy: quarantined, then another copy or the persistent tier ---------------------


def rows_state(rank: int, world: int, seed: int, *, empty: bool = False) -> dict:
    """Rank ``rank``'s rows of an 8 x 8 tensor whose values depend on ``seed``, and the seed."""
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8) * seed + 1
    rows = 8 // world
    part = full[rank * rows : (rank + 1) * rows].clone()
    shard = bcp.TensorShard(torch.zeros_like(part) if empty else part, (8, 8), (rank * rows, 0))
    return {"w": shard, "step": -1 if empty else seed}


class Records(logging.Handler):
    """The WARNING records of bcp's loggers, while installed (``with Records() as r``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)

    def __enter__(self) -> Records:
        logging.getLogger("bcp").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("bcp").removeHandler(self)


def _host_and_steps(rank: int, world: int, out: str) -> tuple[str, str, str]:
    """2 ranks, each its own host (BCP_HOST_ID A, B): persistent step 5 saved under
    ``out`` and step 10's checkpoint to lay out. (this rank's host, the persistent root,
    step 10's checkpoint)."""
    host = "AB"[rank]
    os.environ["BCP_HOST_ID"] = host
    persistent = os.path.join(out, "persistent")
    bcp.CheckpointManager(persistent, async_save=False).save(PERSISTENT_STEP, rows_state(rank, world, PERSISTENT_STEP))
    saved = os.path.join(out, "x")
    bcp.save(rows_state(rank, world, LOCAL_STEP), saved)
    return host, persistent, saved


def corrupt_copy_job(rank: int, world: int, out: str) -> None:
    """2 ranks, each its own host (A, B): persistent step 5, local step 10 laid out
    with one replica and without, and one flipped byte in rank 0's own data file on
    host A (inside its tensor). Both ranks load through ``load_latest`` together:
    with the replica, step 10 exactly (rank 0's rows from B's copy); without, the
    persistent step 5. Host A's WARNING names the real bad file, which is moved
    aside; a second start loads the same step without tripping on it."""
    host, persistent, saved = _host_and_steps(rank, world, out)
    manifest = manifest_of(saved)
    own = files_of_ranks(manifest, [0])[0]
    for replicas, want in ((1, LOCAL_STEP), (0, PERSISTENT_STEP)):
        dirs = {h: os.path.join(out, f"replicas{replicas}", h) for h in "AB"}
        roots = [local_root(dirs[h], persistent) for h in "AB"]
        bad = os.path.join(roots[0], step_name(LOCAL_STEP), own)
        if rank == 0:  # stamped with the persistent root's job id, as the tier of this job would
            lay_out(saved, roots, [[0], [1]], replicas=replicas, job=job_identity(backend_for(persistent)))
            with open(bad, "r+b") as f:
                data = f.read()
                at = data.find(rows_state(0, world, LOCAL_STEP)["w"].local.numpy().tobytes())
                assert at >= 0, "rank 0's rows are in its data file"
                f.seek(at + 5)
                f.write(bytes([data[at + 5] ^ 0x10]))
        dist.barrier()
        where = f"replicas={replicas}, rank {rank}"
        first, second = _two_starts(rank, world, persistent, dirs[host], want, where)
        if rank == 0:  # host A's first rank, and the coordinator
            assert bad in first and f"quarantined as {bad}.quarantined" in first, f"{where}: {first}"
            assert "recover-" not in first, f"{where}: a message names the removed recovery directory: {first}"
        assert "quarantined" not in second and "checksum" not in second, f"{where}: tripped again: {second}"
        assert not os.path.exists(bad) and os.path.exists(bad + ".quarantined"), where


def _crosswise(rank: int, world: int, out: str) -> tuple[str, str, list[str], Manifest]:
    """2 ranks, each its own host (BCP_HOST_ID A, B): persistent step 5 and local step 10
    laid out with no replicas, host A holding rank 1's data file and host B rank 0's, so
    each rank's rows come from the other host in the exchange. (persistent root, this
    host's tier dir, the local roots, step 10's manifest)."""
    host, persistent, saved = _host_and_steps(rank, world, out)
    dirs = {h: os.path.join(out, "shm", h) for h in "AB"}
    roots = [local_root(dirs[h], persistent) for h in "AB"]
    if rank == 0:
        lay_out(saved, roots, [[1], [0]], replicas=0, job=job_identity(backend_for(persistent)))
    dist.barrier()
    return persistent, dirs[host], roots, manifest_of(saved)


def _two_starts(rank: int, world: int, persistent: str, tier_dir: str, want: int, where: str = "") -> list[str]:
    """Both ranks start twice with the tier of ``tier_dir``: each start loads step
    ``want`` exactly. The WARNING text of each start."""
    tier = bcp.LocalTier(keep_free=0.0, dir=tier_dir, persist_every=None)
    texts = []
    for start in ("first", "second"):
        manager = bcp.CheckpointManager(persistent, async_save=False, tier=tier)
        with Records() as records:
            step, loaded = manager.load_latest(rows_state(rank, world, 0, empty=True))
        at = f"{where} {start} start, rank {rank}"
        assert step == want, f"{at}: loaded step {step}, expected {want}"
        assert torch.equal(loaded["w"].local, rows_state(rank, world, want)["w"].local), f"{at}: wrong values"
        assert loaded["step"] == want, at
        texts.append(records.text())
        dist.barrier()
    return texts


def unreadable_copy_job(rank: int, world: int, out: str) -> None:
    """:func:`_crosswise`, and every open of B's copy of rank 0's file fails with EIO (a
    failing disk): B quarantines it and both ranks load persistent step 5, on the first
    start and the next (which does not trip on it)."""
    persistent, tier_dir, roots, manifest = _crosswise(rank, world, out)
    bad = os.path.join(roots[1], step_name(LOCAL_STEP), files_of_ranks(manifest, [0])[0])
    real_open = os.open

    def failing(path, *args, **kwargs):  # host B's disk, for the file it serves
        if os.fspath(path) == bad:
            raise OSError(errno.EIO, "Input/output error (injected)", bad)
        return real_open(path, *args, **kwargs)

    if rank == 1:
        os.open = failing
    try:
        first, _second = _two_starts(rank, world, persistent, tier_dir, PERSISTENT_STEP)
    finally:
        os.open = real_open
    if rank == 1:
        assert f"quarantined as {bad}.quarantined" in first, first
    assert not os.path.exists(bad) and os.path.exists(bad + ".quarantined")


def unchanged_incremental_job(rank: int, world: int, out: str) -> None:
    """2 ranks, each its own host, incremental local steps, no replicas: step 2 changed
    nothing, so its manifest refers to step 1's files only and no data file of its own
    lies beside its catalog. Both starts recover step 2 exactly (the recovery directory
    makes the catalog's folder itself)."""
    os.environ["BCP_HOST_ID"] = "AB"[rank]
    persistent = os.path.join(out, "persistent")
    tier = bcp.LocalTier(
        keep_free=0.0, dir=os.path.join(out, "shm", "AB"[rank]), replicas=0, persist_every=None, incremental=True
    )
    state = rows_state(rank, world, 7)
    with bcp.CheckpointManager(persistent, async_save=False, tier=tier) as manager:
        manager.save(1, state)
        manager.save(2, state)
    dist.barrier()
    for start in ("first", "second"):
        step, loaded = bcp.CheckpointManager(persistent, async_save=False, tier=tier).load_latest(
            rows_state(rank, world, 0, empty=True)
        )
        assert step == 2 and torch.equal(loaded["w"].local, state["w"].local), f"{start} start, rank {rank}: {step}"
        dist.barrier()


def full_host_job(rank: int, world: int, out: str) -> None:
    """:func:`_crosswise`, and host A's file system is full (every write of fetched bytes
    fails with ENOSPC). Both ranks load persistent step 5 with a WARNING saying why, on
    both starts, and nothing is quarantined: a full ``/dev/shm`` used to stop every start."""
    persistent, tier_dir, _roots, _manifest = _crosswise(rank, world, out)
    real_pwritev = os.pwritev

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    if rank == 0:
        os.pwritev = full
    try:
        texts = _two_starts(rank, world, persistent, tier_dir, PERSISTENT_STEP)
    finally:
        os.pwritev = real_pwritev
    for text in texts if rank == 0 else []:
        assert "no room for the recovery directory" in text and "quarantined" not in text, text
    assert not any(name.endswith(".quarantined") for _d, _s, files in os.walk(out) for name in files)
