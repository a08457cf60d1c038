"""The local tier on a shared host (docs/tiers.md, "Security"): a private per-user
directory, files only the user can read, nothing opened or removed through a link or
as a FIFO, and only this job's steps loaded or deleted (issue 36).

The tests run as root: another user's files are made with ``chown``, and what another
user can see is tried in a forked child that drops to that user's uid."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcp
from bcp.metadata.keys import MANIFEST_KEY
from bcp.tiers.holding import add_held
from bcp.tiers.paths import HOLDING_LOCK, HOLDING_NAME, job_name, local_root, step_dir

#: uids of other users (none needs to exist: ownership is a number)
OTHER = 12345
THIRD = 23456
#: a job file naming another job
FOREIGN_ID = b'{"format": "bcp-local-tier-job", "version": 1, "job": "' + b"ab" * 16 + b'"}'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")


def _state(value: float) -> dict:
    return {"w": torch.full((4,), float(value))}


def _template() -> dict:
    return {"w": torch.zeros(4)}


def _manager(root, shm, **tier: Any) -> bcp.CheckpointManager:
    tier.setdefault("persist_every", None)
    return bcp.CheckpointManager(str(root), async_save=False, tier=bcp.LocalTier(keep_free=0.0, dir=str(shm), **tier))


def _tree(top) -> dict[str, Any]:
    """Everything under ``top`` (never following a link): path -> contents, link target or kind."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, top)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    out[rel] = ("file", f.read(), stat.S_IMODE(st.st_mode), st.st_uid)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
    return out


def _outside(path) -> str:
    """A directory that is not the tier's, holding what a wrong delete or write would hit."""
    os.makedirs(os.path.join(path, "step_0000000500"))
    for name in (MANIFEST_KEY, "step_0000000500/" + MANIFEST_KEY, "weights.bin"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"precious " + name.encode())
    return str(path)


def _unblock(top) -> None:
    """Give an EOF to anyone blocked reading a FIFO under ``top`` (so a failing test ends)."""
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _within(seconds: float, fn: Callable[[], Any], top) -> Any:
    """``fn()``'s result (or its exception), failing the test when it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised on the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _unblock(top)
        thread.join(5)
        pytest.fail(f"blocked for over {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


# -- the private directory -------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["user", "job"])
def test_a_link_planted_at_the_local_root_is_refused_and_never_followed(tmp_path, component):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    shm.mkdir()
    elsewhere = _outside(tmp_path / "elsewhere")
    local = local_root(shm, str(root))
    link = os.path.dirname(local) if component == "user" else local
    os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
    os.symlink(elsewhere, link)  # the name is predictable from the root URI
    before = _tree(elsewhere)
    with pytest.raises(PermissionError) as raised:
        _manager(root, shm).save(1, _state(1))
    message = str(raised.value)
    assert "\n" not in message and link in message and "symbolic link" in message and "rm " in message
    assert _tree(elsewhere) == before, "nothing written or deleted through the link"


@pytest.mark.parametrize(
    ("component", "owner", "mode", "why"),
    [
        ("user", OTHER, 0o777, "owned by"),
        ("user", OTHER, 0o700, "owned by"),
        ("user", 0, 0o777, "writable by group or others"),
        ("job", OTHER, 0o755, "owned by"),
        ("job", 0, 0o770, "writable by group or others"),
    ],
)
def test_a_directory_of_another_user_or_writable_by_others_is_refused(tmp_path, component, owner, mode, why):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    shm.mkdir()
    local = local_root(shm, str(root))
    planted = os.path.dirname(local) if component == "user" else local
    os.makedirs(planted)
    os.chown(planted, owner, owner)
    os.chmod(planted, mode)
    with pytest.raises(PermissionError) as raised:
        _manager(root, shm).save(1, _state(1))
    message = str(raised.value)
    assert "\n" not in message and planted in message and why in message
    assert (f"uid {owner}" in message) if owner else ("root" in message or "uid 0" in message)
    assert os.listdir(planted) == [], "nothing written into it"


@pytest.mark.parametrize(
    ("where", "owner", "mode", "why"),
    [
        ("dir", OTHER, 0o777, "owned by"),
        ("dir", OTHER, 0o1777, "owned by"),  # a sticky dir's owner may still rename what is in it
        ("dir", 0, 0o777, "without the sticky bit"),
        ("above", OTHER, 0o755, "owned by"),
        ("above", 0, 0o770, "without the sticky bit"),
    ],
)
def test_a_tier_dir_another_user_could_swap_is_refused(tmp_path, where, owner, mode, why):
    """LocalTier(dir=...) itself, or a directory above it, that another user owns or may
    rename entries in: its owner could replace bcp-<uid> by a directory of theirs (or a
    link into the persistent root) between two saves. Refused at once, naming it."""
    above = tmp_path / "above"
    shm, root = above / "shm", tmp_path / "ck"
    shm.mkdir(parents=True)
    planted = shm if where == "dir" else above
    os.chown(planted, owner, owner)
    os.chmod(planted, mode)
    with pytest.raises(PermissionError) as raised:
        _manager(root, shm).save(1, _state(1))
    message = str(raised.value)
    assert "\n" not in message and f"{planted} (on the way to LocalTier(dir=" in message and why in message
    assert os.listdir(shm) == [], "nothing made in it"


def test_a_sticky_dir_of_root_and_a_link_to_a_dir_of_ours_are_used(tmp_path):
    """/dev/shm's shape (root's, 1777) and a dir reached through a link are fine."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    os.chmod(shared, 0o1777)
    (tmp_path / "link").symlink_to(shared)
    manager = _manager(tmp_path / "ck", tmp_path / "link")
    manager.save(1, _state(1))
    assert manager.load_latest(_template())[0] == 1
    assert os.listdir(shared) == [f"bcp-{os.geteuid()}"]


def test_a_link_in_a_dir_of_another_user_is_followed_once_at_the_start(tmp_path):
    """LocalTier(dir=<a link to a dir of ours>) kept in a directory another user may write:
    the link's target is checked and used, by its resolved path. Before, the tier kept the
    path through the link: its directory's owner swapped the link and the next save went
    to a directory of theirs."""
    share, mine, theirs = tmp_path / "share", tmp_path / "mine", tmp_path / "theirs"
    share.mkdir()
    mine.mkdir(mode=0o700)
    theirs.mkdir()
    os.chown(share, OTHER, OTHER)
    os.chmod(share, 0o777)
    (share / "tierdir").symlink_to(mine)
    manager = _manager(tmp_path / "ck", share / "tierdir")
    manager.save(1, _state(1))
    assert manager._tier.root.startswith(str(mine) + os.sep)
    (share / "swap").symlink_to(theirs)  # what the owner of share can do at any time
    os.replace(share / "swap", share / "tierdir")
    manager.save(2, _state(2))
    assert os.listdir(theirs) == [], "a save went through the swapped link"
    assert manager.load_latest(_template())[0] == 2


def test_files_are_the_users_alone_whatever_the_umask(tmp_path):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    old = os.umask(0)
    try:
        manager = _manager(root, shm)
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    finally:
        os.umask(old)
    user_dir = os.path.dirname(local_root(shm, str(root)))
    assert stat.S_IMODE(os.lstat(user_dir).st_mode) == 0o700 and os.lstat(user_dir).st_uid == os.geteuid()
    seen = 0
    for dirpath, dirs, files in os.walk(user_dir):
        for name in dirs:
            st = os.lstat(os.path.join(dirpath, name))
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, os.path.join(dirpath, name)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, os.path.join(dirpath, name)
            seen += 1
    assert seen >= 8, "manifests, catalogs, data, holdings, locks and job ids were all checked"


def _as_user(uid: int, fn: Callable[[], int]) -> int:
    """``fn()``'s exit status in a forked child running as ``uid`` (stdlib calls only)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = fn()
        finally:
            os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_another_user_can_neither_list_nor_read_the_local_tier(tmp_path):
    base = tempfile.mkdtemp(prefix="bcp-shared-", dir="/tmp")  # reachable by every user, as /dev/shm is
    try:
        os.chmod(base, 0o1777)
        shm, root = os.path.join(base, "shm"), str(tmp_path / "ck")
        os.mkdir(shm)
        os.chmod(shm, 0o1777)
        manager = _manager(root, shm)
        manager.save(1, _state(1))
        local = local_root(shm, root)
        data = next(os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs if f.endswith(".bin"))

        def snoop() -> int:
            tried = 0
            for action in (lambda: os.listdir(os.path.dirname(local)), lambda: os.listdir(local)):
                with contextlib.suppress(PermissionError):
                    action()
                    return 1
                tried += 1
            try:
                with open(data, "rb") as f:
                    f.read(1)
                return 2
            except PermissionError:
                return 0 if tried == 2 else 3

        assert _as_user(THIRD, snoop) == 0, "another user listed or read the weights"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("what", ["data", "catalog"])
def test_a_file_of_another_user_in_a_step_is_not_held(tmp_path, what):
    """Step 2's data file (or catalog) owned by another user (a hard link to their file,
    its bytes right): not counted as held, so step 1 loads, never bytes another user
    owns and could change after the check."""
    shm, root = tmp_path / "shm", tmp_path / "ck"
    manager = _manager(root, shm, keep=2)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    step = step_dir(local_root(shm, str(root)), 2)
    suffix = ".bin" if what == "data" else ".arrow"
    (planted,) = [os.path.join(d, f) for d, _, fs in os.walk(step) for f in fs if f.endswith(suffix)]
    os.chown(planted, OTHER, OTHER)
    step_loaded, state = _manager(root, shm, keep=2).load_latest(_template())
    assert step_loaded == 1 and torch.equal(state["w"], _state(1)["w"])


# -- the job identity ------------------------------------------------------------------------------


def test_a_step_of_another_job_copied_in_is_never_loaded_nor_deleted(tmp_path, caplog):
    shm = tmp_path / "shm"
    other = _manager(tmp_path / "b", shm)
    other.save(99, _state(7))
    mine = _manager(tmp_path / "a", shm)
    planted = step_dir(local_root(shm, str(tmp_path / "a")), 99)
    shutil.copytree(step_dir(local_root(shm, str(tmp_path / "b")), 99), planted)
    with caplog.at_level(logging.WARNING, logger="bcp.tiers"):
        step, state = mine.load_latest(_template())
    assert step is None and torch.equal(state["w"], torch.zeros(4)), "another job's step 99 was loaded"
    assert "step 99" in caplog.text and "never loaded" in caplog.text
    mine.save(1, _state(1))  # the stale removal of an earlier run's steps 1 and later
    assert os.path.isfile(os.path.join(planted, MANIFEST_KEY)), "another job's step was deleted"
    step, state = mine.load_latest(_template())
    assert step == 1 and torch.equal(state["w"], _state(1)["w"])


def test_a_job_started_again_at_the_same_root_never_loads_the_old_ones_steps(tmp_path, caplog):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    _manager(root, shm).save(5, _state(5))
    shutil.rmtree(root, ignore_errors=True)  # the same URI, a new job: a new job id
    manager = _manager(root, shm)
    with caplog.at_level(logging.WARNING, logger="bcp.tiers"):
        assert manager.load_latest(_template())[0] is None, "the old job's local step 5 was loaded"
    manager.save(5, _state(6))  # the same step number: the old one is moved aside, never deleted
    step, state = manager.load_latest(_template())
    assert step == 5 and torch.equal(state["w"], _state(6)["w"])
    local = local_root(shm, str(root))
    (aside,) = [n for n in os.listdir(local) if n.startswith("foreign-")]
    assert os.path.isfile(os.path.join(local, aside, MANIFEST_KEY)) and "moved to" in caplog.text


# -- links and FIFOs inside the tree ---------------------------------------------------------------


@pytest.mark.parametrize(("planted", "keep"), [(5, 2), (0, 1)], ids=["stale-removal", "retention"])
def test_a_step_entry_that_is_a_link_is_unlinked_never_its_target(tmp_path, planted, keep):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    manager = _manager(root, shm, keep=keep)
    elsewhere = _outside(tmp_path / "elsewhere")
    before = _tree(elsewhere)
    link = step_dir(local_root(shm, str(root)), planted)
    os.symlink(elsewhere, link)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    assert _tree(elsewhere) == before, "a file behind the link was deleted"
    assert not os.path.lexists(link), "the link itself is removed"


@pytest.mark.parametrize("name", [MANIFEST_KEY, HOLDING_NAME])
def test_a_fifo_in_a_local_step_never_blocks_the_recovery(tmp_path, name):
    shm, root = tmp_path / "shm", tmp_path / "ck"
    manager = _manager(root, shm)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    path = os.path.join(step_dir(local_root(shm, str(root)), 2), name)
    os.unlink(path)
    os.mkfifo(path, 0o600)
    step, state = _within(20, lambda: manager.load_latest(_template()), shm)
    assert step == 1 and torch.equal(state["w"], _state(1)["w"]), "step 2 cannot be used; step 1 is"


def test_a_dangling_link_as_the_holding_lock_creates_nothing(tmp_path):
    d = tmp_path / "step"
    d.mkdir()
    target = tmp_path / "created-through-the-link"
    os.symlink(target, d / HOLDING_LOCK)
    with pytest.raises(PermissionError, match="symbolic link"):
        add_held(str(d), "x", [])
    assert not os.path.lexists(target)


# -- fuzz: a hostile tree --------------------------------------------------------------------------


def _plant(
    rng: random.Random, shm: str, root: str, outside: str, foreign: str, victim: int = 0, another: int = OTHER
) -> list[str]:
    """Random hostile changes to the tier of user ``victim``; what was done, for the
    failure message. ``another``: the uid of another user's directories."""
    local = os.path.join(shm, f"bcp-{victim}", job_name(root))
    user_dir = os.path.dirname(local)
    done: list[str] = []
    steps = [1, 2]

    def step_file(step: int, name: str) -> str:
        return os.path.join(step_dir(local, step), name)

    def data_file(step: int) -> str:
        return next(os.path.join(d, f) for d, _, fs in os.walk(step_dir(local, step)) for f in fs if f.endswith(".bin"))

    def replace_with_fifo(path: str) -> None:
        if os.path.lexists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)

    def write(step: int, name: str, content: bytes) -> None:
        path = step_file(step, name)
        if os.path.lexists(path):
            os.unlink(path)  # never opened for writing: it may be a FIFO planted earlier
        with open(path, "xb") as f:
            f.write(content)

    def clear(path: str) -> None:
        if os.path.islink(path) or os.path.isfile(path) or stat.S_ISFIFO(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            shutil.rmtree(path)

    actions: list[tuple[str, Callable[[], None]]] = [
        ("user dir -> link", lambda: (shutil.rmtree(user_dir), os.symlink(outside, user_dir))),
        ("user dir owned by another", lambda: os.chown(user_dir, another, another)),
        ("user dir mode 0777", lambda: os.chmod(user_dir, 0o777)),
        ("user dir mode 0755", lambda: os.chmod(user_dir, 0o755)),
        ("job dir -> link", lambda: (shutil.rmtree(local), os.symlink(outside, local))),
        ("job dir owned by another", lambda: os.chown(local, another, another)),
        ("job dir mode 0707", lambda: os.chmod(local, 0o707)),
    ]
    for s in (0, 1, 2, 3, 7):
        actions.append(
            (
                f"step {s} -> link",
                lambda s=s: (
                    clear(step_dir(local, s)) if os.path.lexists(step_dir(local, s)) else None,
                    os.symlink(outside, step_dir(local, s)),
                ),
            )
        )
    for s in steps:
        for name in ("job.json", MANIFEST_KEY, HOLDING_NAME, HOLDING_LOCK):
            actions.append((f"fifo at step {s} {name}", lambda s=s, n=name: replace_with_fifo(step_file(s, n))))
            for content in (
                b"",
                b"\x00\xff{",
                b"{}",
                b'{"format": "bcp-local-tier-job", "job": "' + b"ab" * 16 + b'"}',
            ):
                actions.append((f"step {s} {name} = {content[:20]!r}", lambda s=s, n=name, c=content: write(s, n, c)))
        actions.append((f"fifo as step {s}'s data", lambda s=s: replace_with_fifo(data_file(s))))

        def link_data(s: int = s) -> None:
            path = data_file(s)
            os.unlink(path)
            os.symlink(os.path.join(outside, "weights.bin"), path)

        actions.append((f"step {s}'s data -> link", link_data))
        actions.append(
            (
                f"step {s}'s holding.lock -> dangling link",
                lambda s=s: (
                    os.unlink(step_file(s, HOLDING_LOCK)),
                    os.symlink(os.path.join(outside, "new-file"), step_file(s, HOLDING_LOCK)),
                ),
            )
        )
    actions.append(("fifo as the root's job.json", lambda: replace_with_fifo(os.path.join(local, "job.json"))))
    actions.append(("fifo named step 9", lambda: os.mkfifo(step_dir(local, 9))))
    for s in (2, 3, 4):
        actions.append(
            (
                f"another job's step as step {s}",
                lambda s=s: (
                    clear(step_dir(local, s)) if os.path.lexists(step_dir(local, s)) else None,
                    shutil.copytree(foreign, step_dir(local, s), symlinks=True),
                ),
            )
        )
    kinds: dict[str, list[tuple[str, Callable[[], None]]]] = {}
    for name, act in actions:  # the same odds for each kind of change, however many variants it has
        kind = next((k for k in ("user dir", "job dir", "fifo", "->", "another job", " = ") if k in name), name)
        kinds.setdefault(kind, []).append((name, act))
    for _ in range(rng.randint(1, 3)):
        name, act = rng.choice(kinds[rng.choice(sorted(kinds))])
        try:
            act()
        except (OSError, StopIteration) as e:  # an earlier change took the path away
            name += f" (not done: {e!r})"
        done.append(name)
    return done


def test_fuzz_the_tier_never_follows_links_blocks_loads_foreign_steps_or_deletes_outside(tmp_path):
    """Seeded random hostile trees: bcp either works or refuses with one line naming a
    path; it never blocks, never loads another job's step (value 7), and never changes
    anything outside its tree."""
    foreign_shm = tmp_path / "foreign-shm"
    other = _manager(tmp_path / "other", foreign_shm)
    other.save(3, _state(7))
    foreign = step_dir(local_root(foreign_shm, str(tmp_path / "other")), 3)
    outcomes: dict[str, int] = {}
    for seed in range(40):
        rng = random.Random(seed)
        case = tmp_path / f"case{seed}"
        shm, root = str(case / "shm"), str(case / "ck")
        manager = _manager(root, shm, keep=3)
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        outside = _outside(case / "outside")
        done = _plant(rng, shm, root, outside, os.path.join(foreign, ""))
        before = _tree(outside)
        where = f"seed {seed}: {done}"

        def run(shm: str = shm, root: str = root) -> list[Any]:
            seen: list[Any] = []
            manager = _manager(root, shm, keep=3)
            step, state = manager.load_latest(_template())
            seen.append((step, float(state["w"][0])))
            manager.save(3, _state(3))
            manager.save(4, _state(4))
            step, state = manager.load_latest(_template())
            seen.append((step, float(state["w"][0])))
            return seen

        try:
            seen = _within(30, run, shm)
        except PermissionError as e:
            message = str(e)
            assert "\n" not in message and shm in message, f"{where}: not one line naming the path: {message!r}"
            outcomes["refused"] = outcomes.get("refused", 0) + 1
        else:
            (step, value), after = seen
            assert value != 7.0, f"{where}: another job's step was loaded"
            assert step is None or value == step, f"{where}: loaded step {step} holds {value}"
            assert after == (4, 4.0), f"{where}: after saving steps 3 and 4, loaded {after}"
            outcomes["worked"] = outcomes.get("worked", 0) + 1
        assert _tree(outside) == before, f"{where}: something outside the tier's tree changed"
    assert outcomes.get("refused", 0) >= 4 and outcomes.get("worked", 0) >= 15, outcomes


# -- the file backend's file_mode ------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_the_file_backends_file_mode_is_exact_whatever_the_umask_and_off_by_default(tmp_path, umask):
    from bcp.backends.file import FileBackend

    old = os.umask(umask)
    try:
        private = FileBackend(str(tmp_path / "private"), fsync=False, file_mode=0o600)
        private.write("a/b/c.bin", b"x")
        with private.open_writer("a/d.bin") as w:
            w.write_at(0, b"yz")
            w.commit()
        private.write_if_absent("e.bin", b"w")
        plain = FileBackend(str(tmp_path / "plain"), fsync=False)
        plain.write("a/b/c.bin", b"x")
    finally:
        os.umask(old)
    mode = lambda *p: stat.S_IMODE(os.lstat(os.path.join(tmp_path, *p)).st_mode)  # noqa: E731
    assert [mode("private", k) for k in ("a/b/c.bin", "a/d.bin", "e.bin")] == [0o600] * 3
    assert mode("private", "a") == mode("private", "a/b") == 0o700
    assert mode("plain", "a/b/c.bin") == 0o644 & ~umask and mode("plain", "a") == 0o777 & ~umask, "unchanged"
    assert private.read("a/d.bin") == b"yz"
    with pytest.raises(ValueError, match="file_mode"):
        FileBackend(str(tmp_path / "x"), file_mode=0o1000)


def test_a_tampered_job_id_of_the_local_root_lists_no_step(tmp_path):
    from bcp.tiers.inventory import list_local

    shm, root = tmp_path / "shm", tmp_path / "ck"
    _manager(root, shm).save(1, _state(1))
    local = local_root(shm, str(root))
    assert [c.step for c in list_local(local)] == [1]
    job = os.path.join(local, "job.json")
    os.unlink(job)
    os.mkfifo(job)  # unreadable as a job id: nothing is this job's, rather than everything
    assert _within(20, lambda: list_local(local), shm) == []
    os.unlink(job)
    assert [c.step for c in list_local(local)] == [1], "a root no tier stamped lists every step"
    manager = _manager(root, shm)  # the tier stamps it again when it starts
    assert manager.load_latest(_template())[0] == 1


def test_every_rank_of_every_host_binds_its_steps_to_the_one_job_id(tmp_path):
    """2 simulated hosts x 2 ranks (gloo): the coordinator creates the persistent
    root's id once; each host's local root and each of its step directories carry it."""
    import tier_jobs
    from bcp.backends import backend_for
    from bcp.tiers.job import JOB_KEY, JOB_NAME, decode, read_job

    cfg = {"base": str(tmp_path / "hosts"), "root": str(tmp_path / "persist"), "ranks_per_host": 2}
    cfg["steps"], cfg["persist_every"] = [1, 2, 3], None
    assert tier_jobs.run(4, cfg) == [0, 0, 0, 0]
    job = decode(backend_for(cfg["root"]).read(JOB_KEY))
    for host in ("host0", "host1"):
        local = local_root(os.path.join(cfg["base"], host), cfg["root"])
        steps = sorted(n for n in os.listdir(local) if n.startswith("step_"))
        assert steps == ["step_0000000002", "step_0000000003"], (host, steps)
        assert read_job(local) == job and all(read_job(os.path.join(local, s)) == job for s in steps), host
        assert stat.S_IMODE(os.lstat(os.path.join(local, JOB_NAME)).st_mode) == 0o600


@pytest.mark.parametrize("store", ["file", "memory", "moto"])
def test_racing_first_starts_agree_on_one_job_id_on_a_create_only_store(tmp_path, store, request):
    """The id is created once, create-only (the file backend's link(2), memory, S3's
    If-None-Match on moto_server): 8 threads starting at once all get the same id."""
    from concurrent.futures import ThreadPoolExecutor

    from bcp.backends import backend_for
    from bcp.tiers.job import job_identity

    if store == "moto":
        from conftest import new_bucket, store_uri

        server = request.getfixturevalue("moto_server")
        uri = store_uri("moto", server, new_bucket(server), "ck")
    else:
        uri = str(tmp_path / "ck") if store == "file" else f"memory://race-{os.getpid()}-{tmp_path.name}/ck"
    barrier = threading.Barrier(8)

    def start(_: int) -> str:
        backend = backend_for(uri)
        barrier.wait()
        return job_identity(backend)

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(start, range(8)))
    assert len(ids) == 1 and ids == {job_identity(backend_for(uri))}


def refusal_job(rank: int, world: int, base: str, root: str) -> None:
    """(a gloo rank) Start a tier on host ``rank // 2``; write the error it raised to ``base/rank<r>.txt``."""
    os.environ["BCP_HOST_ID"] = f"host{rank // 2}"
    try:
        _manager(root, os.path.join(base, f"host{rank // 2}"))
        outcome = "started"
    except Exception as e:  # noqa: BLE001 - what each rank saw is the test's subject
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(base, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)


def test_a_refusal_on_one_host_raises_on_every_rank_at_once(tmp_path):
    """Host 1's private directory belongs to another user: every rank of both hosts
    (2 x 2 gloo ranks) fails at the manager's construction, host 0's ranks with host
    1's refusal (agreed: not a broken connection, nor a wait of BCP_RENDEZVOUS_TIMEOUT)."""
    import dist_jobs

    base, root = str(tmp_path / "hosts"), str(tmp_path / "persist")
    squatted = os.path.dirname(local_root(os.path.join(base, "host1"), root))
    os.makedirs(squatted)
    os.chown(squatted, OTHER, OTHER)
    dist_jobs.spawn(refusal_job, 4, base, root)
    seen = []
    for r in range(4):
        with open(os.path.join(base, f"rank{r}.txt")) as f:
            seen.append(f.read())
    for r in (2, 3):
        assert seen[r].startswith("PermissionError: ") and f"{squatted} is owned by uid {OTHER}" in seen[r], seen[r]
    for r in (0, 1):
        assert "creating the local tier's directory failed on 2 of 4 ranks: rank 2: PermissionError" in seen[r], seen[r]
    assert os.listdir(squatted) == []


def _in_child(uid: int, fn: Callable[[], Any], seconds: int = 30) -> tuple[str, Any]:
    """``fn()`` in a forked child running as ``uid``: ("ok", result), ("error", "Type: message")
    or ("blocked", None) when it ran past ``seconds`` (SIGALRM ends it)."""
    import json
    import signal

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(seconds)
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = ["ok", fn()]
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = ["error", f"{type(e).__name__}: {e}"]
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _pid, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == -14 or not chunks:
        return "blocked", os.waitstatus_to_exitcode(status)
    kind, value = json.loads(b"".join(chunks))
    return kind, value


def _chown_tree(top: str, uid: int, *, unless: int) -> None:
    """Everything under ``top`` (links themselves, never followed) owned by ``uid``, but what ``unless`` owns."""
    for dirpath, dirs, files in os.walk(top):
        for name in [*dirs, *files, ""]:
            path = os.path.join(dirpath, name) if name else dirpath
            if os.lstat(path).st_uid != unless:
                os.chown(path, uid, uid, follow_symlinks=False)


@pytest.mark.slow  # about 3-6 s on 2 cores: out of the fast tier
def test_fuzz_as_a_second_user_against_a_third(tmp_path):
    """The fuzz with real users: the job runs as uid OTHER in a forked child; the
    hostile changes are made as root and belong to the job's own user (a confused
    script, a tampered tree) or to a third user (THIRD, a squatter). The files outside
    the tier belong to the job's user, so only bcp's own care keeps them intact."""
    base = tempfile.mkdtemp(prefix="bcp-fuzz-", dir="/tmp")
    try:
        os.chmod(base, 0o1777)
        foreign_shm = os.path.join(base, "foreign-shm")
        _manager(os.path.join(base, "other"), foreign_shm).save(3, _state(7))
        foreign = step_dir(local_root(foreign_shm, os.path.join(base, "other")), 3)
        outcomes: dict[str, int] = {}
        for seed in range(16):
            rng = random.Random(1000 + seed)
            case = os.path.join(base, f"case{seed}")
            os.mkdir(case)
            os.chmod(case, 0o1777)
            shm, root = os.path.join(case, "shm"), os.path.join(case, "ck")

            def first(shm: str = shm, root: str = root) -> int:
                manager = _manager(root, shm, keep=3)
                manager.save(1, _state(1))
                manager.save(2, _state(2))
                return 2

            assert _in_child(OTHER, first) == ("ok", 2), f"seed {seed}: the job could not start"
            outside = _outside(os.path.join(case, "outside"))
            done = _plant(rng, shm, root, outside, os.path.join(foreign, ""), victim=OTHER, another=THIRD)
            _chown_tree(case, OTHER, unless=THIRD)
            before = _tree(outside)

            def run(shm: str = shm, root: str = root) -> list[Any]:
                manager = _manager(root, shm, keep=3)
                step, state = manager.load_latest(_template())
                seen = [step, float(state["w"][0])]
                manager.save(3, _state(3))
                manager.save(4, _state(4))
                step, state = manager.load_latest(_template())
                return [*seen, step, float(state["w"][0])]

            kind, value = _in_child(OTHER, run)
            where = f"seed {seed}: {done}"
            assert kind != "blocked", f"{where}: blocked (status {value})"
            if kind == "error":
                assert value.startswith("PermissionError: ") and "\n" not in value and shm in value, f"{where}: {value}"
            else:
                step, loaded, after_step, after = value
                assert loaded != 7.0 and (step is None or loaded == step), f"{where}: loaded step {step} = {loaded}"
                assert (after_step, after) == (4, 4.0), f"{where}: after saving 3 and 4, loaded {value}"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            assert _tree(outside) == before, f"{where}: something outside the tier's tree changed"
        assert outcomes.get("error", 0) >= 2 and outcomes.get("ok", 0) >= 6, outcomes
    finally:
        shutil.rmtree(base, ignore_errors=True)
