"""Where a host's local tier lives: ``<dir>/bcp-<uid>/<job>/step_<10 digits>/``.

``<uid>`` is the effective user id: each user has a private directory of their own
(mode 0700, theirs, never a link: :func:`make_private_root`), as systemd's runtime
directories do, because ``<dir>`` (``/dev/shm`` by default) is shared by every user
of the host. ``<job>`` comes from the manager's persistent root URI (a readable tail
and a short hash of the whole URI), so two jobs on one host never share a local
root, and a restarted job finds its own. The local root is a plain directory written
through bcp's file backend without fsync (the local tier has to outlive the process,
not the host), its files 0600 (docs/tiers.md, "Security").
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat

from bcp.backends import Backend
from bcp.backends.file import FileBackend
from bcp.metadata.keys import STEP_PREFIX, step_name

#: holding.json: the data files this host holds for one step, each checked (holding.py)
HOLDING_NAME = "holding.json"
#: the lock file beside it (several ranks of a host add files to one holding.json)
HOLDING_LOCK = "holding.lock"

log = logging.getLogger(__name__)

#: open(2) flags of every file the tier reads: never through a link, never blocking on a FIFO
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
#: the permission bits of the tier's files and directories: the user's alone
FILE_MODE = 0o600
DIR_MODE = 0o700

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{10}})$")


def normalised_uri(root_uri: str) -> str:
    """The root URI as one string per location: a plain path made absolute."""
    uri = os.fspath(root_uri)
    if "://" not in uri:
        uri = os.path.abspath(os.path.expanduser(uri))
    return uri


def job_name(root_uri: str) -> str:
    """The directory name of a job's local root: the URI's last path segment made
    safe (at most 40 characters) and 8 hex digits of a hash of the whole URI."""
    uri = normalised_uri(root_uri)
    digest = hashlib.blake2b(uri.encode("utf-8"), digest_size=4).hexdigest()
    path = uri.split("?", 1)[0].rstrip("/")
    tail = _UNSAFE.sub("_", path.rsplit("/", 1)[-1])[:40].strip("._-")
    return f"{tail or 'root'}-{digest}"


def user_dir_name() -> str:
    """The name of this user's private directory under the tier's ``dir``."""
    return f"bcp-{os.geteuid()}"


def local_root(base_dir: str | os.PathLike, root_uri: str) -> str:
    """The local root of the job saving to ``root_uri`` under ``base_dir`` (a path only:
    :func:`make_private_root` creates and checks it)."""
    return os.path.join(os.path.abspath(os.fspath(base_dir)), user_dir_name(), job_name(root_uri))


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path: str, what: str, fix: str) -> PermissionError:
    return PermissionError(f"local tier: {path} {what}; bcp refuses to use it: {fix}")


def _foreign_owner(path: str, uid: int) -> PermissionError:
    return _refuse(
        path,
        f"is owned by {_owner(uid)}, not by this user ({_owner(os.geteuid())})",
        f"have it removed (sudo rm -r {path}), or give LocalTier another dir",
    )


def _unusable(parent_fd: int, name: str, path: str, error: OSError) -> PermissionError:
    """Why ``name`` (``path``) could not be opened as a directory, as one line."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError as e:
        return PermissionError(f"local tier: cannot open {path} ({e.strerror})")
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
        return _refuse(path, f"{kind} (owner {_owner(st.st_uid)})", f"remove it (rm {path}) and start again")
    if st.st_uid != os.geteuid():
        return _foreign_owner(path, st.st_uid)
    return _refuse(path, f"cannot be opened ({error.strerror})", f"chmod 700 {path}")


def open_private_dir(parent_fd: int, name: str, path: str) -> int:
    """A descriptor of the directory ``name`` under ``parent_fd`` (``path``, for
    messages), created 0700 when missing. Refused (PermissionError, one line naming the
    path, the owner and the fix): a link, not a directory, owned by another user, or
    writable by group or others; one of ours readable by others is made 0700."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as e:
        parent = os.path.dirname(path)
        raise PermissionError(f"local tier: cannot create {path} ({e.strerror}); check {parent}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:  # a link (ELOOP), not a directory (ENOTDIR), another user's (EACCES)
        raise _unusable(parent_fd, name, path, e) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise _foreign_owner(path, st.st_uid)
        if st.st_mode & 0o022:
            raise _refuse(
                path,
                f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}, owner {_owner(st.st_uid)})",
                f"check what it holds, then chmod 700 {path}",
            )
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)  # ours, readable by others: private from now on
            log.info("local tier: %s made private (mode 0700)", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_trusted_dir(path: str) -> None:
    """Refuse a tier's ``dir`` that another user could swap: every directory from ``/``
    to it (links resolved) must be owned by root or this user, and writable by group or
    others only with the sticky bit (``/dev/shm``, ``/tmp``), where no one else may
    rename what is in it. Otherwise its owner (or anyone) could replace ``bcp-<uid>``
    by a directory of theirs, or a link into the persistent root, between two saves."""
    resolved = os.path.realpath(path)
    me = os.geteuid()
    at = os.sep
    for name in [""] + [p for p in resolved.split(os.sep) if p]:
        at = os.path.join(at, name) if name else at
        st = os.stat(at)
        if st.st_uid not in (0, me):
            raise _refuse(
                at,
                f"(on the way to LocalTier(dir={path!r})) is owned by {_owner(st.st_uid)}, who could replace "
                "what bcp keeps there",
                "give LocalTier a dir of your own or /dev/shm",
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _refuse(
                at,
                f"(on the way to LocalTier(dir={path!r})) is writable by group or others without the sticky bit "
                f"(mode {stat.S_IMODE(st.st_mode):04o})",
                f"chmod o-w,g-w {at} (or +t), or give LocalTier another dir",
            )


def make_private_root(base_dir: str | os.PathLike, root_uri: str) -> str:
    """Create (or check) ``<dir>/bcp-<uid>/<job>`` one component at a time relative to
    its parent's descriptor (:func:`open_private_dir`); returns its path. ``<dir>``
    itself is the user's choice (``/dev/shm``: root's, sticky, writable by all); it
    must exist. The root returned is under ``<dir>`` with its links resolved, the path
    :func:`check_trusted_dir` checked: a link in the way is followed once, here, never at
    a later save (its directory's owner could point it elsewhere by then)."""
    base = os.path.realpath(os.fspath(base_dir))
    root = local_root(base, root_uri)
    check_trusted_dir(base)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        path = base
        for name in (user_dir_name(), job_name(root_uri)):
            path = os.path.join(path, name)
            child = open_private_dir(fd, name, path)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return root


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def step_backend(root: str, step: int) -> Backend:
    """The file backend of one local step (no fsync: the tier outlives the process, not
    the host; files 0600 whatever the umask)."""
    return FileBackend(step_dir(root, step), fsync=False, file_mode=FILE_MODE)


def local_steps(root: str) -> list[int]:
    """The step directories under a local root, oldest first (committed or not)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def check_apart(root: str, persistent_uri: str) -> None:
    """Refuse a local root inside the persistent root or around it (when the latter
    is a local path): local retention would delete persistent steps, or the reverse."""
    uri = normalised_uri(persistent_uri)
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    if "://" in uri:
        return
    a, b = os.path.realpath(root), os.path.realpath(uri)
    if os.path.commonpath([a, b]) in (a, b):
        raise ValueError(f"the local tier's root {root} and the persistent root {persistent_uri} must not nest")


def read_regular(path: str, limit: int) -> bytes | None:
    """The bytes of a regular file (never through a link, never blocking: a FIFO or a
    device is opened non-blocking and refused after ``fstat``), or None when it is
    absent, not a regular file or larger than ``limit`` (a WARNING when it is there
    but refused: a link, not a regular file, no permission)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link (ELOOP), no permission
        log.warning("local tier: cannot read %s: %s", path, e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("local tier: %s is not a regular file; it is not read", path)
            return None
        if st.st_size > limit:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
