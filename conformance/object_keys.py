"""Object-contract groups about keys: what is listed, deleted and exists, which
names are valid, and how a missing object is reported."""

from __future__ import annotations

from typing import ClassVar

import pytest

from bcp.backends import Backend, ObjectNotFoundError
from bcp.conformance.object_base import (
    INVALID_KEYS,
    KEYED_OPS,
    READ_OPS,
    ObjectContractBase,
    check_bytes,
    expect_raises,
)


class ListingTests(ObjectContractBase):
    """``list(prefix)``: string prefixes, each key once, unfinished writes hidden."""

    report_heading = "listing"

    NESTED: ClassVar[list[str]] = ["a", "ab", "abc/x", "abd", "b/ab", "x/abc/y", "x/y/z", "x/ab"]

    def test_list_empty_store_is_empty(self, backend: Backend) -> None:
        assert list(backend.list("")) == [], "list('') of an empty store is not empty"

    def test_list_empty_prefix_lists_all(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("")) == sorted(self.NESTED), "list('') does not return exactly every key"

    def test_list_default_prefix_lists_all(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list()) == sorted(self.NESTED), "list() without a prefix does not return every key"

    def test_list_is_recursive(self, backend: Backend) -> None:
        """bcp keeps every object of a checkpoint two or more levels down
        (``gen-<id>/data/...``): a ``list`` that stops at one level makes every save
        fail its pre-commit check, as if another process had deleted its objects."""
        keys = ["r/top", "r/one/a", "r/one/two/b", "r/one/two/three/c"]
        self._write_all(backend, keys)
        for prefix in ("", "r/", "r/one/"):
            found = sorted(backend.list(prefix))
            want = sorted(k for k in keys if k.startswith(prefix))
            assert found == want, (
                f"list({prefix!r}) returned {found!r}, not {want!r}: list(prefix) must return every key under "
                "the prefix, nested keys included (it must recurse into 'directories')"
            )

    def test_list_directory_prefix(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("x/")) == ["x/ab", "x/abc/y", "x/y/z"], "list('x/') returned wrong keys"

    def test_list_string_prefix_is_not_a_directory(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("ab")) == ["ab", "abc/x", "abd"], (
            "list('ab') must match every key starting with the string 'ab' ('ab', 'abc/x', 'abd')"
        )

    def test_list_string_prefix_inside_directory(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert sorted(backend.list("x/ab")) == ["x/ab", "x/abc/y"], "list('x/ab') returned wrong keys"

    def test_list_prefix_equal_to_a_key(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        assert list(backend.list("x/y/z")) == ["x/y/z"], "list(prefix equal to a key) does not return that key"

    def test_list_prefix_without_matches_is_empty(self, backend: Backend) -> None:
        self._write_all(backend, self.NESTED)
        for prefix in ("nope", "x/q", "abc/x/", "a/"):
            assert list(backend.list(prefix)) == [], f"list({prefix!r}) matched keys although none start with it"

    def test_list_many_keys(self, backend: Backend) -> None:
        keys = [f"many/{i % 7}/k{i:03d}" for i in range(200)]
        self._write_all(backend, keys)
        assert sorted(backend.list("many/")) == sorted(keys), "list of 200 keys did not return exactly those keys"

    @pytest.mark.slow
    def test_list_past_a_page(self, backend: Backend) -> None:
        """More keys than the 1,000 S3 and GCS return a page: a ``list`` that reads one
        page passed every other check (a load would then miss files, gc keep them)."""
        keys = [f"page/k{i:04d}" for i in range(1050)]
        self._write_all(backend, keys)  # one at a time: a store's raw access need not take threads
        found = list(backend.list("page/"))
        assert sorted(found) == keys, f"list of {len(keys)} keys returned {len(found)} (a page of them?)"

    def test_list_returns_each_key_once(self, backend: Backend) -> None:
        keys = [f"dup/{i % 5}/k{i}" for i in range(40)]
        self._write_all(backend, keys)
        found = list(backend.list(""))
        assert len(found) == len(set(found)), "list returned a key more than once"

    def test_list_hides_uncommitted_writer(self, backend: Backend) -> None:
        self.seed(backend, "w/done", b"1")
        with backend.open_writer("w/pending", size=3) as writer:
            writer.write_at(0, b"abc")
            assert sorted(backend.list("")) == ["w/done"], "list shows an object whose writer has not committed"
            writer.abort()

    def test_list_hides_uncommitted_overwrite_duplicates(self, backend: Backend) -> None:
        self.seed(backend, "w/k", b"old")
        with backend.open_writer("w/k", size=3) as writer:
            writer.write_at(0, b"new")
            assert list(backend.list("w/")) == ["w/k"], "list shows a pending overwrite as a second entry"
            writer.abort()


class DeleteTests(ObjectContractBase):
    """``delete`` and ``delete_prefix`` remove exactly what they name."""

    report_heading = "delete"

    def test_delete_removes_object(self, backend: Backend) -> None:
        self.seed(backend, "gone", b"data")
        backend.delete("gone")
        assert not backend.exists("gone"), "exists is True after delete"

    def test_deleted_object_is_not_listed(self, backend: Backend) -> None:
        self.seed(backend, "d/gone", b"data")
        backend.delete("d/gone")
        assert list(backend.list("")) == [], "list shows a deleted object"

    def test_deleted_object_read_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "gone", b"data")
        backend.delete("gone")
        expect_raises(
            FileNotFoundError, "reading a deleted object did not raise FileNotFoundError", lambda: backend.read("gone")
        )

    def test_delete_missing_key_is_not_an_error(self, backend: Backend) -> None:
        try:
            backend.delete("never/was")
        except Exception as e:
            raise AssertionError(f"deleting a missing key raised {type(e).__name__}: {e}") from e

    def test_delete_keeps_siblings(self, backend: Backend) -> None:
        self._write_all(backend, ["s/a", "s/b", "s/c/d"])
        backend.delete("s/b")
        assert sorted(backend.list("")) == ["s/a", "s/c/d"], "delete removed keys other than the one named"

    def test_delete_keeps_keys_it_prefixes(self, backend: Backend) -> None:
        self._write_all(backend, ["p", "p2", "p3/q"])
        backend.delete("p")
        assert sorted(backend.list("")) == ["p2", "p3/q"], "delete('p') removed keys that merely start with 'p'"

    def test_write_after_delete(self, backend: Backend) -> None:
        backend.write("r/e/k", b"one")
        backend.delete("r/e/k")
        backend.write("r/e/k", b"two")
        check_bytes(self.fetch(backend, "r/e/k"), b"two", "writing a key again after deleting it failed")

    def test_delete_prefix_removes_only_keys_under_prefix(self, backend: Backend) -> None:
        self._write_all(backend, ["run/a", "run/b/c", "run/b/d/e", "runner/x", "other", "r"])
        backend.delete_prefix("run/")
        assert sorted(backend.list("")) == ["other", "r", "runner/x"], (
            "delete_prefix('run/') did not remove exactly the keys under 'run/'"
        )

    def test_delete_prefix_without_matches(self, backend: Backend) -> None:
        self._write_all(backend, ["keep/a"])
        backend.delete_prefix("nothing/")
        assert list(backend.list("")) == ["keep/a"], "delete_prefix of an unmatched prefix removed something"


class ExistsTests(ObjectContractBase):
    """``exists``, and keys that are only a prefix of others (directories elsewhere) not being objects."""

    report_heading = "exists, and keys that are only prefixes"

    def test_exists_false_for_missing(self, backend: Backend) -> None:
        assert not backend.exists("missing"), "exists is True for a key never written"

    def test_exists_true_after_write(self, backend: Backend) -> None:
        backend.write("here", b"x")
        assert backend.exists("here"), "exists is False after write"

    def test_exists_false_for_directory_like_prefix(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        assert not backend.exists("dir"), "exists is True for 'dir', which is only a prefix of 'dir/obj'"

    def test_size_of_directory_like_prefix_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        expect_raises(
            ObjectNotFoundError,
            "size('dir') of a mere prefix of 'dir/obj' did not raise ObjectNotFoundError",
            lambda: backend.size("dir"),
        )

    def test_read_into_directory_like_prefix_raises_not_found(self, backend: Backend) -> None:
        self.seed(backend, "dir/obj", b"x")
        expect_raises(
            ObjectNotFoundError,
            "read_into('dir') of a mere prefix of 'dir/obj' did not raise ObjectNotFoundError",
            lambda: backend.read_into("dir", 0, memoryview(bytearray(4))),
        )


class KeyTests(ObjectContractBase):
    """Unicode and deeply nested keys work; invalid keys are refused by every operation."""

    report_heading = "keys: unicode, nesting, invalid names"

    UNICODE_KEY = "données/模型/ключ 🙂.bin"
    DEEP_KEY = "/".join(f"l{i}" for i in range(12)) + "/leaf"

    def test_unicode_key_round_trip(self, backend: Backend) -> None:
        backend.write(self.UNICODE_KEY, b"unicode")
        check_bytes(backend.read(self.UNICODE_KEY), b"unicode", "round trip under a unicode key failed")

    def test_unicode_key_listed(self, backend: Backend) -> None:
        backend.write(self.UNICODE_KEY, b"unicode")
        assert list(backend.list("données/")) == [self.UNICODE_KEY], "list does not return a unicode key unchanged"

    def test_deeply_nested_key_round_trip(self, backend: Backend) -> None:
        backend.write(self.DEEP_KEY, b"deep")
        check_bytes(backend.read(self.DEEP_KEY), b"deep", "round trip under a 12-level key failed")

    def test_deeply_nested_key_listed(self, backend: Backend) -> None:
        backend.write(self.DEEP_KEY, b"deep")
        assert list(backend.list("l0/l1/")) == [self.DEEP_KEY], "list does not return a 12-level key"

    @pytest.mark.parametrize("op", sorted(KEYED_OPS))
    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_key_rejected(self, backend: Backend, key: str, op: str) -> None:
        expect_raises(
            ValueError,
            f"{op} accepted the invalid key {key!r} (must raise ValueError)",
            lambda: KEYED_OPS[op](backend, key),
        )


class MissingObjectTests(ObjectContractBase):
    """Reading a missing object raises ``ObjectNotFoundError`` (a ``FileNotFoundError``) naming the key."""

    report_heading = "missing objects"

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_raises_file_not_found(self, backend: Backend, op: str) -> None:
        expect_raises(
            FileNotFoundError,
            f"{op} of a missing object did not raise FileNotFoundError",
            lambda: READ_OPS[op](backend, "no/such/key"),
        )

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_raises_object_not_found(self, backend: Backend, op: str) -> None:
        expect_raises(
            ObjectNotFoundError,
            f"{op} of a missing object did not raise bcp.backends.ObjectNotFoundError",
            lambda: READ_OPS[op](backend, "no/such/key"),
        )

    @pytest.mark.parametrize("op", sorted(READ_OPS))
    def test_missing_object_error_names_key(self, backend: Backend, op: str) -> None:
        e = expect_raises(
            FileNotFoundError, f"{op} of a missing object did not raise", lambda: READ_OPS[op](backend, "no/such/key")
        )
        assert "no/such/key" in str(e), f"{op}'s missing-object error does not name the key: {e}"
