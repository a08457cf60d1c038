"""Real multi-process save and load-time resharding (gloo, 2-4 processes)."""

from __future__ import annotations

import pytest
import torch

import bcp
import dist_jobs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """A checkpoint saved by FSDP2 over 2 ranks, and its full reference."""
    d = tmp_path_factory.mktemp("fsdp2")
    uri, ref = str(d / "ck"), str(d / "ref.pt")
    dist_jobs.spawn(dist_jobs.save_sharded_job, 2, "fsdp", uri, ref)
    return uri, ref


def test_fsdp2_save_and_same_layout_reload_continues_bitwise(fsdp2):
    uri, _ref = fsdp2
    manifest = bcp.open(uri).manifest
    assert manifest.world_size == 2 and len(manifest.data_files) == 2


def test_fsdp2_two_to_three_ranks(fsdp2):
    uri, ref = fsdp2
    dist_jobs.spawn(dist_jobs.load_sharded_job, 3, "fsdp", uri, ref)


def test_fsdp2_three_to_two_ranks(tmp_path):
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.save_sharded_job, 3, "fsdp", uri, ref)
    dist_jobs.spawn(dist_jobs.load_sharded_job, 2, "fsdp", uri, ref)


def test_2d_fsdp_tp_four_ranks_to_fsdp2_two_and_to_one_process(tmp_path):
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.save_sharded_job, 4, "2d", uri, ref)
    dist_jobs.spawn(dist_jobs.load_sharded_job, 2, "fsdp", uri, ref)
    # 4 ranks -> 1 process: full tensors straight from the catalog
    reference = dist_jobs.flatten_tensors(torch.load(ref, weights_only=True))
    reader = bcp.open(uri)
    assert reader.manifest.world_size == 4
    for fqn, want in reference.items():
        assert torch.equal(reader.read(fqn), want), f"{fqn} differs when read in one process"


def test_ddp_two_to_three_ranks_with_per_rank_dataloader_state(tmp_path):
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.ddp_save_job, 2, uri, ref)
    reader = bcp.open(uri)
    assert sorted(reader.per_rank_objects("loader")) == [0, 1]
    assert not reader.is_per_rank("step")
    dist_jobs.spawn(dist_jobs.ddp_load_job, 3, uri, ref, 2)
    dist_jobs.spawn(dist_jobs.ddp_load_job, 2, uri, ref, 2)  # same world size: each rank its own


@pytest.mark.parametrize("share", [True, False])
def test_zero_redundant_load_reads_each_byte_once(tmp_path, share):
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.ddp_save_job, 2, uri, ref)
    dist_jobs.spawn(dist_jobs.shared_read_job, 3, uri, ref, share)


def test_a_malformed_share_part_is_refused_on_every_rank_before_any_exchange(tmp_path):
    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.ddp_save_job, 2, uri, ref)
    dist_jobs.spawn(dist_jobs.malformed_share_part_job, 3, uri, ref)


def test_a_failing_rank_means_no_commit_and_an_error_on_every_rank(tmp_path):
    dist_jobs.spawn(dist_jobs.failing_rank_job, 2, str(tmp_path / "ck"))


def test_a_rank_that_never_joins_times_out_instead_of_hanging(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_COLLECTIVE_TIMEOUT", "5")
    dist_jobs.spawn(dist_jobs.missing_rank_job, 2, str(tmp_path / "ck"))


def test_dtensor_checkpoint_loads_into_flat_shards(fsdp2):
    uri, ref = fsdp2
    dist_jobs.spawn(dist_jobs.load_as_flat_shards_job, 3, uri, ref)


def test_async_saves_in_flight_across_ranks(tmp_path):
    dist_jobs.spawn(dist_jobs.async_ping_pong_job, 2, str(tmp_path / "ck"))


def test_errors_keep_their_type_and_fields_across_ranks(tmp_path):
    dist_jobs.spawn(dist_jobs.errors_keep_type_job, 2, str(tmp_path / "ck"))


def test_a_reader_failing_to_open_on_one_rank_raises_on_every_rank(tmp_path):
    dist_jobs.spawn(dist_jobs.open_fails_on_one_rank_job, 2, str(tmp_path / "ck"))


def test_a_catalog_read_in_part_by_every_rank_loads_exactly(tmp_path):
    """Catalog v2 at scale, in miniature: the coordinator shares only the head, each of
    3 ranks reads the sections its FSDP shards need, and training resumes exactly."""
    from bcp.metadata.catalog import sections
    from bcp.metadata.catalog.head import decode_head

    uri, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    dist_jobs.spawn(dist_jobs.small_sections_save_job, 2, "fsdp", uri, ref)
    reader = bcp.open(uri)
    data = reader.backend.read(reader.manifest.catalog.path)
    assert sections.is_v2(data[-sections.TRAILER.size :])
    head_offset, head_crc = sections.read_trailer(data[-sections.TRAILER.size :], len(data), "catalog")
    head = decode_head(
        data[head_offset : -sections.TRAILER.size], head_offset, head_crc, where="catalog", budget=1 << 26
    )
    assert head.sections == 2, f"expected a catalog of 2 sections, got {head.sections}"
    dist_jobs.spawn(dist_jobs.partial_catalog_load_job, 3, "fsdp", uri, ref)


def test_a_strided_shard_is_taken_only_as_fsdp2_makes_it(tmp_path):
    """A hand-made _StridedShard alone: DTensor reports rows 0:4 and 2:6 for rows
    [0, 1, 4, 5] and [2, 3, 6, 7]; a load filled the wrong rows without an error."""
    dist_jobs.spawn(dist_jobs.strided_shard_job, 2, str(tmp_path))
