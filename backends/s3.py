"""Amazon S3 and S3-compatible stores (MinIO, Ceph RGW, rclone serve s3, moto), via s3fs.

``s3://bucket/prefix`` roots a backend at a key prefix. Large objects are multipart
uploads: the write pipeline sends parts of exactly ``part_size`` bytes from several
threads at once, each part numbered by its offset, so parts go up in parallel and a
retried part simply replaces itself. The object becomes visible only when the upload
completes (S3 has no rename; the checkpoint's commit is its manifest, written last
with ``If-None-Match: *``). A writer that fails or is aborted aborts its multipart
upload, so no parts are left billed and invisible. Every PUT and part carries its
CRC32C (``x-amz-checksum-crc32c``), which AWS checks on arrival.

Credentials come from ``storage_options`` (``key``, ``secret``, ``token``, as s3fs
takes them: one process can use several accounts) or else the standard AWS sources
(environment, shared config and credentials files, ``profile=``, instance/container
roles); never from the URI, which is printed and logged. They are never stored,
logged or shown in errors. s3fs's and botocore's own retry loops are switched off:
:class:`~bcp.backends.wrappers.RetryingBackend` is the one loop.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, Self

import botocore.exceptions  # type: ignore[import-untyped]  # no stubs; s3fs depends on it
import s3fs

from bcp.backends.base import Buffer, Unfinished
from bcp.backends.objectstore import (
    ObjectStoreBackend,
    StoreOptions,
    causes,
    check_credential,
    pop_store_options,
    split_bucket_uri,
)
from bcp.backends.parts import PartWriter, crc32c_b64
from bcp.backends.storage_errors import StorageError, annotate
from bcp.backends.uri_options import MAX_PART_SIZE, PART_SIZE_MULTIPLE, check_part_size, reject_unknown

log = logging.getLogger(__name__)

MIN_PART = 5 << 20  # S3's smallest part (all but the last)
MAX_PARTS = 10_000
DEFAULT_PART = 16 << 20
#: A single PUT up to this size; larger whole-object writes go multipart.
SINGLE_PUT_MAX = 64 << 20

#: Credential options, by what s3fs calls them, and the other names they go by
#: (botocore's, MinIO's, s3fs's ``username``/``password``). Taken from
#: ``storage_options`` only; a URI carrying any of them is refused.
_CREDENTIAL_ALIASES = {
    "key": ("key", "aws_access_key_id", "access_key", "username"),
    "secret": ("secret", "aws_secret_access_key", "secret_key", "password"),
    "token": ("token", "aws_session_token", "session_token"),
}
_CREDENTIAL_OPTIONS = frozenset(name for names in _CREDENTIAL_ALIASES.values() for name in names)


def credential_sources(profile: str | None) -> str:
    """Where botocore looks for credentials, for an error that found none: the
    files' paths and the variables' names, never a value."""
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
    config = os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"
    chosen = profile or os.environ.get("AWS_PROFILE")
    where = f"profile {chosen!r} of " if chosen else ""
    return (
        "storage_options key and secret, the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), "
        f"{where}the shared credentials file {shared} and the config file {config}, "
        "and an instance or container role"
    )


def pop_credentials(options: dict[str, Any]) -> dict[str, str]:
    """Pop the credential options into s3fs's ``key``/``secret``/``token``, checked:
    one name per credential, strings, ``key`` and ``secret`` together, ``token`` only
    with them. Errors name options, never values."""
    found: dict[str, str] = {}
    for canonical, names in _CREDENTIAL_ALIASES.items():
        given = [name for name in names if name in options]
        if len(given) > 1:
            raise TypeError(f"options {' and '.join(given)} are the same credential; give one")
        if given:
            found[canonical] = check_credential(given[0], options.pop(given[0]))
    if ("key" in found) != ("secret" in found):
        raise TypeError("storage options key and secret go together (the access key id and its secret)")
    if "token" in found and "key" not in found:
        raise TypeError("storage option token (a session token) needs key and secret too")
    return found


class S3Backend(ObjectStoreBackend):
    """Options (URI query or keyword): ``endpoint_url``, ``region``, ``profile``,
    ``key``/``secret``/``token`` (keyword only: credentials never come from the URI),
    ``anon``, ``part_size`` (default 16MiB, 5MiB..32MiB, a multiple of 64KiB),
    ``concurrency`` (parallel requests per process, default 16), ``timeout`` and
    ``min_throughput`` (when a request is abandoned and sent again:
    :class:`~bcp.backends.objectstore.Timeouts`), ``checksum``
    (``crc32c`` or ``none``), ``conditional_writes`` (default true: the store honours
    ``If-None-Match: *``; set false for stores that ignore it, such as rclone, and
    the commit falls back to check-then-write), plus the retry options of
    :func:`~bcp.backends.retry.policy_from_options`."""

    scheme = "s3"
    credential_options = _CREDENTIAL_OPTIONS

    def __init__(
        self,
        uri: str,
        bucket: str,
        root: str,
        fs: s3fs.S3FileSystem,
        options: StoreOptions,
        *,
        checksum: bool,
        profile: str | None = None,
    ) -> None:
        super().__init__(uri, bucket, root, fs, options)
        self.checksum = checksum
        self.profile = profile

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> Self:
        bucket, root = split_bucket_uri(uri, store="S3", scheme="s3")
        credentials = pop_credentials(options)
        region = options.pop("region", None)
        profile = options.pop("profile", None)
        common = pop_store_options(options, default_part=DEFAULT_PART)
        if credentials and (profile or common.anon):
            raise TypeError(f"storage options key/secret and {'profile' if profile else 'anon'} exclude each other")
        checksum = str(options.pop("checksum", "crc32c")).lower()
        reject_unknown("s3", uri, options)
        if checksum not in ("crc32c", "none"):
            raise ValueError(f"option checksum={checksum!r}: choose crc32c or none")
        check_part_size(common.part_size, minimum=MIN_PART, maximum=MAX_PART_SIZE)
        client_kwargs = {}
        if common.endpoint_url:
            client_kwargs["endpoint_url"] = common.endpoint_url
        if region:
            client_kwargs["region_name"] = region
        config = {
            "retries": {"total_max_attempts": 1},  # RetryingBackend is the one retry loop
            "max_pool_connections": max(10, 2 * common.concurrency),
            # We send CRC32C ourselves; botocore's default would add a CRC32 pass.
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
        if common.timeouts.idle is not None:  # a connection that cannot open, or goes quiet
            config["connect_timeout"] = common.timeouts.connect
            config["read_timeout"] = common.timeouts.idle
        fs = s3fs.S3FileSystem(
            **credentials,
            anon=common.anon,
            profile=profile,
            client_kwargs=client_kwargs,
            config_kwargs=config,
            use_listings_cache=False,
            max_concurrency=common.concurrency,
        )  # cached per options
        fs.retries = 1
        clean = f"s3://{bucket}/{root}".rstrip("/")
        return cls(clean, bucket, root, fs, common, checksum=checksum == "crc32c", profile=profile)

    # -- helpers ---------------------------------------------------------------------------

    def call(self, method: str, *, nbytes: int | None = None, extra: float = 0.0, **kwargs: Any) -> Any:
        """One S3 API call on s3fs's event loop (errors translated to OSError by s3fs),
        abandoned after the time :class:`Timeouts` allows for ``nbytes`` (by default
        the size of its ``Body``) plus ``extra`` seconds."""
        if nbytes is None:
            nbytes = len(kwargs.get("Body", b""))
        return self.run(self.fs._call_s3, method, nbytes=nbytes, extra=extra, **kwargs)

    def put(self, key: str, data: Buffer, *, if_absent: bool = False) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key), "Body": bytes(data)}
        if self.checksum:
            kwargs["ChecksumCRC32C"] = crc32c_b64(data)
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        self.call("put_object", **kwargs)

    # -- ObjectStoreBackend hooks ----------------------------------------------------------------

    async def _explain(self, error: Exception) -> Exception | None:
        """No credentials anywhere, a profile that is not there, a bucket that does not
        exist (only requests with an answer body can tell: a HEAD's 404 cannot), or the
        endpoint unreachable."""
        for e in causes(error):
            if isinstance(e, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
                found = "no" if isinstance(e, botocore.exceptions.NoCredentialsError) else "incomplete"
                return PermissionError(
                    errno.EACCES,
                    f"{found} AWS credentials found; looked in {credential_sources(self.profile)} "
                    "(anon=true reads a public bucket without them)",
                )
            if isinstance(e, botocore.exceptions.ProfileNotFound):
                config = os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"
                shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
                return PermissionError(
                    errno.EACCES, f"AWS profile {e.kwargs.get('profile')!r} is in neither {config} nor {shared}"
                )
            response = getattr(e, "response", None)
            if isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "NoSuchBucket":
                return OSError(f"no such bucket {self.bucket!r} at {self._endpoint(error)}")
        return await super()._explain(error)

    def _new_writer(self, key: str, size: int | None) -> PartWriter[S3Backend]:
        return _S3Writer(self, key, size)

    @property
    def _single_request_max(self) -> int:
        return SINGLE_PUT_MAX

    def _put_object(self, key: str, data: Buffer, *, if_absent: bool = False) -> None:
        self.put(key, data, if_absent=if_absent)

    def _lost_race(self, error: OSError) -> bool:
        text = str(error)
        return isinstance(error, FileExistsError) or "PreconditionFailed" in text or "pre-condition" in text

    def _past_end(self, error: Exception, key: str, offset: int) -> bool:
        if not isinstance(error, OSError) or "range" not in str(error).lower():
            return False
        self.size(key)  # InvalidRange: at or past the end (or missing: this raises)
        return True

    def _list_names(self, full_prefix: str) -> Iterator[str]:
        shown = full_prefix.removeprefix(self.base)  # errors name the prefix relative to the root
        token = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            with annotate(self.uri, shown, "listing"):
                page = self.call("list_objects_v2", **kwargs)
            for item in page.get("Contents", []):
                yield item["Key"]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _delete_name(self, name: str) -> None:
        try:
            self.call("delete_object", Bucket=self.bucket, Key=name)
        except FileNotFoundError:
            pass

    # -- the contract --------------------------------------------------------------------

    def size(self, key: str) -> int:
        with annotate(self.uri, key, "sizing"):
            head = self.call("head_object", Bucket=self.bucket, Key=self._key(key))
        return int(head["ContentLength"])

    def delete_prefix(self, prefix: str) -> None:
        """Batched deletes (1000 keys a request), then aborts multipart uploads left
        under the prefix by killed writers."""
        keys = list(self.list(prefix))
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            with annotate(self.uri, prefix, "deleting"):
                out = self.call("delete_objects", Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = out.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"{len(errors)} object(s) not deleted; first: {first.get('Code')} {first.get('Message')}",
                    uri=self.uri,
                    key=first.get("Key", prefix),
                    action="deleting",
                )
        self.abort_uploads(prefix)

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort unfinished multipart uploads under ``prefix``; how many were aborted."""
        uploads = self._uploads(prefix)
        for up in uploads:
            with annotate(self.uri, up["Key"], "aborting upload of"):
                try:
                    self.call("abort_multipart_upload", Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                except FileNotFoundError:
                    pass
        return len(uploads)

    def pending_uploads(self, prefix: str = "") -> list[str]:
        """Keys with unfinished multipart uploads (for tests and ``bcp gc``)."""
        return [u["Key"] for u in self._uploads(prefix)]

    def unfinished(self, prefix: str = "") -> Iterator[Unfinished]:
        """Multipart uploads never completed or aborted (a killed writer), aged from
        their initiation; named ``<key>#upload=<upload id>``."""
        now = time.time()
        for up in self._uploads(prefix):
            key = up["Key"][len(self.base) :]
            initiated = up.get("Initiated")
            age = now - initiated.timestamp() if initiated is not None else float("inf")
            yield Unfinished(f"{key}{_UPLOAD_SEP}{up['UploadId']}", age)

    def delete_unfinished(self, name: str) -> None:
        key, sep, upload_id = name.rpartition(_UPLOAD_SEP)
        if not sep or not key or not upload_id:
            raise ValueError(f"{name!r} is not an unfinished upload reported by this backend")
        with annotate(self.uri, key, "aborting upload of"):
            try:
                self.call("abort_multipart_upload", Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
            except FileNotFoundError:
                pass

    def _uploads(self, prefix: str) -> list[dict]:
        """Every unfinished multipart upload under ``prefix``, page by page (1,000 a page)."""
        found: list[dict] = []
        markers: dict[str, Any] = {}
        with annotate(self.uri, prefix, "listing uploads"):
            while True:
                try:
                    page = self.call("list_multipart_uploads", Bucket=self.bucket, Prefix=self.base + prefix, **markers)
                except FileNotFoundError:  # rclone answers 404 for a prefix with nothing under it
                    return found
                key, upload = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
                after = {"KeyMarker": key, "UploadIdMarker": upload or ""}
                if after == markers:  # a store answering the same page again: that page is counted once
                    return found
                found += page.get("Uploads") or []
                if not page.get("IsTruncated") or not key:
                    return found
                markers = after


#: Separates an unfinished upload's key from its upload id in ``unfinished()`` names.
_UPLOAD_SEP = "#upload="


class _S3Writer(PartWriter[S3Backend]):
    """A small object is one PUT at commit; anything of a full part or more is a
    multipart upload started by the first part and completed at commit."""

    store = "S3"

    def __init__(self, backend: S3Backend, key: str, size: int | None) -> None:
        super().__init__(backend, key, size, backend.part_size)
        if size is not None and -(-size // self.part) > MAX_PARTS:
            need = -(-size // MAX_PARTS // PART_SIZE_MULTIPLE) * PART_SIZE_MULTIPLE
            advice = (
                f"raise part_size to at least {need} ({need / 2**20:.2f} MiB)"
                if need <= MAX_PART_SIZE
                else f"even parts of {MAX_PART_SIZE >> 20} MiB (the largest) are too few: save from more ranks, "
                "so each rank's share is smaller"
            )
            raise ValueError(
                f"{key!r} is {size} bytes: more than {MAX_PARTS} parts of part_size={self.part} (S3's limit); {advice}"
            )
        self._upload_id: str | None = None
        #: A start whose answer never came may have created an upload all the same.
        self._start_failed = False

    def _start(self) -> str:
        with self._lock:
            if self._upload_id is None:
                b = self.backend
                kwargs: dict[str, Any] = {"Bucket": b.bucket, "Key": b._key(self.key)}
                if b.checksum:
                    kwargs["ChecksumAlgorithm"] = "CRC32C"
                with annotate(b.uri, self.key, "starting upload of"):
                    try:
                        self._upload_id = b.call("create_multipart_upload", **kwargs)["UploadId"]
                    except Exception:
                        self._start_failed = True
                        raise
            return self._upload_id

    def _abort_strays(self) -> None:
        """Abort uploads of this key other than the live one: ones a start created
        although its answer was lost (the key is unique to this save, so no one else's)."""
        with self._lock:
            if not self._start_failed:
                return
            self._start_failed = False
            keep = self._upload_id
        b = self.backend
        name = b._key(self.key)
        try:
            try:
                uploads = b.call("list_multipart_uploads", Bucket=b.bucket, Prefix=name).get("Uploads") or []
            except FileNotFoundError:  # rclone answers 404 when there are none
                uploads = []
            for up in uploads:
                if up["Key"] == name and up["UploadId"] != keep:
                    b.call("abort_multipart_upload", Bucket=b.bucket, Key=name, UploadId=up["UploadId"])
        except Exception as e:  # noqa: BLE001 - orphans are invisible; bcp gc aborts them later
            log.warning("could not abort stray uploads of %r in %s: %s", self.key, b.uri, e)

    def upload_part(self, index: int, data: Buffer) -> dict:
        number = index + 1
        if number > MAX_PARTS:  # a writer of unknown size (a known one was checked up front)
            raise ValueError(f"{self.key!r} needs more than {MAX_PARTS} parts of {self.part} bytes; raise part_size")
        b = self.backend
        kwargs: dict[str, Any] = {
            "Bucket": b.bucket,
            "Key": b._key(self.key),
            "UploadId": self._start(),
            "PartNumber": number,
            "Body": bytes(data),
        }
        if b.checksum:
            kwargs["ChecksumCRC32C"] = crc32c_b64(data)
            kwargs["ChecksumAlgorithm"] = "CRC32C"
        out = b.call("upload_part", **kwargs)
        entry = {"PartNumber": number, "ETag": out["ETag"]}
        if b.checksum:
            entry["ChecksumCRC32C"] = out.get("ChecksumCRC32C") or kwargs["ChecksumCRC32C"]
        return entry

    def put_whole(self, data: bytes) -> None:
        self.backend.put(self.key, data)

    def complete(self, entries: list[dict], size: int) -> None:
        b = self.backend
        try:
            b.call(
                "complete_multipart_upload",
                extra=0.1 * len(entries),  # assembling many parts takes S3 a while (it sends keep-alive spaces)
                Bucket=b.bucket,
                Key=b._key(self.key),
                UploadId=self._upload_id,
                MultipartUpload={"Parts": entries},
            )
        except FileNotFoundError:
            # NoSuchUpload: a retried complete whose first attempt succeeded.
            if b.size(self.key) != size:
                raise
        self._upload_id = None  # completed: nothing to abort (discard, which follows, aborts strays)

    def discard(self) -> None:
        self._abort_strays()
        if self._upload_id is None:
            return
        b = self.backend
        upload_id, self._upload_id = self._upload_id, None
        for attempt in (1, 2):
            try:
                b.call("abort_multipart_upload", Bucket=b.bucket, Key=b._key(self.key), UploadId=upload_id)
                return
            except FileNotFoundError:
                return
            except Exception as e:  # noqa: BLE001 - any failure (SDKs raise more than OSError): retried once
                if attempt == 2:  # orphaned: delete_prefix / bcp gc abort it later
                    log.warning("could not abort multipart upload of %r in %s: %s", self.key, b.uri, e)
