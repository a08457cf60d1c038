"""After a local save's commit (in its background thread, on every rank): spread
the metadata to every host, record this rank's share, replicate, and clean up.

1. The coordinator's manifest and catalog bytes go to every rank (one broadcast);
   the first rank of each other host writes the catalog, then the manifest: a host's
   copy of the step exists once its manifest does.
2. Each rank checks its own data file (size and digest, recomputed from the bytes
   on its host) and lists it in the step's ``holding.json``.
3. Replication (``replicate.py``); the ranks then agree that it ran everywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

from bcp.backends import Backend
from bcp.commit import parse_manifest
from bcp.coordination.collectives import Coordinator, decide, run_phase
from bcp.metadata import Catalog, Manifest
from bcp.metadata.keys import data_file_key, manifest_key, step_name
from bcp.reader import fetch_metadata
from bcp.tiers.holding import add_held, file_spans, held_files, verify
from bcp.tiers.hosts import HostMap
from bcp.tiers.incremental_local import base_generations, carry_references, private_holds, write_holds
from bcp.tiers.replicate import replicate

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LocalStep:
    """A committed local step as every rank knows it after the metadata is spread."""

    step: int
    manifest: Manifest
    manifest_bytes: bytes
    catalog_bytes: bytes
    #: each data file's fragments (byte offset, bytes), in file order
    spans: dict[str, list[tuple[int, int]]]


def spread_metadata(coord: Coordinator, backend: Backend, step: int) -> LocalStep:
    """(all ranks, collective) Every rank gets the coordinator's manifest and catalog bytes."""

    # the coordinator reads; every rank gets the bytes, or the coordinator's error
    metadata = decide(coord, "spreading the local step", fetch_metadata, backend)
    manifest = parse_manifest(backend, metadata.manifest)
    catalog = Catalog.from_arrow(
        metadata.catalog,
        where=f"{backend.uri}/{manifest.catalog.path}",
        checksum_block_bytes=manifest.checksum_block_bytes,
    )
    return LocalStep(step, manifest, metadata.manifest, metadata.catalog, file_spans(catalog))


def write_metadata(
    coord: Coordinator,
    hosts: HostMap,
    backend: Backend,
    local: LocalStep,
    holds: Sequence[tuple[str, str]] = (),
    root: str = "",
) -> None:
    """Each other host's first rank writes the step's holds (an incremental step's, on
    the generations ``holds`` of its siblings: FORMAT.md's order, before the manifest),
    its catalog, then its manifest."""
    if hosts.is_first(coord.rank) and hosts.host_of(coord.rank) != hosts.host_of(0):
        if holds:
            write_holds(root, local.manifest, step_name(local.step), holds)
        backend.write(local.manifest.catalog.path, local.catalog_bytes)
        backend.write(manifest_key(), local.manifest_bytes)


def record_own(rank: int, local: LocalStep, step_dir: str) -> bool:
    """Check this rank's data file and list it in ``holding.json``; False (and a
    WARNING) when it does not match the manifest, or when the rank wrote none."""
    m = local.manifest
    entry = {f.path: f for f in m.data_files}.get(data_file_key(m.generation, rank))
    if entry is None:
        return False
    problem = verify(os.path.join(step_dir, *entry.path.split("/")), entry, local.spans, m.checksum_block_bytes)
    if problem is not None:
        log.warning("local tier: rank %d's own data file %s is not kept: %s", rank, entry.path, problem)
        return False
    add_held(step_dir, m.save_id, [entry])
    return True


def holds_own_files(hosts: HostMap, rank: int, local: LocalStep, step_dir: str) -> bool:
    """(a host's first rank, after every rank of it ran :func:`record_own`) Whether the
    host holds the data file of each of its ranks that wrote one: else local retention
    keeps the older steps (a step this host cannot serve must not replace them)."""
    m = local.manifest
    written = {f.path for f in m.data_files}
    ranks = hosts.ranks[hosts.host_of(rank)]
    own = {key for r in ranks if (key := data_file_key(m.generation, r)) in written}
    return own <= set(held_files(step_dir, m.save_id))


def after_commit(
    coord: Coordinator,
    hosts: HostMap,
    replicas: int,
    chunk_bytes: int,
    backend: Backend,
    step_dir: str,
    step: int,
    base: int | None = None,
) -> LocalStep:
    """(all ranks, collective) Steps 1-3 above; returns the step as every rank knows it.
    ``base``: the local step an incremental save referred to (``incremental_local.py``)."""
    started = time.perf_counter()
    local = spread_metadata(coord, backend, step)
    root = os.path.dirname(os.path.normpath(step_dir))
    holds = base_generations(root, base) if base is not None else []

    def record() -> None:
        write_metadata(coord, hosts, backend, local, holds, root)
        if hosts.is_first(coord.rank):
            if hosts.host_of(coord.rank) == hosts.host_of(0):
                private_holds(root, local.manifest, step_name(local.step), holds)  # the save's coordinator wrote them
            if base is not None:
                carry_references(root, local.manifest, step_name(local.step), base)
        record_own(coord.rank, local, step_dir)

    run_phase(coord, "spreading the local step", record)  # a failure on one rank raises on all
    recorded = time.perf_counter()
    error: BaseException | None = None
    received: list[str] = []
    try:
        received = replicate(coord, hosts, replicas, local.manifest, backend, step_dir, local.spans, chunk_bytes)
    except Exception as e:  # noqa: BLE001 - agreed below: every rank raises
        error = e
    coord.check(error, "replicating the local step")
    sizes = {f.path: f.nbytes for f in local.manifest.data_files}
    log.info(
        "local tier: step %d spread and checked in %.3f s, %d replica(s) (%.1f MiB) received in %.3f s",
        step,
        recorded - started,
        len(received),
        sum(sizes[k] for k in received) / 2**20,
        time.perf_counter() - recorded,
    )
    return local
