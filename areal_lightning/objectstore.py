"""Object-store roots (``s3://``, ``gs://``, ``az://``) through fsspec: the one place that
knows a checkpoint path may be a URI.

A local path stays a :class:`pathlib.Path` everywhere in this package; an object-store path
is a ``str`` URI (``s3://bucket/prefix/...``), and every operation on it goes through the
fsspec file system of :func:`filesystem` (``s3fs``, ``gcsfs``, ``adlfs``: the extras
``areal-lightning[s3]``, ``[gcs]``, ``[azure]``, imported only when such a root is used).

Credentials and endpoint come from each library's standard provider chain (for S3: the
``AWS_*`` environment variables including ``AWS_ENDPOINT_URL``, profiles, instance roles);
``storage_options`` (YAML / callback / ``DCPCheckpointIO`` argument) passes anything else to
the file system. Secrets never appear in messages: :func:`redact`.

Object stores have no rename and no folders: nothing here calls ``makedirs`` (on S3 it may
call ``CreateBucket``, which least-privilege roles refuse), and commits are made with a
marker object written last (:mod:`areal_lightning.commit.generations`).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from areal_lightning.errors import ConfigError, StorageError

__all__ = ["SCHEMES", "StorageError", "is_uri", "uri_scheme", "is_remote", "check_path", "filesystem", "join",
           "redact", "probe", "describe_error", "write_exclusive", "abort_uploads", "list_uploads", "retries"]

log = logging.getLogger(__name__)

SCHEMES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
"""Supported URI schemes: ``scheme -> (fsspec implementation package, areal-lightning extra)``."""

_URI_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SECRET_KEYS = re.compile(r"(secret|token|key|password|credential|sas|sig)", re.IGNORECASE)


def uri_scheme(path: object) -> str | None:
    """The scheme of a ``scheme://`` URI (lower case), else ``None``."""
    match = _URI_RE.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def is_uri(path: object) -> bool:
    """``path`` is a ``scheme://`` URI string."""
    return uri_scheme(path) is not None


def is_remote(path: object) -> bool:
    """``path`` is a URI of a supported object store (see :data:`SCHEMES`)."""
    return uri_scheme(path) in SCHEMES


def check_path(path: object, field: str) -> None:
    """``ConfigError`` naming ``field`` when ``path`` is a URI of an unsupported scheme, or a
    supported one without a bucket (``s3://``). Local paths and supported URIs pass."""
    scheme = uri_scheme(path)
    if scheme is None:
        return
    if scheme not in SCHEMES:
        allowed = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(field, f"{path!r}: the scheme {scheme}:// is not supported; use a POSIX path (local disk or a "
                                 f"shared file system) or an object store: {allowed}")
    bucket = str(path)[len(scheme) + 3:].split("/", 1)[0]
    if not bucket:
        raise ConfigError(field, f"{path!r} names no bucket: expected {scheme}://BUCKET[/PREFIX]")


def bucket_of(uri: str) -> str:
    """``s3://bucket/a/b`` -> ``bucket``."""
    return uri.split("://", 1)[1].split("/", 1)[0]


def join(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended, one ``/`` between each."""
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def parent(uri: str) -> str:
    """The URI one level up."""
    return uri.rstrip("/").rsplit("/", 1)[0]


def name(uri: str) -> str:
    """The last component of ``uri``."""
    return uri.rstrip("/").rsplit("/", 1)[-1]


def redact(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` with the values of secret-looking keys replaced by ``'***'`` (nested too)."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if isinstance(value, Mapping):
            out[key] = redact(value)
        elif _SECRET_KEYS.search(str(key)):
            out[key] = "***"
        else:
            out[key] = value
    return out


def validate_options(options: Any, field: str = "storage_options") -> dict[str, Any]:
    """``options`` as a plain dict (``None`` -> ``{}``), else ``ConfigError`` naming ``field``."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(field, f"expected a mapping of option names to values (or null), got {type(options).__name__}")
    return dict(options)


_FS_LOCK = threading.Lock()
_FS: dict[tuple[str, str], Any] = {}


def filesystem(uri: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec file system of ``uri`` with ``storage_options`` (one instance per scheme and
    options in this process). A missing implementation package is a :class:`ConfigError`
    naming the extra to install."""
    scheme = uri_scheme(uri)
    if scheme not in SCHEMES:
        check_path(uri, "path")
        raise ConfigError("path", f"{uri!r} is not an object-store URI")
    package, extra = SCHEMES[scheme]
    try:
        importlib.import_module(package)
    except ImportError:
        raise ConfigError("fileroot", f"{uri!r} needs the {package} package: pip install 'areal-lightning[{extra}]'") \
            from None
    options = dict(storage_options or {})
    if package == "s3fs":  # transient errors (throttling, 5xx, connection resets): botocore's
        # standard retry mode, exponential backoff with jitter, unless the caller chose otherwise
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "max_attempts": 10})
        options["config_kwargs"] = config
    key = (scheme, json.dumps(options, sort_keys=True, default=repr))
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            from fsspec.core import url_to_fs

            if package == "gcsfs":  # the session's own trace of every request's outcome
                session = dict(options.get("session_kwargs") or {})
                session["trace_configs"] = [*session.get("trace_configs", ()), _gcs_trace()]
                options["session_kwargs"] = session
            fs, _ = url_to_fs(uri, **options)
            if package == "s3fs":
                _count_s3_retries(fs)
            elif package == "adlfs":
                _count_azure_retries(fs)
            _FS[key] = fs
    return fs


_RETRIED = [0]
"""Requests of this process that the object store's client retried (throttling, 5xx, resets)."""
_RETRIED_LOCK = threading.Lock()  # not _FS_LOCK: a client may count while a file system is made under it

_TRANSIENT_STATUS = frozenset({408, 429, 500, 501, 502, 503, 504})
"""The HTTP statuses gcsfs retries (``gcsfs.retry.errs``)."""


def retries() -> int:
    """How many requests to object stores this process had to retry so far (telemetry's
    ``checkpoint/*/retries``): S3, botocore's ``RetryAttempts`` of every response; GCS, the
    requests gcsfs' session saw fail transiently (a status gcsfs retries, or a connection
    error), each retried with backoff unless its retries ran out; Azure, the retries the
    SDK's retry policy granted."""
    return _RETRIED[0]


def _retried(count: int = 1) -> None:
    with _RETRIED_LOCK:
        _RETRIED[0] += count
    log.info("object store: %d request(s) retried after a transient error", count)


def _count_s3_retries(fs: Any) -> None:
    """Count the retries of every S3 call made through ``fs`` (botocore's ``after-call`` event)."""

    def after_call(parsed: Any = None, **_: Any) -> None:
        attempts = (parsed or {}).get("ResponseMetadata", {}).get("RetryAttempts") or 0
        if attempts:
            _retried(attempts)

    try:
        fs.connect()  # the client exists from here on; its events carry the retry counts
        fs.s3.meta.events.register("after-call.s3", after_call)
    except Exception as exc:  # noqa: BLE001 - counting is telemetry; the setup probe reports real failures
        log.debug("object store: retries will not be counted (%r)", exc)


def _gcs_trace() -> Any:
    """An aiohttp ``TraceConfig`` (gcsfs' ``session_kwargs``) counting each request that failed
    with a status gcsfs retries or a connection error."""
    import aiohttp

    trace = aiohttp.TraceConfig()

    async def on_end(session: Any, context: Any, params: Any) -> None:
        if params.response.status in _TRANSIENT_STATUS:
            _retried()

    async def on_exception(session: Any, context: Any, params: Any) -> None:
        if isinstance(params.exception, aiohttp.ClientError):
            _retried()

    trace.on_request_end.append(on_end)
    trace.on_request_exception.append(on_exception)
    return trace


def _count_azure_retries(fs: Any) -> None:
    """Count the retries the Azure SDK's retry policy grants under ``fs``."""
    from areal_lightning._torch_internals import count_azure_retries

    try:
        count_azure_retries(fs, _retried)
    except Exception as exc:  # noqa: BLE001 - counting is telemetry; the setup probe reports real failures
        log.debug("object store: retries will not be counted (%r)", exc)


def strip(fs: Any, uri: str) -> str:
    """``uri`` without its protocol (``bucket/key``), as the file system's methods take it
    (``fs``: the file system the path is for; s3fs, gcsfs and adlfs all take ``bucket/key``)."""
    return uri.split("://", 1)[1].rstrip("/") if "://" in uri else uri.rstrip("/")


def describe_error(exc: BaseException, uri: str, operation: str) -> StorageError:
    """A :class:`StorageError` naming the bucket, the object and the operation, and saying
    what the failure means (missing bucket, access denied, bad credentials, unreachable)."""
    bucket = bucket_of(uri)
    text = str(exc)
    low = text.lower()
    kind = "container" if uri_scheme(uri) in ("az", "abfs", "abfss") else "bucket"
    if (isinstance(exc, FileNotFoundError) and ("bucket" in low or "nosuchbucket" in low)) or \
            "containernotfound" in low or "container does not exist" in low:
        why = f"the {kind} {bucket!r} does not exist (areal-lightning never creates {kind}s: create it first)"
    elif isinstance(exc, PermissionError) or any(w in low for w in ("accessdenied", "access denied", "forbidden",
                                                                     "invalidaccesskeyid", "signaturedoesnotmatch",
                                                                     "authorizationfailure", "authenticationfailed")):
        why = (f"access to the {kind} {bucket!r} was denied ({text.splitlines()[0] if text else ''}); check the "
               "credentials (environment, profile, instance role, storage_options) and that they allow this operation")
    else:
        why = f"{type(exc).__name__}: {text}"
    error = StorageError(f"{operation} {uri} failed: {why}")
    return error


def probe(uri: str, storage_options: Mapping[str, Any] | None, rank: int) -> None:
    """The setup check of an object-store root, run on every rank: write, read and delete one
    small object under ``uri``. Raises :class:`StorageError` naming the bucket and the failed
    operation (a missing bucket, denied access, wrong credentials, an unreachable endpoint)."""
    fs = filesystem(uri, storage_options)
    key = join(uri, f".probe-rank{rank}-{uuid.uuid4().hex[:12]}")
    operation = "write (PUT)"
    try:
        fs.pipe_file(strip(fs, key), b"areal-lightning setup check")
        operation = "read (GET)"
        if fs.cat_file(strip(fs, key)) != b"areal-lightning setup check":
            raise StorageError(f"read (GET) {key}: the object read back differs from the one written")
        operation = "delete (DELETE)"
        fs.rm_file(strip(fs, key))
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated for the user
        raise describe_error(exc, key, f"rank {rank}: the setup check's {operation} of") from exc


def write_exclusive(uri: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Create the object ``uri`` holding ``data``, only if it does not exist (``FileExistsError``
    if it does), with the store's own conditional create: S3 ``If-None-Match: *``, GCS
    ``ifGenerationMatch=0`` (a one-request upload: gcsfs's ``mode="create"``), Azure Blob
    ``If-None-Match: *`` (adlfs's ``overwrite=False``). Used for commit markers and leases.

    A create the store did but whose reply was lost (a timeout, a 503 after the fact) is retried
    by the client and then refused, the object existing: an object holding exactly ``data`` is
    taken as this call's own (markers and leases carry what tells writers apart)."""
    fs = filesystem(uri, storage_options)
    scheme = uri_scheme(uri)
    try:
        if SCHEMES[scheme][0] == "gcsfs":
            fs.pipe_file(strip(fs, uri), data, mode="create")
        elif SCHEMES[scheme][0] == "adlfs":
            fs.pipe_file(strip(fs, uri), data, overwrite=False)
        else:
            with fs.open(strip(fs, uri), "xb") as f:
                f.write(data)
    except FileExistsError:
        try:
            held = fs.cat_file(strip(fs, uri))
        except Exception:  # noqa: BLE001 - unreadable: refused, as the store said
            held = None
        if held != data:
            raise
        log.info("object store: %s was created by this call's own request, retried after its reply was lost", uri)


def _uploads(uri: str, storage_options: Mapping[str, Any] | None) -> Any:
    """``(fs, bucket, prefix, upload)`` of every incomplete multipart upload under ``uri`` (S3)."""
    if uri_scheme(uri) != "s3":
        return
    fs = filesystem(uri, storage_options)
    bucket, _, prefix = strip(fs, uri).partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    marker: dict[str, str] = {}
    while True:  # ListMultipartUploads pages of up to 1,000
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
        for upload in page.get("Uploads", []) or []:
            yield fs, bucket, prefix, upload
        if not page.get("IsTruncated"):
            return
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def list_uploads(uri: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The URIs of the incomplete multipart uploads under ``uri`` (S3 only; others: none)."""
    return [f"s3://{bucket}/{upload['Key']}" for _, bucket, _, upload in _uploads(uri, storage_options)]


def abort_uploads(uri: str, storage_options: Mapping[str, Any] | None = None,
                  keep: Callable[[str], bool] | None = None) -> int:
    """Abort every incomplete multipart upload under the prefix ``uri`` (S3 only; other stores
    keep no invisible partial uploads that this package could list), except those whose key
    relative to ``uri`` ``keep`` accepts. Returns how many."""
    aborted = 0
    for fs, bucket, prefix, upload in _uploads(uri, storage_options):
        if keep is None or not keep(upload["Key"][len(prefix):]):
            fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])
            aborted += 1
    return aborted
