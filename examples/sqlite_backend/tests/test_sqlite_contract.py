"""The plugin's own tests: inherit bcp's contracts, override the fixtures."""

from __future__ import annotations

import sqlite3

import pytest
from bcp_sqlite import SQLiteBackend, split_uri

from bcp.backends import backend_for
from bcp.conformance import BackendContractTests, CheckpointContractTests


class TestSQLiteObjects(BackendContractTests):
    @pytest.fixture
    def backend(self, tmp_path):
        b = backend_for(f"sqlite://{tmp_path}/store.db/root")  # found through the entry point
        assert isinstance(b, SQLiteBackend)
        yield b
        b.close()

    # Raw hooks use sqlite3 directly, so reads and writes are each checked on their own.
    def raw_put(self, backend, key, data):
        with sqlite3.connect(backend.path) as db:
            db.execute("INSERT OR REPLACE INTO objects (key, data) VALUES (?, ?)", (f"root/{key}", bytes(data)))

    def raw_get(self, backend, key):
        with sqlite3.connect(backend.path) as db:
            return bytes(db.execute("SELECT data FROM objects WHERE key = ?", (f"root/{key}",)).fetchone()[0])


class TestSQLiteCheckpoints(CheckpointContractTests):
    @pytest.fixture
    def store_uri(self, tmp_path):
        return f"sqlite://{tmp_path}/ckpts.db"


def test_uri_names_the_database_file():
    assert split_uri("sqlite:///data/x/ck.db/run1/step2") == ("/data/x/ck.db", "run1/step2")
    with pytest.raises(ValueError, match="names no database file"):
        split_uri("sqlite:///data/x/run1")
