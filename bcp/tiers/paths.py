"""Where a host's local tier lives: ``<dir>/bcp/<job>/step_<10 digits>/``.

``<job>`` comes from the manager's persistent root URI (a readable tail and a short
hash of the whole URI), so two jobs on one host never share a local root, and a
restarted job finds its own. The local root is a plain directory written through
bcp's file backend without fsync: the local tier has to outlive the process, not
the host.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat

from bcp.backends import Backend, backend_for
from bcp.metadata.layout import STEP_PREFIX, step_name

#: holding.json: the data files this host holds for one step, each checked (holding.py)
HOLDING_NAME = "holding.json"
#: the lock file beside it (several ranks of a host add files to one holding.json)
HOLDING_LOCK = "holding.lock"

log = logging.getLogger(__name__)

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


def local_root(base_dir: str | os.PathLike, root_uri: str) -> str:
    """The local root of the job saving to ``root_uri`` under ``base_dir``."""
    return os.path.join(os.path.abspath(os.fspath(base_dir)), "bcp", job_name(root_uri))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, step_name(step))


def step_backend(root: str, step: int) -> Backend:
    """The file backend of one local step (no fsync: the tier outlives the process, not the host)."""
    return backend_for(step_dir(root, step), fsync=False)


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
    """The bytes of a regular file (never through a link), or None when it is absent,
    not a regular file or larger than ``limit`` (a WARNING when it cannot be opened
    for another reason: a link, no permission)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link (ELOOP), no permission
        log.warning("local tier: cannot read %s: %s", path, e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
