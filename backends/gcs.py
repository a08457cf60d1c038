"""Google Cloud Storage, via gcsfs (JSON API).

``gs://bucket/prefix`` (or ``gcs://``). GCS has no parallel multipart upload in its
JSON API, so large objects are *parallel composite uploads*: each part is uploaded
as its own temporary object under ``<root>/.bcp-uploads/<upload id>/`` from several
threads at once, then ``compose`` joins them (32 sources a request, in rounds for
more) into the final object, which appears atomically; the parts are then deleted.
A writer that fails or is aborted deletes its parts; parts orphaned by a killed
process are removed by ``delete_prefix``/``bcp gc`` (:meth:`GCSBackend.abort_uploads`).
The temporary objects are never listed.

Every uploaded part's CRC32C, as computed by the server, is compared with ours; a
mismatch (corruption in transit) deletes the part and fails the request as
transient, so it is sent again. The manifest commit uses ``ifGenerationMatch=0``.

Credentials only from Google's standard sources (GOOGLE_APPLICATION_CREDENTIALS,
gcloud's application-default login, the metadata server), or ``anon=true`` for
public buckets and emulators. gcsfs retries each HTTP request itself (up to 6
times, exponential backoff with jitter); it cannot be switched off per instance, so
bcp's own retry loop around it defaults to 2 attempts here.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Self
from urllib.parse import quote, unquote, urlsplit

import gcsfs

from .base import Backend, Buffer, Capability, IOHints, ObjectWriter, check_key
from .errors import ObjectExistsError, ObjectNotFoundError, annotate
from .options import as_bool, as_int, as_size, reject_unknown
from .parts import PartWriter, crc32c_b64
from .retry import TransientError

log = logging.getLogger(__name__)

DEFAULT_PART = 32 << 20
COMPOSE_MAX = 32  # sources per compose request
UPLOADS = ".bcp-uploads"



class GCSBackend(Backend):
    """Options: ``project``, ``endpoint_url`` (emulators; STORAGE_EMULATOR_HOST also
    works), ``anon``, ``part_size`` (default 32MiB, at most 32MiB, a multiple of
    64KiB), ``concurrency`` (default 8), ``conditional_writes`` (default true; false
    for emulators that ignore ``ifGenerationMatch``), and the retry options."""

    scheme = "gs"
    network = True
    default_retry_attempts = 2  # gcsfs already retries every request (see module notes)
    capabilities = Capability.RANGED_READ | Capability.PARALLEL_WRITES | Capability.CREATE_ONLY

    def __init__(self, uri: str, bucket: str, root: str, fs: gcsfs.GCSFileSystem, *, api_base: str, part_size: int,
                 concurrency: int, conditional_writes: bool) -> None:
        super().__init__(uri)
        self.bucket, self.root, self.fs = bucket, root, fs
        self.part_size, self.concurrency, self.conditional_writes = part_size, concurrency, conditional_writes
        self.api_base = api_base
        if not conditional_writes:
            self.capabilities = type(self).capabilities & ~Capability.CREATE_ONLY

    @classmethod
    def from_uri(cls, uri: str, **options) -> Self:
        if {"token", "credentials", "key"} & set(options):
            raise TypeError("credentials are not accepted as options; use GOOGLE_APPLICATION_CREDENTIALS, "
                            "gcloud application-default login or the metadata server (or anon=true)")
        parts = urlsplit(uri)
        bucket = parts.netloc
        if not bucket:
            raise ValueError(f"GCS URI needs a bucket: gs://BUCKET[/prefix], got {uri!r}")
        root = unquote(parts.path).strip("/")
        project = options.pop("project", None)
        endpoint = options.pop("endpoint_url", None)
        anon = as_bool("anon", options.pop("anon", False))
        part_size = as_size("part_size", options.pop("part_size", DEFAULT_PART))
        concurrency = as_int("concurrency", options.pop("concurrency", 8), minimum=1)
        conditional = as_bool("conditional_writes", options.pop("conditional_writes", True))
        reject_unknown("gcs", uri, options)
        if not (256 << 10 <= part_size <= DEFAULT_PART) or part_size % (64 << 10):
            raise ValueError(f"option part_size={part_size}: must be 256KiB..32MiB and a multiple of 64KiB")
        kwargs = {"token": "anon" if anon else None}
        if project:
            kwargs["project"] = project
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        fs = gcsfs.GCSFileSystem(**kwargs)
        if root.startswith(UPLOADS) or f"/{UPLOADS}" in root:
            raise ValueError(f"{uri!r}: {UPLOADS} is reserved for bcp's temporary upload parts")
        clean = f"gs://{bucket}/{root}".rstrip("/")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        api_base = (endpoint or (emulator if emulator not in ("", "default") else "https://storage.googleapis.com"))
        return cls(clean, bucket, root, fs, api_base=api_base.rstrip("/"), part_size=part_size, concurrency=concurrency,
                   conditional_writes=conditional)

    @property
    def hints(self) -> IOHints:
        return IOHints(part_size=self.part_size, concurrency=self.concurrency)

    # -- helpers ---------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _key(self, key: str) -> str:
        return self._name(check_key(key))

    def upload(self, name: str, data: Buffer, *, if_absent: bool = False) -> dict:
        """Upload object ``name`` (bucket-relative) in one resumable session: the
        object's CRC32C goes in the session's metadata, so the server rejects a body
        that arrives different; the CRC the server reports is checked again here.

        (Resumable rather than a one-request multipart upload: the multipart body
        format is where emulators go wrong, e.g. gcp-storage-emulator drops a final
        ``\\r``; costs one extra round trip per object.)"""
        payload = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        expected = crc32c_b64(payload)
        extra = {"ifGenerationMatch": "0"} if if_absent else {}
        headers, _ = self.fs.call(
            "POST", f"{self.api_base}/upload/storage/v1/b/{quote(self.bucket)}/o", uploadType="resumable",
            name=name, json={"name": name, "crc32c": expected},
            headers={"X-Upload-Content-Type": "application/octet-stream"}, **extra,
        )
        location = headers["Location"]
        span = f"bytes 0-{len(payload) - 1}/{len(payload)}" if payload else "bytes */0"
        _, body = self.fs.call("PUT", location, data=payload,
                               headers={"Content-Range": span, "Content-Type": "application/octet-stream"})
        out = json.loads(body) if body else {}
        got = out.get("crc32c")
        if got is not None and got != expected:
            self._delete_name(name)
            raise TransientError(f"CRC32C mismatch after upload (sent {expected}, stored {got}): corrupted in "
                                 "transit", uri=self.uri, key=name, action="uploading")
        return out

    def _delete_name(self, name: str) -> None:
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, name)
        except FileNotFoundError:
            pass

    def compose(self, target: str, sources: list[str]) -> None:
        self.fs.merge(f"{self.bucket}/{target}", [f"{self.bucket}/{s}" for s in sources])

    # -- the contract --------------------------------------------------------------------

    def open_writer(self, key: str, *, size: int | None = None) -> ObjectWriter:
        check_key(key)
        return _ComposeWriter(self, key, size)

    def write(self, key: str, data: Buffer) -> None:
        if len(data) > self.part_size * COMPOSE_MAX:
            return super().write(key, data)
        with annotate(self.uri, key, "writing"):
            self.upload(self._key(key), data)

    def write_if_absent(self, key: str, data: Buffer) -> None:
        if not self.conditional_writes:
            return super().write_if_absent(key, data)
        with annotate(self.uri, key, "creating"):
            try:
                self.upload(self._key(key), data, if_absent=True)
            except FileExistsError as e:
                raise ObjectExistsError("object already exists", uri=self.uri, key=key, action="creating") from e

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """One ranged GET. A range starting at or past the end (HTTP 416) costs one
        metadata request to tell "past the end" (0 bytes) from "no such object"."""
        view = memoryview(buffer).cast("B")
        if len(view) == 0:
            self.size(key)  # a missing key still raises
            return 0
        with annotate(self.uri, key, "reading"):
            try:
                data = self.fs.cat_file(f"{self.bucket}/{self._key(key)}", start=offset, end=offset + len(view))
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - gcsfs raises HttpError/ValueError for 416
                if getattr(e, "code", None) != 416 and "416" not in str(e) and "range" not in str(e).lower():
                    raise
                if offset < self.size(key):
                    raise
                return 0
        view[: len(data)] = data
        return len(data)

    def size(self, key: str) -> int:
        with annotate(self.uri, key, "sizing"):
            meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self._key(key), json_out=True)
        return int(meta["size"])

    def _list_names(self, full_prefix: str) -> Iterator[str]:
        token = None
        while True:
            kwargs = {"prefix": full_prefix, "maxResults": 1000}
            if token:
                kwargs["pageToken"] = token
            with annotate(self.uri, full_prefix, "listing"):
                page = self.fs.call("GET", "b/{}/o", self.bucket, json_out=True, **kwargs)
            for item in page.get("items", []):
                yield item["name"]
            token = page.get("nextPageToken")
            if not token:
                return

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self.root + "/" if self.root else ""
        hidden = base + UPLOADS + "/"
        for name in self._list_names(base + prefix):
            if not name.startswith(hidden):
                yield name[len(base):]

    def delete(self, key: str) -> None:
        with annotate(self.uri, key, "deleting"):
            self._delete_name(self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFoundError:
            return False
        return True

    def delete_prefix(self, prefix: str) -> None:
        """Everything under the prefix, temporary parts of unfinished uploads included."""
        base = self.root + "/" if self.root else ""
        names = list(self._list_names(base + prefix))
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(self._delete_name, names))

    def abort_uploads(self) -> int:
        """Delete temporary parts of unfinished composite uploads; how many."""
        base = self.root + "/" if self.root else ""
        names = list(self._list_names(base + UPLOADS + "/"))
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(self._delete_name, names))
        return len(names)

    def pending_uploads(self) -> list[str]:
        base = self.root + "/" if self.root else ""
        return list(self._list_names(base + UPLOADS + "/"))


class _ComposeWriter(PartWriter):
    """One upload at commit for a single-part object; otherwise parts as temporary
    objects, composed at commit."""

    store = "GCS"

    def __init__(self, backend: GCSBackend, key: str, size: int | None) -> None:
        super().__init__(backend, key, size, backend.part_size)
        base = backend.root + "/" if backend.root else ""
        self.parts_prefix = f"{base}{UPLOADS}/{uuid.uuid4().hex}/"
        self._uploaded = False

    def upload_part(self, index: int, data: Buffer) -> str:
        name = f"{self.parts_prefix}{index:06d}"
        self._uploaded = True
        self.backend.upload(name, data)
        return name

    def put_whole(self, data: bytes) -> None:
        self.backend.upload(self.backend._key(self.key), data)

    def complete(self, names: list[str], size: int) -> None:
        b = self.backend
        round_no = 0
        while len(names) > COMPOSE_MAX:
            merged = []
            for g in range(0, len(names), COMPOSE_MAX):
                name = f"{self.parts_prefix}r{round_no}-{g // COMPOSE_MAX:06d}"
                b.compose(name, names[g : g + COMPOSE_MAX])
                merged.append(name)
            names, round_no = merged, round_no + 1
        b.compose(b._key(self.key), names)

    def discard(self) -> None:
        if not self._uploaded:
            return
        b = self.backend
        try:
            names = list(b._list_names(self.parts_prefix))
            with concurrent.futures.ThreadPoolExecutor(b.concurrency) as pool:
                list(pool.map(b._delete_name, names))
            self._uploaded = False
        except OSError as e:  # leftovers are invisible; abort_uploads / bcp gc remove them
            log.warning("could not delete temporary parts under %s in %s: %s", self.parts_prefix, b.uri, e)
