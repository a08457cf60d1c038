"""The checkpoint contract: whole checkpoints through a backend, as pytest tests.

Where :class:`~bcp.conformance.BackendContractTests` checks single objects, these
tests check what a training job relies on: a realistic multi-tensor state saves,
loads and reshards bit-exactly; a save killed with SIGKILL midway leaves no
committed checkpoint and the previous one loads intact; checksums catch a corrupted
or truncated object; checkpoints side by side under one prefix do not interfere; an
incremental checkpoint reads its base's bytes, and keeps them through the base's deletion;
the backend for ``ROOT/sub`` sees ROOT's objects under ``sub/`` (the sub-URI rule,
which CheckpointManager relies on).

Use it like the object contract: subclass :class:`CheckpointContractTests` and
override the ``store_uri`` fixture to return a URI (with any query options) of an
empty location in your store; each test works in its own sub-prefix of it.
Cross-process tests need a store that other processes can see (they skip for
``memory://``).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import overload

import pytest
import torch

import bcp
from bcp.backends import Backend, backend_for, join_uri, split_scheme
from bcp.metadata.keys import data_file_key, generation_name

#: How long the killed-save tests wait for the child to start writing.
CHILD_TIMEOUT = 120.0


def realistic_state(seed: int = 0, scale: int = 1) -> dict:
    """A small model-and-optimizer-like state: several dtypes and shapes, nested
    containers, a tied weight, scalars, per-step objects. ``scale`` multiplies the
    big matrices (``scale=8`` is about 40 MiB)."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(512 * scale, 256, generator=g)
    model = {
        "embed.weight": emb,
        "blocks.0.attn.qkv.weight": torch.randn(768, 256, generator=g).to(torch.bfloat16),
        "blocks.0.attn.qkv.bias": torch.randn(768, generator=g).to(torch.bfloat16),
        "blocks.0.mlp.fc.weight": torch.randn(1024 * scale, 256, generator=g).half(),
        "blocks.0.norm.weight": torch.ones(256),
        "lm_head.weight": emb,  # tied: stored once
        "position_ids": torch.arange(0, 2048, dtype=torch.int64),
        "mask": torch.rand(64, 64, generator=g) > 0.5,
    }
    optim = {
        "state": {
            i: {
                "step": torch.tensor(float(100 + i)),
                "exp_avg": torch.randn(64, 33, generator=g),
                "exp_avg_sq": torch.rand(64, 33, generator=g),
            }
            for i in range(5)
        },
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(range(5))}],
    }
    return {
        "model": model,
        "optim": optim,
        "step": 1234,
        "scaler": {"scale": 65536.0, "growth": 2000},
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


@overload
def template_like(state: Mapping[str, object]) -> dict[str, object]: ...
@overload
def template_like(state: object) -> object: ...
def template_like(state: object) -> object:
    """Same structure, tensors zeroed, objects blanked: what a resuming job passes."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: template_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [template_like(v) for v in state]
    return None


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values in row-major order, as a flat uint8 tensor (on the CPU)."""
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two tensors are bit for bit the same: dtype, shape and raw bytes. Unlike
    ``torch.equal``, a NaN equals the same NaN, and -0.0 differs from 0.0."""
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(raw_bytes(got), raw_bytes(want))


def assert_same(got: object, want: object, where: str = "state") -> None:
    """``got`` is ``want`` after a round trip: the same containers and objects, and
    tensors bit for bit (:func:`same_bytes`)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: expected a {want.dtype} tensor of shape {tuple(want.shape)}, got {got!r:.80}"
        )
        assert same_bytes(got, want), f"{where}: tensor bytes differ after the round trip"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(map(str, got)) == set(map(str, want)), f"{where}: keys differ"
        lookup = {str(k): v for k, v in got.items()}
        for k, v in want.items():
            assert_same(lookup[str(k)], v, f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: length differs"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _search_roots(modules: list[str]) -> list[str]:
    """The directories ``modules`` were imported from (so a child process finds them
    even where this process found them through a path the child lacks)."""
    roots = []
    for name in modules:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if not path:
            continue
        root = os.path.dirname(os.path.abspath(path))
        depth = name.count(".") + (os.path.basename(path) == "__init__.py")
        for _ in range(depth):
            root = os.path.dirname(root)
        roots.append(root)
    return list(dict.fromkeys(roots))


def _bcp_dir() -> str:
    """The directory of the bcp package this process runs (the child must run the same)."""
    return os.path.dirname(os.path.realpath(bcp.__file__))


def _child_failure(returncode: int | None, stderr: str, imports: list[str]) -> str:
    """Why the child never started writing: its last error line first (the report
    shows only the first line), with a hint where the error says what to do, then the
    end of its stderr."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no output on stderr"
    hint = ""
    if "unknown storage scheme" in last:
        hint = (
            " (the child cannot find the backend: if a module registers it at import time, run with "
            "--import MODULE (bcp conformance), --bcp-import MODULE (pytest) or name it in child_imports)"
        )
    elif "No module named 'bcp" in last:
        hint = (
            f" (the child did not import the bcp this run uses, from {_bcp_dir()}: a folder named bcp on "
            "PYTHONPATH shadows it; take it off PYTHONPATH)"
        )
    tail = "\n".join(lines[-60:])
    return (
        f"the child save never started writing (exit status {returncode}): {last}{hint}; "
        f"the child imported {imports or 'no plugin modules'}; its stderr ends:\n{tail}"
    )


def listing_problem(uri: str) -> str | None:
    """What is wrong with the store's ``list`` for checkpoints, or None. Every save
    lists its generation before it commits (objects two levels down), so a ``list``
    that does not recurse fails every checkpoint check, with a message blaming other
    processes for deleting objects: the checkpoint checks ask this first and say so."""
    backend = backend_for(uri)
    keys = ["bcp-list-check/gen-0/data/k", "bcp-list-check/top"]
    try:
        for key in keys:
            backend.write(key, b"x")
        found = sorted(backend.list("bcp-list-check/"))
    finally:
        for key in keys:
            backend.delete(key)
    if found == sorted(keys):
        return None
    return (
        f"list() did not return nested keys: see test_list_is_recursive (after writing {keys!r}, "
        f"list('bcp-list-check/') returned {found!r}); every save lists its objects before it commits, "
        "so no checkpoint check can pass until list() recurses"
    )


class CheckpointContractTests:
    """Base class of a store's checkpoint tests. Not collected itself."""

    #: The heading the conformance report shows these tests under (see report.heading_of).
    report_heading = "checkpoints: save, load, reshard, killed saves, corruption"

    #: Multiplier for the state size in the round-trip tests.
    state_scale: int = 1

    #: Modules the killed-save child process imports before it opens the store: set
    #: it when your backend is registered at import time by a module that is not an
    #: installed plugin (modules imported with ``import_plugins``/``--import`` are
    #: passed on already).
    child_imports: tuple[str, ...] = ()

    @pytest.fixture
    def store_uri(self) -> str:
        """URI of an empty location in the store under test."""
        raise NotImplementedError("override the `store_uri` fixture to point the suite at your store")

    @pytest.fixture
    def root(self, store_uri: str) -> Iterator[str]:
        uri = join_uri(store_uri, f"ckpt-contract-{uuid.uuid4().hex[:12]}")
        problem = listing_problem(uri)
        if problem:
            pytest.fail(problem, pytrace=False)
        yield uri
        try:
            backend_for(uri).delete_prefix("")
        except Exception:  # noqa: BLE001 - cleanup must not hide the test's own result
            pass

    def _cross_process(self, uri: str) -> None:
        if split_scheme(uri)[0] == "memory":
            pytest.skip("memory:// stores live inside one process; a killed process cannot leave anything there")

    # -- round trips ----------------------------------------------------------------------

    def test_save_load_round_trip(self, root: str) -> None:
        state = realistic_state(scale=self.state_scale)
        info = bcp.save(state, join_uri(root, "ck"))
        assert info.tensors > 0
        got = bcp.load(template_like(state), join_uri(root, "ck"))
        assert_same(got, state)

    def test_open_reads_tensors_slices_and_objects_without_a_template(self, root: str) -> None:
        state = realistic_state(scale=self.state_scale)
        bcp.save(state, join_uri(root, "ck"))
        reader = bcp.open(join_uri(root, "ck"))
        want = state["model"]["blocks.0.mlp.fc.weight"]
        got = reader.read("model.blocks.0.mlp.fc.weight", box=((5, 7), (100, 9)))  # (offsets, lengths)
        assert same_bytes(got, want[5:105, 7:16]), "a box read returned the wrong slice"
        assert reader.state()["step"] == 1234 and reader.state()["scaler"] == state["scaler"]

    def test_reshard_on_load(self, root: str) -> None:
        """Load the checkpoint as 3 row shards (as 3 ranks would) and as column shards."""
        state = realistic_state(scale=self.state_scale)
        bcp.save(state, join_uri(root, "ck"))
        emb = state["model"]["embed.weight"]
        rows = emb.shape[0]
        bounds = [0, rows // 3, 2 * rows // 3, rows]
        for lo, hi in itertools.pairwise(bounds):
            local = torch.empty(hi - lo, emb.shape[1])
            bcp.load(
                {"model": {"embed.weight": bcp.TensorShard(local, offsets=(lo, 0), global_shape=emb.shape)}},
                join_uri(root, "ck"),
                strict=False,
            )
            assert same_bytes(local, emb[lo:hi]), f"row shard {lo}:{hi} differs"
        local = torch.empty(rows, 100)
        bcp.load(
            {"model": {"embed.weight": bcp.TensorShard(local, offsets=(0, 156), global_shape=emb.shape)}},
            join_uri(root, "ck"),
            strict=False,
        )
        assert same_bytes(local, emb[:, 156:]), "column shard differs"

    def test_checkpoints_side_by_side_do_not_interfere(self, root: str) -> None:
        a, b = realistic_state(seed=1), realistic_state(seed=2)
        bcp.save(a, join_uri(root, "run"))
        bcp.save(b, join_uri(root, "run2"))  # its name starts with the other's
        bcp.save({"x": torch.ones(3)}, join_uri(root, "run/nested"))
        assert_same(bcp.load(template_like(a), join_uri(root, "run")), a, "run")
        assert_same(bcp.load(template_like(b), join_uri(root, "run2")), b, "run2")

    def test_sub_uri_sees_the_roots_objects_under_sub(self, root: str) -> None:
        """The sub-URI rule: the backend for ``ROOT/sub`` sees exactly ROOT's objects
        under ``sub/``, and the reverse. CheckpointManager lists steps through ROOT and
        saves and loads each through ``ROOT/step_...``."""
        parent = backend_for(root)
        parent.write("sub/x", b"written through the root")
        sub = backend_for(join_uri(root, "sub"))
        assert sorted(sub.list("")) == ["x"], (
            f"sub-URI rule: the backend for ROOT/sub lists {sorted(sub.list(''))!r}, not ['x'], "
            "after ROOT's backend wrote 'sub/x' (CheckpointManager depends on this)"
        )
        assert sub.read("x") == b"written through the root", "sub-URI rule: ROOT/sub reads other bytes at 'x'"
        sub.write("y", b"written through the sub-URI")
        assert parent.exists("sub/y") and parent.read("sub/y") == b"written through the sub-URI", (
            "sub-URI rule: an object written at 'y' through ROOT/sub is not 'sub/y' under ROOT"
        )
        assert sorted(parent.list("sub/")) == ["sub/x", "sub/y"], f"ROOT lists {sorted(parent.list('sub/'))!r}"

    def test_incremental_checkpoint_reads_its_base_and_outlives_its_deletion(self, root: str) -> None:
        """An incremental save (``base=``) refers to its sibling's stored bytes: its
        references are reads of the base's keys through the parent URI. It loads
        exactly, also once the base is deleted (the base's bytes stay, retired, for it),
        and deleting it then collects them."""
        g = torch.Generator().manual_seed(7)
        state = {"frozen": torch.randn(256, 64, generator=g), "trained": torch.randn(64, 64, generator=g)}
        base, step = join_uri(root, "step_1"), join_uri(root, "step_2")
        bcp.save(state, base, incremental=True, piece_bytes=16 << 10)
        state["trained"][3:5] += 1.0
        bcp.save(state, step, base=base, piece_bytes=16 << 10)
        manifest = bcp.open(step).manifest
        assert {f.checkpoint for f in manifest.references} == {"step_1"}, "the save wrote its base's bytes again"
        assert_same(bcp.load(template_like(state), step), state, "the incremental checkpoint")
        bcp.delete(base)
        with pytest.raises((bcp.IncompleteCheckpointError, bcp.CheckpointNotFoundError)):
            bcp.open(base)  # no checkpoint any more: what is left are the bytes step_2 reads
        assert_same(bcp.load(template_like(state), step), state, "the incremental checkpoint after its base's deletion")
        parent = backend_for(root)
        assert any(k.startswith("step_1/") for k in parent.list("step_1/")), "the referenced bytes were deleted"
        bcp.delete(step)
        assert list(parent.list("step_")) == [], f"left behind: {sorted(parent.list('step_'))}"

    def test_overwrite_needs_consent_and_replaces(self, root: str) -> None:
        uri = join_uri(root, "ck")
        bcp.save({"x": torch.zeros(10)}, uri)
        with pytest.raises(bcp.CheckpointExistsError):
            bcp.save({"x": torch.ones(10)}, uri)
        assert same_bytes(bcp.load({"x": torch.empty(10)}, uri)["x"], torch.zeros(10)), (
            "a refused save changed the committed checkpoint"
        )
        bcp.save({"x": torch.ones(10)}, uri, overwrite=True)
        assert same_bytes(bcp.load({"x": torch.empty(10)}, uri)["x"], torch.ones(10))

    def test_location_without_manifest_is_not_a_checkpoint(self, root: str) -> None:
        uri = join_uri(root, "half")
        backend_for(uri).write(data_file_key(generation_name("0000"), 0), b"\0" * 100)
        with pytest.raises(bcp.IncompleteCheckpointError):
            bcp.open(uri)
        with pytest.raises(bcp.CheckpointNotFoundError):
            bcp.open(join_uri(root, "never-written"))

    # -- integrity ----------------------------------------------------------------------

    @staticmethod
    def _data_key(backend: Backend) -> str:
        keys = sorted(k for k in backend.list("") if k.endswith(".bin"))
        assert keys, "the checkpoint has no data objects"
        return keys[0]

    def test_checksum_catches_a_corrupted_object(self, root: str) -> None:
        uri = join_uri(root, "ck")
        w = torch.randn(300, 300, generator=torch.Generator().manual_seed(3))
        bcp.save({"w": w}, uri)
        backend = backend_for(uri)
        key = self._data_key(backend)
        raw = bytearray(backend.read(key))
        raw[len(raw) // 2] ^= 0x40
        backend.write(key, raw)
        with pytest.raises(bcp.CorruptCheckpointError, match="'w'"):
            bcp.load({"w": torch.empty(300, 300)}, uri)

    def test_truncated_object_is_caught(self, root: str) -> None:
        uri = join_uri(root, "ck")
        bcp.save({"w": torch.randn(300, 300)}, uri)
        backend = backend_for(uri)
        key = self._data_key(backend)
        backend.write(key, backend.read(key)[:1000])
        # caught by the size check before reading (bcp names the file and both sizes), by a
        # short read, or by a checksum naming the tensor; never a silent load
        with pytest.raises(bcp.CorruptCheckpointError, match=r"truncated|'w'|holds \d+ bytes; the manifest says \d+"):
            bcp.load({"w": torch.empty(300, 300)}, uri)

    # -- killed saves -------------------------------------------------------------------

    def _child_imports(self) -> list[str]:
        """Modules the killed-save child imports before opening the URI: those the
        run imported (``bcp conformance --import``, ``--bcp-import``) and this class's
        :attr:`child_imports`."""
        from bcp.backends.registry import imported_plugins

        return list(dict.fromkeys([*imported_plugins(), *self.child_imports]))

    def _kill_midway(self, uri: str, *, overwrite: bool) -> None:
        """Start a save in a child process, SIGKILL it once data is being written."""
        imports = self._child_imports()
        options = json.dumps(
            {"overwrite": overwrite, "imports": imports, "paths": _search_roots(imports), "bcp": _bcp_dir()}
        )
        # -P: the current directory is not put on sys.path, so a bcp/ folder there (a clone
        # beside the plugin) cannot shadow the installed package. The plugins' directories
        # reach the child in `options`, added to its sys.path only after bcp is imported.
        cmd = [sys.executable, "-P", "-m", "bcp.conformance.killed_save", uri, options]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = child.stdout, child.stderr
        assert stdout is not None and stderr is not None  # both are pipes
        try:
            deadline = time.monotonic() + CHILD_TIMEOUT
            line = ""
            while time.monotonic() < deadline:
                line = stdout.readline()
                if line.strip() == "WRITING" or not line:
                    break
            if line.strip() != "WRITING":
                child.kill()
                _out, err = child.communicate(timeout=30)
                raise AssertionError(_child_failure(child.returncode, err, imports))
            time.sleep(0.2)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            stdout.close()
            stderr.close()
        assert child.returncode == -signal.SIGKILL, f"the child save ended by itself ({child.returncode})"

    @pytest.mark.slow
    def test_killed_save_leaves_no_committed_checkpoint(self, root: str) -> None:
        self._cross_process(root)
        uri = join_uri(root, "killed")
        self._kill_midway(uri, overwrite=False)
        with pytest.raises((bcp.IncompleteCheckpointError, bcp.CheckpointNotFoundError)):
            bcp.open(uri)

    @pytest.mark.slow
    def test_killed_overwrite_keeps_the_previous_checkpoint(self, root: str) -> None:
        self._cross_process(root)
        uri = join_uri(root, "ck")
        previous = realistic_state(seed=5)
        bcp.save(previous, uri)
        self._kill_midway(uri, overwrite=True)
        assert_same(bcp.load(template_like(previous), uri), previous, "the previous checkpoint")
