"""The job identity of the local tier: which local steps belong to this job.

A job's local root is named after its persistent root URI (``paths.job_name``), but a
name is no proof: the same URI can name another store (another endpoint, a root that
was deleted and started again), and a step directory can be copied in from
elsewhere. So the persistent root holds a random job id, ``local-tier.json``, written
once, create-only, by the coordinator the first time a tier starts there; every rank
learns it from the coordinator (:func:`job_identity`). Each host's local root and
each local step directory then carry the id in a ``job.json`` of their own, the
step's written before any of its data (:func:`stamp`). A step whose ``job.json``
names another id is another job's: never loaded, never deleted (a WARNING); one with
no readable ``job.json`` is not loaded either (docs/tiers.md, "Security").
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat

from bcp.backends import Backend, Capability, ObjectExistsError, ObjectNotFoundError
from bcp.tiers.paths import FILE_MODE, read_regular

log = logging.getLogger(__name__)

#: the job id's object under the persistent root (beside ``step_*/`` and ``latest.json``)
JOB_KEY = "local-tier.json"
#: the id's copy in each local root and each local step directory
JOB_NAME = "job.json"
FORMAT = "bcp-local-tier-job"
_ID = re.compile(r"[0-9a-f]{32}")
#: job files larger than this are not read (one is about 80 bytes)
MAX_JOB_BYTES = 4096


def encode(job: str) -> bytes:
    return json.dumps({"format": FORMAT, "version": 1, "job": job}).encode("utf-8")


def decode(data: bytes) -> str:
    """The job id in a job file's bytes; ValueError unless they are what :func:`encode` writes."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    job = doc.get("job") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(job, str) or not _ID.fullmatch(job):
        raise ValueError(f"not a {FORMAT} file with a 32-hex-digit job id")
    return job


def job_identity(backend: Backend) -> str:
    """(the coordinator) The job id under the persistent root ``backend``: read it, or
    create it when absent. Create-only where the store has conditional writes (of two
    starts racing, one id wins and both read it); elsewhere read, write, read back (a
    race of two first starts on such a store can leave the ranks of the loser with an
    id that lost: their local steps are then not recovered, never wrongly loaded).
    ValueError naming the object when it is there but not an id."""
    try:
        return _read(backend)
    except (FileNotFoundError, ObjectNotFoundError):
        pass
    job = secrets.token_hex(16)
    try:
        backend.write_if_absent(JOB_KEY, encode(job))
    except (FileExistsError, ObjectExistsError):
        pass
    found = _read(backend)
    if found == job:
        conditional = Capability.CREATE_ONLY in backend.capabilities
        log.info("local tier: new job id %s at %s (%s)", job, backend.uri, "create-only" if conditional else "written")
    return found


def _read(backend: Backend) -> str:
    data = backend.read(JOB_KEY)
    try:
        if len(data) > MAX_JOB_BYTES:
            raise ValueError(f"{len(data)} bytes")
        return decode(data)
    except ValueError as e:
        raise ValueError(
            f"{backend.uri}/{JOB_KEY} is not the local tier's job id ({e}); delete it to give the job a new id "
            "(the local steps saved under the old one are then never loaded)"
        ) from None


def read_job(directory: str) -> str | None:
    """The job id in ``directory``'s ``job.json`` (a regular file, never through a
    link, never blocking), or None when it is absent or not one (a WARNING then)."""
    path = os.path.join(directory, JOB_NAME)
    data = read_regular(path, MAX_JOB_BYTES)
    if data is None:
        return None
    try:
        return decode(data)
    except ValueError as e:
        log.warning("local tier: %s is not a job id: %s", path, e)
        return None


def stamp(directory: str, job: str) -> None:
    """Write ``directory``'s ``job.json`` (0600, through a new partial file renamed into
    place, relative to the directory opened without following a link)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        partial = f"{JOB_NAME}.partial-{secrets.token_hex(4)}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE, dir_fd=dfd)
        try:
            os.fchmod(fd, FILE_MODE)
            os.write(fd, encode(job))
        finally:
            os.close(fd)
        os.replace(partial, JOB_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def make_step_dir(path: str, job: str) -> None:
    """Create the step directory ``path`` (0700, never through a link) and stamp it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise PermissionError(f"local tier: {path} is not a directory; remove it") from None
    stamp(path, job)
