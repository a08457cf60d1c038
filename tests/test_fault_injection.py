"""Fault injection through a whole save: every backend call of a save fails, one call
at a time, on the file, memory and S3 (moto_server) backends.

A wrapper backend numbers every call the engine makes (``exists``, ``size``,
``read_into``, ``list``, ``write``, ``write_if_absent``, ``open_writer``, ``delete``,
``delete_prefix``, ``unfinished``, ``delete_unfinished`` and the writers' ``write_at``,
``commit`` and ``abort``) and makes call number N raise the error a real backend raises
at that boundary: a :class:`StorageError` chained to ``OSError(EIO)`` (``annotate``).
A first run only counts the K calls of a clean save; then each N in 0..K-1 fails,

* ``before``: the call never reaches the store;
* ``after``: the call takes effect, then raises (the answer was lost: a manifest
  written but reported failed, a data file committed but reported failed).

Three scenarios: a new save into an empty location; an ``overwrite=True`` save over a
committed checkpoint; a ``CheckpointManager(keep_last=1)`` root with one committed step
and the next step's save failing, synchronous and with ``async_save=True`` (then a
fresh manager on the root, whose start-up housekeeping runs, and ``load_latest``).
After each run, through a clean backend:

* the previous checkpoint (if any) loads bit-exactly, unless the new one committed
  and retention rightly removed it;
* the new one either loads completely and bit-exactly or does not exist; a save that
  returned normally committed, and one that raised (other than CommitUncertainError)
  did not;
* after gc (plan_gc/run_gc for a manager root, unused generations for a plain
  checkpoint; a grace of 0 where the functions take one), nothing is left but the
  objects the committed manifests name (and ``latest.json``), counting partial files
  (walked with ``os.walk``) and empty directories on the file backend and unfinished
  multipart uploads on S3.

A second sweep fails a second call during the cleanup that follows the first fault
(the writer's abort, discarding the generation, reading the manifest back after a
failed commit), on the overwrite and manager scenarios, where gc has something to
collect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch

import bcp
from bcp import commit, discovery, retention
from bcp.backends import Backend, ObjectWriter, StorageError, backend_for, join_uri, register_backend
from bcp.backends.file import PARTIAL_MARKER
from bcp.backends.memory import clear_memory_store
from bcp.backends.wrappers import ForwardingBackend, ForwardingWriter
from bcp.errors import CheckpointError, CheckpointNotFoundError, CommitUncertainError, IncompleteCheckpointError
from bcp.metadata.keys import LATEST_KEY, MANIFEST_KEY, step_name
from conftest import new_bucket, store_uri
from helpers import assert_same

# -- the faulty backend ----------------------------------------------------------------------------


class Injector:
    """Numbers calls (0, 1, ...) and fails the chosen ones: those in ``before`` without
    reaching the store, those in ``after`` once the store has done them. Every faulty
    backend reports to the active one (a manager builds one backend per step URI)."""

    def __init__(self, before: Iterable[int] = (), after: Iterable[int] = ()) -> None:
        self.before, self.after = frozenset(before), frozenset(after)
        self.calls: list[tuple[str, str]] = []
        self.injected: list[int] = []
        #: calls pass through uncounted (set-up that is not part of the save)
        self.paused = False
        self._lock = threading.Lock()

    def call(self, uri: str, op: str, key: str, fn: Callable[[], Any]) -> Any:
        if self.paused:
            return fn()
        with self._lock:
            index = len(self.calls)
            self.calls.append((op, key))
            fail = index in self.before or index in self.after
            if fail:
                self.injected.append(index)
        if fail and index in self.before:
            raise _fault(uri, op, key, index)
        result = fn()
        if fail:
            raise _fault(uri, op, key, index)
        return result

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    @classmethod
    def at(cls, n: int, mode: str) -> Injector:
        """One fault at call ``n``, ``before`` or ``after`` its effect."""
        return cls(before={n} if mode == "before" else (), after={n} if mode == "after" else ())


def _fault(uri: str, op: str, key: str, index: int) -> StorageError:
    """What a real backend raises for an I/O error (``errors.annotate``)."""
    cause = OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected at call {index})")
    error = StorageError(cause.strerror or "", uri=uri, key=key, action=op)
    error.__cause__ = cause
    return error


#: The injector that backends built from ``fault+...`` URIs report to; None: pass through.
_active: Injector | None = None


@contextlib.contextmanager
def injecting(injector: Injector) -> Iterator[Injector]:
    global _active
    _active = injector
    try:
        yield injector
    finally:
        _active = None


class FaultyBackend(ForwardingBackend):
    """Every call goes through the active injector. Built around a backend, or from a
    URI: ``fault+memory://...``, ``fault+file:///...``, ``fault+s3://...``."""

    @classmethod
    def from_uri(cls, uri: str, **options):  # type: ignore[override]
        assert uri.startswith("fault+"), uri
        return cls(backend_for(uri[len("fault+") :], **options))

    def _call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        return fn() if _active is None else _active.call(self.uri, op, key, fn)

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        return _FaultyWriter(self, self._call("open_writer", key, lambda: self.inner.open_writer(key, size=size)))

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        return self._call("read_into", key, lambda: self.inner.read_into(key, offset, buffer))

    def size(self, key: str) -> int:
        return self._call("size", key, lambda: self.inner.size(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def write(self, key: str, data) -> None:
        self._call("write", key, lambda: self.inner.write(key, data))

    def write_if_absent(self, key: str, data) -> None:
        self._call("write_if_absent", key, lambda: self.inner.write_if_absent(key, data))

    def delete_prefix(self, prefix: str) -> None:
        self._call("delete_prefix", prefix, lambda: self.inner.delete_prefix(prefix))

    def unfinished(self, prefix: str = ""):
        return iter(self._call("unfinished", prefix, lambda: list(self.inner.unfinished(prefix))))

    def delete_unfinished(self, name: str) -> None:
        self._call("delete_unfinished", name, lambda: self.inner.delete_unfinished(name))


class _FaultyWriter(ForwardingWriter):
    def __init__(self, backend: FaultyBackend, inner: ObjectWriter) -> None:
        super().__init__(inner, uri=backend.uri)
        self.backend = backend

    def _write_at(self, offset: int, data) -> None:
        self.backend._call("write_at", self.key, lambda: self.inner.write_at(offset, data))

    def _commit(self) -> None:
        self.backend._call("commit", self.key, self.inner.commit)

    def _abort(self) -> None:
        self.backend._call("abort", self.key, self.inner.abort)


for _scheme in ("fault+file", "fault+memory", "fault+s3"):
    register_backend(_scheme, FaultyBackend, clobber=True)


#: A directory on the file backend that holds no object of a committed checkpoint is a
#: leftover too (an empty ``step_N/`` or ``gen-*/`` shows in ``ls`` forever; no gc sees it).
EMPTY_DIRECTORIES_ARE_LEFTOVERS = True

# -- storage under test ----------------------------------------------------------------------------


@dataclasses.dataclass
class Store:
    """One backend kind: fresh locations, a clean view, and everything it holds."""

    kind: str
    make_uri: Callable[[str], str]
    #: local directory of a file store's location (to walk it), None elsewhere
    local_dir: Callable[[str], str] | None = None

    def clean(self, uri: str) -> Backend:
        return backend_for(uri)

    def copy(self, source: str, uri: str) -> None:
        """Every object at ``source`` written at ``uri``: a prepared location, made once
        by a real save and copied byte for byte for each run (a save per run cost a
        third of the sweeps' time)."""
        src, dst = self.clean(source), self.clean(uri)
        for key in sorted(src.list("")):
            dst.write(key, src.read(key))

    def faulty_uri(self, uri: str) -> str:
        return uri if uri.startswith("fault+") else f"fault+{uri if '://' in uri else 'file://' + uri}"

    def leftovers(self, uri: str, allowed: set[str]) -> list[str]:
        """Everything at ``uri`` but the ``allowed`` keys: objects, partial files, empty
        directories, unfinished uploads."""
        backend = self.clean(uri)
        found = [f"object {k}" for k in sorted(set(backend.list("")) - allowed)]
        if self.local_dir is not None:
            root = self.local_dir(uri)
            needed = {root} | {os.path.dirname(os.path.join(root, k)) for k in allowed}
            needed |= {p for d in list(needed) for p in _parents(d, root)}
            for dirpath, _dirs, files in os.walk(root):
                rel = os.path.relpath(dirpath, root)
                found += [f"partial file {os.path.join(rel, f)}" for f in files if PARTIAL_MARKER in f]
                if EMPTY_DIRECTORIES_ARE_LEFTOVERS and dirpath not in needed:
                    found.append(f"directory {rel}/ (holds {sorted(files) or 'nothing'})")
        inner = backend.unwrap()
        if hasattr(inner, "pending_uploads"):
            found += [f"unfinished upload {k}" for k in inner.pending_uploads()]
        return found


def _parents(path: str, root: str) -> Iterator[str]:
    while path.startswith(root) and path != root:
        yield path
        path = os.path.dirname(path)


#: The file store's locations: file URIs without fsync. The faults are injected at the
#: backend's calls (which fsync does not change) and nothing crashes, so durability is
#: not what these tests check; each fsync only made the sweeps wait on the disk.
FILE_OPTIONS = "?fsync=false"


def _file_uri(path: Path) -> str:
    return path.as_uri() + FILE_OPTIONS


def _local_path(uri: str) -> str:
    return unquote(urlsplit(uri).path)


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path) -> Iterator[Store]:
    if request.param == "file":
        assert backend_for(_file_uri(tmp_path / "probe")).unwrap().fsync is False, "the file store fsyncs"
        yield Store("file", lambda name: _file_uri(tmp_path / name), local_dir=_local_path)
        return
    name = f"fi{uuid.uuid4().hex[:10]}"
    yield Store("memory", lambda path: f"memory://{name}/{path}")
    clear_memory_store(name)


@pytest.fixture(scope="module")
def fault_bucket(moto_server) -> str:
    return new_bucket(moto_server)


@pytest.fixture
def s3_store(moto_server, fault_bucket) -> Store:
    run = uuid.uuid4().hex[:8]
    return Store("s3", lambda path: store_uri("moto", moto_server, fault_bucket, f"{run}/{path}"))


# -- states ------------------------------------------------------------------------------------------


def make_state(version: int, *, small: bool = False) -> dict:
    g = torch.Generator().manual_seed(version)
    state: dict[str, Any] = {"w": torch.randn(3, 4, generator=g)}
    if not small:
        state["b"] = torch.randint(-(2**40), 2**40, (5,), generator=g, dtype=torch.int64)
    state["meta"] = {"version": version, "name": f"v{version}", "lr": 0.1 * version}
    return state


def template(*, small: bool = False) -> dict:
    state: dict[str, Any] = {"w": torch.zeros(3, 4)}
    if not small:
        state["b"] = torch.zeros(5, dtype=torch.int64)
    state["meta"] = None
    return state


def load_or_absent(uri: str | Backend, small: bool) -> dict | None:
    """The checkpoint's state, or None when there is none (not found or never committed)."""
    try:
        return dict(bcp.load(template(small=small), uri))
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return None


def committed_objects(backend: Backend, prefix: str = "") -> set[str]:
    """The keys a committed checkpoint under ``prefix`` consists of (none if uncommitted)."""
    manifest = commit.read_manifest(backend, prefix)
    if manifest is None:
        return set()
    return {f"{prefix}{MANIFEST_KEY}", f"{prefix}{manifest.catalog.path}"} | {
        f"{prefix}{f.path}" for f in manifest.data_files
    }


def _zero_grace(fn: Callable) -> dict:
    """``grace_seconds=0`` where ``fn`` takes it: gc now, however young the leftovers."""
    params = inspect.signature(fn).parameters
    return {"grace_seconds": 0} if "grace_seconds" in params else {}


def gc_checkpoint(uri: str) -> None:
    """The gc of a plain checkpoint location: the generations its manifest does not use."""
    backend = backend_for(uri)
    for generation in commit.unused_generations(backend, **_zero_grace(commit.unused_generations)):
        commit.delete_generation(backend, generation)


def gc_root(uri: str) -> None:
    backend = backend_for(uri)
    retention.run_gc(backend, retention.plan_gc(backend, keep_last=1, **_zero_grace(retention.plan_gc)))


def _name(key: str) -> str:
    return re.sub(r"gen-[0-9a-f]+", "gen-*", key)


# -- scenarios ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    error: BaseException | None
    calls: list[tuple[str, str]]
    injected: list[int]


class Scenario:
    """prepare(uri) on a clean backend; run(uri) under the injector; check(uri, outcome)."""

    small = False

    def prepare(self, store: Store, uri: str) -> None:
        pass

    def run(self, store: Store, uri: str) -> None:
        raise NotImplementedError

    def check(self, store: Store, uri: str, out: Outcome) -> list[str]:
        raise NotImplementedError


def _documented(error: BaseException | None) -> list[str]:
    if error is None or isinstance(error, (OSError, CheckpointError)):
        return []
    return [f"the save raised {type(error).__name__} ({error}), neither a StorageError nor a CheckpointError"]


class NewSave(Scenario):
    """(a) a new save into an empty location."""

    def run(self, store, uri):
        bcp.save(make_state(2, small=self.small), FaultyBackend(store.clean(uri)))

    def check(self, store, uri, out):
        problems = _documented(out.error)
        try:
            new = load_or_absent(uri, self.small)
        except Exception as e:  # noqa: BLE001 - reported
            return [*problems, f"the location neither loads nor is absent: {type(e).__name__}: {e}"]
        problems += _answer_matches(out.error, new is not None)
        if new is not None:
            problems += _same(make_state(2, small=self.small), new, "the new checkpoint")
        gc_checkpoint(uri)
        problems += [f"left after gc: {x}" for x in store.leftovers(uri, committed_objects(store.clean(uri)))]
        return problems


class Overwrite(Scenario):
    """(b) an overwrite=True save over a committed checkpoint."""

    def prepare(self, store, uri):
        bcp.save(make_state(1, small=self.small), uri)

    def run(self, store, uri):
        bcp.save(make_state(2, small=self.small), FaultyBackend(store.clean(uri)), overwrite=True)

    def check(self, store, uri, out):
        problems = _documented(out.error)
        try:
            found = load_or_absent(uri, self.small)
        except Exception as e:  # noqa: BLE001 - reported
            return [*problems, f"the location does not load: {type(e).__name__}: {e}"]
        if found is None:
            return [*problems, "no checkpoint left at the location (the old one was lost)"]
        is_new = found["meta"] == make_state(2, small=self.small)["meta"]
        problems += _answer_matches(out.error, is_new)
        problems += _same(make_state(2 if is_new else 1, small=self.small), found, "new" if is_new else "old")
        gc_checkpoint(uri)
        problems += [f"left after gc: {x}" for x in store.leftovers(uri, committed_objects(store.clean(uri)))]
        return problems


class ManagerNextStep(Scenario):
    """(c) CheckpointManager(keep_last=1) with step 1 committed; step 2's save fails."""

    async_save = False

    def prepare(self, store, uri):
        bcp.CheckpointManager(uri, keep_last=1, async_save=False).save(1, make_state(1, small=self.small))

    def run(self, store, uri):
        assert _active is not None
        with _active.pause():  # the manager's start-up housekeeping is not part of the save
            manager = bcp.CheckpointManager(store.faulty_uri(uri), keep_last=1, async_save=self.async_save)
        manager.save(2, make_state(2, small=self.small))
        manager.wait()

    def check(self, store, uri, out):
        problems = _documented(out.error)
        step2 = join_uri(uri, step_name(2))
        try:
            fresh = bcp.CheckpointManager(uri, keep_last=1, async_save=False)  # start-up housekeeping
            step, state = fresh.load_latest(template(small=self.small))
        except Exception as e:  # noqa: BLE001 - reported
            return [*problems, f"a fresh manager cannot load the latest step: {type(e).__name__}: {e}"]
        if out.error is None and step != 2:
            problems.append(f"manager.save returned normally but the latest step is {step}")
        if step not in (1, 2):
            return [*problems, f"the latest step is {step}, not 1 or 2"]
        problems += _same(make_state(step, small=self.small), dict(state), f"step {step}")
        try:
            if step == 1 and load_or_absent(step2, self.small) is not None:
                problems.append("step 2 loads but is not the latest")
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"step 2 neither loads nor is absent: {type(e).__name__}: {e}")
        clean = store.clean(uri)
        if commit.read_manifest(clean, f"{step_name(step)}/") is None:
            problems.append(f"step {step} has no manifest")
        latest = clean.read(LATEST_KEY) if clean.exists(LATEST_KEY) else b""
        if f'"step": {step}'.encode() not in latest:
            problems.append(f"latest.json is {latest!r}, not step {step}")
        gc_root(uri)
        if discovery.committed_steps(clean) != [step]:
            problems.append(f"committed steps after gc: {discovery.committed_steps(clean)}, expected [{step}]")
        allowed = {LATEST_KEY} | committed_objects(clean, f"{step_name(step)}/")
        problems += [f"left after gc: {x}" for x in store.leftovers(uri, allowed)]
        return problems


def _answer_matches(error: BaseException | None, committed: bool) -> list[str]:
    if error is None and not committed:
        return ["the save returned normally but nothing new is committed"]
    if error is not None and committed and not isinstance(error, CommitUncertainError):
        return [f"the save raised {type(error).__name__} but its checkpoint is committed: {error}"]
    return []


def _same(expected: dict, got: dict, what: str) -> list[str]:
    try:
        assert_same(expected, got, what)
    except AssertionError as e:
        return [f"{what} is not bit-exact: {e}"]
    return []


class ManagerNextStepAsync(ManagerNextStep):
    """(c) with async_save=True: step 2 is written in the background, and its error
    (if any) comes out of ``wait``."""

    async_save = True


SCENARIOS = {"new": NewSave, "overwrite": Overwrite, "manager": ManagerNextStep, "manager-async": ManagerNextStepAsync}


def run_once(scenario: Scenario, store: Store, uri: str, injector: Injector, prepared: str | None = None) -> Outcome:
    """One run at ``uri``: prepared by the scenario, or a copy of the location ``prepared`` it prepared."""
    if prepared is None:
        scenario.prepare(store, uri)
    else:
        store.copy(prepared, uri)
    error = None
    with injecting(injector):
        try:
            scenario.run(store, uri)
        except Exception as e:  # noqa: BLE001 - judged by check()
            error = e
    return Outcome(error, list(injector.calls), list(injector.injected))


def count_calls(scenario: Scenario, store: Store) -> list[tuple[str, str]]:
    uri = store.make_uri("count")
    out = run_once(scenario, store, uri, Injector())
    assert out.error is None, f"the clean run failed: {out.error!r}"
    problems = scenario.check(store, uri, out)
    assert not problems, f"the clean run: {problems}"
    return out.calls


def prepared(scenario: Scenario, store: Store) -> str:
    """A location the scenario prepared, for the runs to copy (``run_once``)."""
    uri = store.make_uri("prepared")
    scenario.prepare(store, uri)
    return uri


def sweep(scenario: Scenario, store: Store, subtests, mode: str) -> int:
    """Fail each call of a clean run in turn; returns how many runs were made."""
    calls = count_calls(scenario, store)
    source = prepared(scenario, store)
    ops = {(op, key.rsplit("/", 1)[-1]) for op, key in calls}
    assert {("open_writer", "rank00000-0.bin"), ("commit", "rank00000-0.bin")} <= ops, f"no data file in {calls}"
    assert ops & {("write", MANIFEST_KEY), ("write_if_absent", MANIFEST_KEY)}, f"no manifest write in {calls}"
    for n, (op, key) in enumerate(calls):
        uri = store.make_uri(f"{mode}{n}")
        out = run_once(scenario, store, uri, Injector.at(n, mode), source)
        with subtests.test(msg=f"{mode} call {n}: {op} {_name(key)}", call=n):
            assert out.injected == [n], f"call {n} was not reached: {[c[0] for c in out.calls]}"
            assert out.calls[n][0] == op, f"call {n} is {out.calls[n]} in this run, {op} in the clean one"
            problems = scenario.check(store, uri, out)
            error = f"{type(out.error).__name__}: {out.error}" if out.error else "returned normally"
            assert not problems, f"save {error}\n  " + "\n  ".join(problems)
    return len(calls)


# -- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_one_fault_at_every_call(store, scenario, mode, subtests):
    sweep(SCENARIOS[scenario](), store, subtests, mode)


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("scenario", ["new", "overwrite"])
def test_one_fault_at_every_call_s3(s3_store, scenario, mode, subtests):
    """One tensor; the manager's housekeeping is storage-independent and swept on the
    local backends (on moto it costs ~0.7 s a run)."""
    sc = SCENARIOS[scenario]()
    sc.small = True
    sweep(sc, s3_store, subtests, mode)


@pytest.mark.parametrize("first", ["before", "after"])
@pytest.mark.parametrize("scenario", ["overwrite", "manager"])
def test_second_fault_during_cleanup(store, scenario, first, subtests):
    """The first fault at call N (before or after its effect), then a second one at each
    call M > N that the failing run made (its cleanup, read-backs), before its effect."""
    sc = SCENARIOS[scenario]()
    calls = count_calls(sc, store)
    source = prepared(sc, store)
    for n in range(len(calls)):
        uri = store.make_uri(f"probe{n}")
        probe = run_once(sc, store, uri, Injector.at(n, first), source)
        for m in range(n + 1, len(probe.calls)):
            uri = store.make_uri(f"{first}{n}-{m}")
            injector = Injector(before={m, n} if first == "before" else {m}, after={n} if first == "after" else ())
            out = run_once(sc, store, uri, injector, source)
            label = f"{first} call {n} ({calls[n][0]} {_name(calls[n][1])}), then call {m}"
            with subtests.test(msg=f"{label} ({probe.calls[m][0]} {_name(probe.calls[m][1])})"):
                assert out.injected == [n, m], f"calls {n} and {m} were not both reached: {out.calls}"
                problems = sc.check(store, uri, out)
                error = f"{type(out.error).__name__}: {out.error}" if out.error else "returned normally"
                assert not problems, f"save {error}\n  " + "\n  ".join(problems)
