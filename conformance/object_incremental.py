"""Object-contract group: what an incremental store relies on (metadata/FORMAT.md,
"References" and "Holds").

An incremental checkpoint's references are plain reads of *other* keys of the store: a
checkpoint at ``ROOT/step_2`` reads ``step_1/gen-<id>/data/...`` through the backend of
``ROOT``, by byte ranges, while other saves list, create and delete keys beside them.
Holds are empty objects under ``<checkpoint>/gen-<id>/holds/`` that deletion lists
before it deletes a generation. Nothing here needs a server-side copy."""

from __future__ import annotations

from bcp.backends import Backend, ObjectNotFoundError
from bcp.conformance.object_base import ObjectContractBase, check_bytes, expect_raises, in_threads, payload

#: Two checkpoints of one manager root, the newer reading the older's data file.
OLD_DATA = "step_1/gen-0a1b/data/rank00000-0.bin"
NEW_DATA = "step_2/gen-0c2d/data/rank00000-0.bin"
HOLD = "step_1/gen-0a1b/holds/step_2.0c2d"


class IncrementalStoreTests(ObjectContractBase):
    """Keys of sibling checkpoints: ranged reads of another checkpoint's file, listings
    that contain ``holds/``, empty objects, and deleting a generation beside readers."""

    report_heading = "incremental stores (references and holds)"

    def test_ranged_reads_of_a_file_written_by_another_checkpoint(self, backend: Backend) -> None:
        """A reference reads byte ranges of a sibling's data file (a catalog row's
        ``byte_offset`` and ``nbytes``), after the sibling wrote it and while the
        referring checkpoint writes its own file beside it."""
        old = payload(300_001, seed=11)
        self.seed(backend, OLD_DATA, old)
        backend.write(NEW_DATA, payload(1000, seed=12))
        assert backend.size(OLD_DATA) == len(old), "size() of a sibling checkpoint's file is wrong"
        for offset, n in ((0, 4096), (4096, 65536), (299_000, 1001), (123_457, 1), (0, len(old))):
            check_bytes(
                backend.read(OLD_DATA, offset, n), old[offset : offset + n], f"read({offset}, {n}) of a sibling's file"
            )
            buf = bytearray(n)
            backend.read_exact(OLD_DATA, offset, memoryview(buf))
            check_bytes(buf, old[offset : offset + n], f"read_exact({offset}, {n}) of a sibling's file")
        with backend.reading(OLD_DATA) as read_at:  # the loader reads several rows through one handle
            for offset in (200_000, 10, 150_000):
                buf = bytearray(777)
                read_at(offset, memoryview(buf))
                check_bytes(buf, old[offset : offset + 777], f"reading() at {offset} of a sibling's file")
        check_bytes(self.fetch(backend, NEW_DATA), payload(1000, seed=12), "the referring checkpoint's own file")

    def test_a_key_under_a_sibling_prefix_is_its_own_object(self, backend: Backend) -> None:
        """``step_1/...`` and ``step_10/...`` are different checkpoints: reads, sizes and
        listings never mix keys whose names share a string prefix."""
        self.seed(backend, "step_1/gen-1/data/f", b"one")
        self.seed(backend, "step_10/gen-1/data/f", b"ten!")
        assert backend.read("step_1/gen-1/data/f") == b"one" and backend.size("step_10/gen-1/data/f") == 4
        assert sorted(backend.list("step_1/")) == ["step_1/gen-1/data/f"], "list('step_1/') returned step_10's keys"
        assert sorted(backend.list("step_1")) == ["step_1/gen-1/data/f", "step_10/gen-1/data/f"]

    def test_empty_objects_are_created_listed_and_read(self, backend: Backend) -> None:
        """A hold is an empty object: created with ``write`` (or ``write_if_absent``),
        it exists, has size 0, reads as nothing and is listed like any other key."""
        backend.write(HOLD, b"")
        backend.write_if_absent("step_1/gen-0a1b/holds/step_3.0e3f", b"")
        for key in (HOLD, "step_1/gen-0a1b/holds/step_3.0e3f"):
            assert backend.exists(key), f"an empty object {key!r} does not exist after it was written"
            assert backend.size(key) == 0, f"size() of the empty object {key!r} is {backend.size(key)}"
            assert backend.read(key) == b"", f"read() of the empty object {key!r} returned bytes"
            assert self.fetch(backend, key) == b"", f"the store holds bytes at the empty object {key!r}"
        expect_raises(
            FileExistsError,
            "write_if_absent of an existing empty object must refuse (ObjectExistsError)",
            lambda: backend.write_if_absent(HOLD, b""),
        )
        with backend.open_writer("step_1/gen-0a1b/holds/step_4.0f40", size=0) as writer:
            writer.commit()
        assert backend.size("step_1/gen-0a1b/holds/step_4.0f40") == 0, "a writer committed with no bytes"

    def test_listing_a_prefix_that_contains_holds(self, backend: Backend) -> None:
        """Deletion lists a checkpoint's objects, holds included, and then just its
        holds: empty objects are listed like others, and ``holds/`` lists exactly them."""
        self.seed(backend, OLD_DATA, b"data")
        self.seed(backend, "step_1/manifest.json", b"{}")
        holds = [HOLD, "step_1/gen-0a1b/holds/step_3.0e3f", "step_1/gen-0a1b/holds/step_30.1111"]
        for key in holds:
            backend.write(key, b"")
        everything = sorted([OLD_DATA, "step_1/manifest.json", *holds])
        assert sorted(backend.list("step_1/")) == everything, (
            f"list('step_1/') returned {sorted(backend.list('step_1/'))}"
        )
        assert sorted(backend.list("step_1/gen-0a1b/holds/")) == sorted(holds), "list of holds/ is wrong"
        assert sorted(backend.list("step_1/gen-0a1b/holds/step_3")) == sorted(holds[1:]), (
            "list of a string prefix inside holds/ is wrong"
        )
        backend.delete(HOLD)
        assert sorted(backend.list("step_1/gen-0a1b/holds/")) == sorted(holds[1:]), "a deleted hold is still listed"

    def test_deleting_a_generation_while_a_sibling_is_read(self, backend: Backend) -> None:
        """Retention deletes an old generation, object by object, while a load reads a
        newer checkpoint's file: the reads return their bytes, the deletion removes
        exactly its own keys, and a read of a deleted key is ObjectNotFoundError."""
        keep = payload(200_000, seed=21)
        self.seed(backend, NEW_DATA, keep)
        doomed = [f"step_1/gen-0a1b/data/rank{r:05d}-0.bin" for r in range(6)] + [HOLD]
        for i, key in enumerate(doomed):
            self.seed(backend, key, payload(5000, seed=i))

        def work(i: int) -> None:
            if i == 0:
                for key in doomed:
                    backend.delete(key)
                return
            for round_ in range(8):
                offset = (i * 7919 + round_ * 104_729) % (len(keep) - 5000)
                check_bytes(backend.read(NEW_DATA, offset, 5000), keep[offset : offset + 5000], "a sibling's read")

        in_threads(4, work)
        assert sorted(backend.list("step_1/")) == [], "keys of the deleted generation are still listed"
        assert sorted(backend.list("step_")) == [NEW_DATA], "the deletion touched another checkpoint's keys"
        expect_raises(ObjectNotFoundError, "a read of a deleted key", lambda: backend.read(doomed[0], 0, 10))
        check_bytes(self.fetch(backend, NEW_DATA), keep, "the newer checkpoint's file after the deletion")
