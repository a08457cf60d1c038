"""Google Cloud Storage, via gcsfs (JSON API).

``gs://bucket/prefix`` (or ``gcs://``). GCS has no parallel multipart upload in its
JSON API, so large objects are *parallel composite uploads*: each part is uploaded
as its own temporary object under ``<root>/.bcp-uploads/<upload id>/`` from several
threads at once, then ``compose`` joins them (32 sources a request, in rounds for
more) into the final object, which appears atomically; the parts are then deleted.
A writer that fails or is aborted deletes its parts (tried again on a transient
error); parts orphaned by a killed process are reported by ``unfinished()`` (aged from
the newest part: a save in progress is young) and removed by ``bcp gc`` and
``delete_prefix``. The temporary objects are never listed, from any root above them.

Every uploaded part's CRC32C, as computed by the server, is compared with ours; a
mismatch (corruption in transit) deletes the part and fails the request as
transient, so it is sent again. The manifest commit uses ``ifGenerationMatch=0``.

Credentials from ``storage_options={"token": ...}`` as gcsfs takes it (a JSON key
file's path, a dict, ``"google_default"``, ``"anon"``, a Credentials object: one
process can use several accounts), or else Google's standard sources
(GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the metadata
server), or ``anon=true`` for public buckets and emulators; never from the URI.
gcsfs retries each HTTP request itself (6 tries, backing off up to 32 s, logging a
traceback when it gives up); bcp's filesystem class takes that loop out, so that
:class:`~bcp.backends.wrappers.RetryingBackend` is the one loop and ``retry_deadline``
bounds a failure (nested loops took 137 s against a 120 s deadline).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, Self
from urllib.parse import quote

import aiohttp
import gcsfs

from bcp.backends.base import Buffer, Unfinished
from bcp.backends.objectstore import ObjectStoreBackend, StoreOptions, causes, pop_store_options, split_bucket_uri
from bcp.backends.parts import PartWriter, crc32c_b64
from bcp.backends.storage_errors import TransientError, annotate
from bcp.backends.uri_options import check_part_size, reject_unknown

log = logging.getLogger(__name__)

DEFAULT_PART = 32 << 20  # fewer parts: fewer compose requests, which run one after another at commit
COMPOSE_MAX = 32  # sources per compose request
UPLOADS = ".bcp-uploads"
DISCARD_TRIES = 4  # a writer's clean-up of its parts, tried again after a transient error


class OneTryGCSFileSystem(gcsfs.GCSFileSystem):
    """gcsfs with each HTTP request tried once: ``_request`` without gcsfs's
    ``retry_request`` decorator (every JSON API call goes through it), so bcp's retry
    loop alone decides, within its deadline. Its own class, so fsspec's instance cache
    never hands it to code that expects gcsfs's retries."""

    _request = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", gcsfs.GCSFileSystem._request)


def _check_token(token: Any) -> Any:
    """``token`` as gcsfs takes it (a service-account or authorized-user JSON file's
    path, a method name such as ``"google_default"`` or ``"anon"``, a raw access
    token, a dict of credentials, a ``google.auth`` Credentials object), or None;
    TypeError naming only the type of anything else."""
    if token is None or isinstance(token, Mapping):
        return dict(token) if token is not None else None
    if isinstance(token, str) and token:
        return token
    if isinstance(token, os.PathLike):
        return os.fspath(token)
    import google.auth.credentials

    if isinstance(token, google.auth.credentials.Credentials):
        return token
    raise TypeError(
        f"storage option token must be a path, a method name, a token string, a dict or google.auth credentials, "
        f"got {type(token).__name__}"
    )


class GCSBackend(ObjectStoreBackend):
    """Options: ``token`` (keyword only: gcsfs's credentials, never from the URI),
    ``project``, ``endpoint_url`` (emulators; STORAGE_EMULATOR_HOST also
    works), ``anon``, ``part_size`` (default 32MiB, at most 32MiB, a multiple of
    64KiB), ``concurrency`` (default 16), ``timeout`` and ``min_throughput`` (when a
    request, gcsfs's retries of it included, is abandoned and sent again:
    :class:`~bcp.backends.objectstore.Timeouts`), ``conditional_writes`` (default true; false
    for emulators that ignore ``ifGenerationMatch``), and the retry options."""

    scheme = "gs"
    credential_options = frozenset({"token"})

    def __init__(
        self, uri: str, bucket: str, root: str, fs: gcsfs.GCSFileSystem, options: StoreOptions, *, api_base: str
    ) -> None:
        super().__init__(uri, bucket, root, fs, options)
        self.api_base = api_base
        #: Whether a request has shown the bucket exists (or that asking cannot tell).
        self._bucket_known = False

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> Self:
        bucket, root = split_bucket_uri(uri, store="GCS", scheme="gs")
        token = _check_token(options.pop("token", None))
        project = options.pop("project", None)
        common = pop_store_options(options, default_part=DEFAULT_PART)
        reject_unknown("gcs", uri, options)
        check_part_size(common.part_size, minimum=256 << 10)
        if token is not None and common.anon:
            raise TypeError("storage options token and anon exclude each other (anon is token='anon')")
        kwargs: dict[str, Any] = {"token": "anon" if common.anon else token}
        if project:
            kwargs["project"] = project
        if common.endpoint_url:
            kwargs["endpoint_url"] = common.endpoint_url
        if common.timeouts.idle is not None:  # each HTTP attempt gcsfs makes goes quiet for at most this
            kwargs["requests_timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=common.timeouts.connect, sock_read=common.timeouts.idle
            )
        fs = OneTryGCSFileSystem(**kwargs)
        if root.startswith(UPLOADS) or f"/{UPLOADS}" in root:
            raise ValueError(f"{uri!r}: {UPLOADS} is reserved for bcp's temporary upload parts")
        clean = f"gs://{bucket}/{root}".rstrip("/")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        api_base = common.endpoint_url or (
            emulator if emulator not in ("", "default") else "https://storage.googleapis.com"
        )
        return cls(clean, bucket, root, fs, common, api_base=api_base.rstrip("/"))

    # -- helpers ---------------------------------------------------------------------------

    def call(self, method: str, path: str, *args: Any, nbytes: int | None = None, **kwargs: Any) -> Any:
        """One JSON API request through gcsfs (with gcsfs's own retries), abandoned
        after the time :class:`Timeouts` allows for ``nbytes`` (by default the size of
        its ``data``)."""
        if nbytes is None:
            nbytes = len(kwargs.get("data") or b"")
        return self.run(self.fs._call, method, path, *args, nbytes=nbytes, **kwargs)

    def upload(self, name: str, data: Buffer, *, if_absent: bool = False) -> dict:
        """Upload object ``name`` (bucket-relative) in one resumable session: the
        object's CRC32C goes in the session's metadata, so the server rejects a body
        that arrives different; the CRC the server reports is checked again here.

        (Resumable rather than a one-request multipart upload: the multipart body
        format is where emulators go wrong, e.g. gcp-storage-emulator drops a final
        ``\\r``; costs one extra round trip per object.)"""
        payload = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        expected = crc32c_b64(payload)
        extra: dict[str, Any] = {"ifGenerationMatch": "0"} if if_absent else {}
        headers, _ = self.call(
            "POST",
            f"{self.api_base}/upload/storage/v1/b/{quote(self.bucket)}/o",
            uploadType="resumable",
            name=name,
            json={"name": name, "crc32c": expected},
            headers={"X-Upload-Content-Type": "application/octet-stream"},
            **extra,
        )
        location = headers["Location"]
        span = f"bytes 0-{len(payload) - 1}/{len(payload)}" if payload else "bytes */0"
        _, body = self.call(
            "PUT", location, data=payload, headers={"Content-Range": span, "Content-Type": "application/octet-stream"}
        )
        out = json.loads(body) if body else {}
        got = out.get("crc32c")
        if got is not None and got != expected:
            self._delete_name(name)
            raise TransientError(
                f"CRC32C mismatch after upload (sent {expected}, stored {got}): corrupted in transit",
                uri=self.uri,
                key=name,
                action="uploading",
            )
        return out

    def compose(self, target: str, sources: list[str]) -> None:
        self.run(self.fs._merge, f"{self.bucket}/{target}", [f"{self.bucket}/{s}" for s in sources])

    def _delete_names(self, names: list[str]) -> None:
        """Delete bucket-relative names in parallel."""
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(self._delete_name, names))

    # -- ObjectStoreBackend hooks ----------------------------------------------------------------

    def _endpoint(self, error: BaseException) -> str:
        return self.api_base

    async def _explain(self, error: Exception) -> Exception | None:
        """A missing bucket, or the endpoint unreachable. gcsfs turns every 404 into a
        bare FileNotFoundError, so the first one asks for the bucket (one request per
        backend; a bucket seen once is not asked for again)."""
        if not self._bucket_known and any(isinstance(e, FileNotFoundError) for e in causes(error)):
            try:
                await asyncio.wait_for(self.fs._call("GET", "b/{}", self.bucket, json_out=True), self.timeouts.limit())
            except FileNotFoundError:
                return OSError(f"no such bucket {self.bucket!r} at {self.api_base}")
            except Exception:  # noqa: BLE001 - cannot tell (e.g. no right to read the bucket): keep the error
                pass
            self._bucket_known = True
        return await super()._explain(error)

    def _new_writer(self, key: str, size: int | None) -> PartWriter[GCSBackend]:
        return _ComposeWriter(self, key, size)

    @property
    def _single_request_max(self) -> int:
        return self.part_size * COMPOSE_MAX

    def _put_object(self, key: str, data: Buffer, *, if_absent: bool = False) -> None:
        self.upload(self._key(key), data, if_absent=if_absent)

    def _past_end(self, error: Exception, key: str, offset: int) -> bool:
        """HTTP 416 (gcsfs raises HttpError or ValueError for it) costs one metadata
        request to tell "past the end" (0 bytes) from "no such object"."""
        text = str(error)
        if getattr(error, "code", None) != 416 and "416" not in text and "range" not in text.lower():
            return False
        return offset >= self.size(key)

    def _list_items(self, full_prefix: str) -> Iterator[dict[str, Any]]:
        token = None
        while True:
            kwargs: dict[str, Any] = {"prefix": full_prefix, "maxResults": 1000}
            if token:
                kwargs["pageToken"] = token
            with annotate(self.uri, full_prefix, "listing"):
                page = self.call("GET", "b/{}/o", self.bucket, json_out=True, **kwargs)
            yield from page.get("items", [])
            token = page.get("nextPageToken")
            if not token:
                return

    def _list_names(self, full_prefix: str) -> Iterator[str]:
        return (item["name"] for item in self._list_items(full_prefix))

    def _key(self, key: str) -> str:
        """As every store's, but a key with a ``.bcp-uploads`` segment is refused: ``list``
        hides those names (composite uploads' temporary parts), so it could never be found."""
        name = super()._key(key)
        if UPLOADS in key.split("/"):
            raise ValueError(f"key {key!r}: {UPLOADS} is reserved for bcp's temporary upload parts")
        return name

    def _hidden(self, name: str) -> bool:
        """A part of an unfinished upload, under this root's ``.bcp-uploads/`` or under that
        of any checkpoint below it (a step's backend keeps its parts in the step's prefix)."""
        return f"/{UPLOADS}/" in "/" + name[len(self.base) :]

    def unfinished(self, prefix: str = "") -> Iterator[Unfinished]:
        """Composite uploads never completed or discarded (a killed writer), one per
        ``.../.bcp-uploads/<id>`` (its parts' directory), aged from its newest part."""
        newest: dict[str, float] = {}
        for item in self._list_items(self.base + prefix):
            rel = item["name"][len(self.base) :]
            head, sep, tail = ("/" + rel).partition(f"/{UPLOADS}/")
            if not sep or "/" not in tail:
                continue
            upload = f"{head[1:]}/{UPLOADS}/{tail.split('/', 1)[0]}".lstrip("/")
            stamp = item.get("updated") or item.get("timeCreated")
            at = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0
            newest[upload] = max(newest.get(upload, 0.0), at)
        now = time.time()
        for upload, at in sorted(newest.items()):
            yield Unfinished(upload, max(0.0, now - at) if at else float("inf"))

    def delete_unfinished(self, name: str) -> None:
        if f"/{UPLOADS}/" not in "/" + name or name.endswith("/"):
            raise ValueError(f"{name!r} is not an unfinished upload reported by this backend")
        self._delete_names(list(self._list_names(self.base + name + "/")))

    def _delete_name(self, name: str) -> None:
        try:
            self.call("DELETE", "b/{}/o/{}", self.bucket, name)
        except FileNotFoundError:
            pass

    # -- the contract --------------------------------------------------------------------

    def size(self, key: str) -> int:
        with annotate(self.uri, key, "sizing"):
            meta = self.call("GET", "b/{}/o/{}", self.bucket, self._key(key), json_out=True)
        return int(meta["size"])

    def delete_prefix(self, prefix: str) -> None:
        """Everything under the prefix, temporary parts of unfinished uploads included."""
        self._delete_names(list(self._list_names(self.base + prefix)))

    def abort_uploads(self) -> int:
        """Delete temporary parts of unfinished composite uploads; how many."""
        names = list(self._list_names(self.base + UPLOADS + "/"))
        self._delete_names(names)
        return len(names)

    def pending_uploads(self) -> list[str]:
        return list(self._list_names(self.base + UPLOADS + "/"))


class _ComposeWriter(PartWriter[GCSBackend]):
    """One upload at commit for a single-part object; otherwise parts as temporary
    objects, composed at commit."""

    store = "GCS"

    def __init__(self, backend: GCSBackend, key: str, size: int | None) -> None:
        super().__init__(backend, key, size, backend.part_size)
        self.parts_prefix = f"{backend.base}{UPLOADS}/{uuid.uuid4().hex}/"
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
        for attempt in range(DISCARD_TRIES):  # the inner backend's calls: bcp's retry loop is around them
            try:
                b._delete_names(list(b._list_names(self.parts_prefix)))
                self._uploaded = False
                return
            except Exception as e:  # noqa: BLE001 - leftovers are invisible; bcp gc removes them (unfinished())
                if attempt + 1 == DISCARD_TRIES:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    log.warning("could not delete temporary parts under %s in %s: %s", self.parts_prefix, b.uri, first)
                else:
                    time.sleep(0.5 * 2**attempt)
