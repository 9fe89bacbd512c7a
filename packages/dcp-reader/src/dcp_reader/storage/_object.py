"""The object-store backend (S3 and compatibles, GCS, Azure) through obstore.

obstore (Rust ``object_store``) releases the GIL while a request runs, so one Python thread
per GET in flight costs little. A range is cut into GETs of ``part_bytes``; ranges closer
than ``coalesce_gap`` share one GET while the gaps read stay within ``max_overread`` of
the wanted bytes (``_parts``: a request's price against a byte's); at most ``concurrency``
run at once per read. Each response is copied into the caller's buffer (the destination tensor where the reader reads
in place) piece by piece as it arrives (``STREAM_BYTES``), so a read holds at most
``concurrency`` such pieces, whatever the size of the range.

Versions: every GET of an object opened for reading carries ``If-Match`` with the ETag its
HEAD saw, and the ETag of each response is compared with it, so the bytes of one open
object all come from one version; another version is ObjectChangedError naming the object.
Writes can be conditional (``put(..., if_absent=True)`` or ``if_match=etag``): the native
writer commits its metadata so, and a second writer's commit fails instead of replacing
the first one's.

Faults: obstore retries 5xx (SlowDown included), connection errors and timeouts with
exponential backoff and jitter; on top of that every GET whose body came back short or
broke off is retried here (backoff with full jitter, from the first byte not yet received)
until ``total_timeout``, then StorageError. A response that stalls longer than
``stall_timeout`` is abandoned and retried. A missing object is MissingFileError naming its
URI; refused credentials are StorageAuthError naming the endpoint and the bucket; an
endpoint that answers a ranged GET with the whole object, or that refuses conditional
writes, is a StorageError at once (retrying cannot help).
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import re
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from .._errors import (
    MissingFileError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    TruncatedFileError,
    UnsafePathError,
    summarise,
)
from ._fetch_count import HeadClaims, metered
from ._names import check_name, name_problem
from ._options import ObjectOptions
from ._settings import check_settings, endpoint_of, endpoint_source, reach
from ._uri import split_uri

logger = logging.getLogger(__name__)

#: The first read of a file's first bytes fetches this many at once and keeps them: a
#: safetensors header is read as 8 bytes then its length, and a torch-dcp blob's zip header
#: likewise: one GET instead of two or three (64 KiB holds the header of a ~500-tensor file).
HEAD_BYTES = 64 * 1024

#: A GET's body is copied into its destination in pieces of at least this size as they
#: arrive: the memory a read holds is ``concurrency`` x this, not its range (measured with
#: tests-integration/storage/test_integ_s3_memory.py: a 256 MiB tensor read from moto on loopback
#: took as long in 1 MiB pieces as in whole 8 MiB bodies; smaller pieces cost more Python
#: calls per byte).
STREAM_BYTES = 1024 * 1024

#: ``DCP_STORAGE_CONDITIONAL_WRITES=false``: commit without If-None-Match / If-Match, for a
#: store that refuses them (then nothing detects a second writer: one job per prefix).
CONDITIONAL_VAR = "DCP_STORAGE_CONDITIONAL_WRITES"

_AUTH_WORDS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
               "InvalidToken", "403 Forbidden", "401 Unauthorized", "Forbidden", "Unauthorized")

# One obstore client per (scheme, bucket, settings, credentials in the environment): a client
# holds the connection pool, and readers of one checkpoint (siblings, ranks' repeated loads)
# reuse its connections instead of paying a TCP and TLS handshake per reader. It starts no
# Python thread.
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
_SHORT = object()  # marks an attempt whose body came back short


class ObjectChangedError(StorageError):
    """An object is not the version a read or a conditional write expected: it was replaced
    (or created, or deleted) by another process meanwhile. ``path`` names its URI."""


def conditional_writes() -> bool:
    """Whether commits use conditional writes (``DCP_STORAGE_CONDITIONAL_WRITES``, default on)."""
    raw = os.environ.get(CONDITIONAL_VAR, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${CONDITIONAL_VAR}={raw!r}: set it to true or false (or unset it)")


class _Heads:
    """First bytes of objects by (URI, ETag, size), least recently used dropped past
    ``limit``: the sibling readers of a load (one per read thread) each open every file
    and would each fetch its header again (8 readers x 4 ranks x 32 files x 64 KiB was 6 %
    of a 1 GiB checkpoint, benchmarks/storage/bench_s3.py); the ETag changes when the object does."""

    def __init__(self, limit: int = 256):
        self.limit, self.lock = limit, threading.Lock()
        self.items: dict[tuple[Any, ...], bytes] = {}

    def get(self, key: tuple[Any, ...]) -> bytes | None:
        with self.lock:
            value = self.items.pop(key, None)
            if value is not None:
                self.items[key] = value
            return value

    def put(self, key: tuple[Any, ...], value: bytes) -> None:
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.limit:
                self.items.pop(next(iter(self.items)))


_HEADS = _Heads()


def _env_key() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))


def _client(scheme: str, bucket: str, opts: ObjectOptions, *, retries: bool = True) -> Any:
    key = (scheme, bucket, opts, retries, _env_key())
    with _CLIENTS_LOCK:
        store = _CLIENTS.get(key)
        if store is None:
            store = _CLIENTS[key] = _make_client(scheme, bucket, opts, retries)
        return store


def _make_client(scheme: str, bucket: str, opts: ObjectOptions, retries: bool = True) -> Any:
    try:
        from obstore.store import from_url
    except ImportError:
        raise ImportError(f"reading {scheme}:// checkpoints needs obstore: pip install 'dcp-reader[s3]' "
                          "(or 'dcp-load[s3]')") from None
    client = {"connect_timeout": timedelta(seconds=min(10.0, opts.stall_timeout)),
              "read_timeout": timedelta(seconds=opts.stall_timeout),
              "pool_max_idle_per_host": str(max(opts.concurrency, 16))}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":  # obstore reads it only without client_options
        client["allow_http"] = True
    retry = {"max_retries": 10 if retries else 0, "retry_timeout": timedelta(seconds=opts.total_timeout),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                         "base": 2}}
    kwargs: dict[str, Any] = {}
    if scheme.startswith("s3"):
        kwargs.update(_aws_settings())
    return from_url(f"{scheme}://{bucket}", client_options=client, retry_config=retry, **kwargs)


def _aws_settings() -> dict[str, Any]:
    """What obstore does not take from the environment itself: credentials and region from the
    AWS config files (a profile), through boto3 when it is installed and no key is set."""
    out: dict[str, Any] = {}
    if "AWS_ACCESS_KEY_ID" in os.environ:
        return out
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return out
    session = boto3.Session()
    if session.get_credentials() is not None:
        out["credential_provider"] = Boto3CredentialProvider(session)
        if session.region_name and not os.environ.get("AWS_REGION"):
            out["region"] = session.region_name
    return out


class ObjectStorage:
    """A checkpoint under ``scheme://bucket/prefix`` (see ``_protocol.Storage``)."""

    #: every call is a request (20-50 ms): list once, open and read on many threads
    local = False

    def __init__(self, root: str, options: ObjectOptions | None = None):
        self.scheme, self.bucket, self.prefix = split_uri(root)
        self.root = f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"
        self.options = options or ObjectOptions.from_env()
        check_settings(self.scheme, self.root)
        self.store = _client(self.scheme, self.bucket, self.options)

    @classmethod
    def create(cls, root: str, options: ObjectOptions | None = None) -> ObjectStorage:
        """The storage of a prefix to write: nothing to make (a prefix exists once an object
        is under it)."""
        return cls(root, options)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.root!r})"

    # -- names -----------------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    path = uri  #: what errors name (``_protocol.Storage.path``)

    def _error(self, e: BaseException, name: str, key: str | None, doing: str) -> Exception:
        """obstore's exception as a typed error naming the URI (and endpoint and bucket)."""
        from obstore.exceptions import (
            NotFoundError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        if isinstance(e, StorageError | MissingFileError):
            return e  # typed already (by the attempt itself)
        text = str(e)
        uri = self.uri(name)
        if "non-partial response" in text:  # object_store's NotPartial: a 200 to a ranged GET
            return _permanent(
                f"{doing}: the endpoint {endpoint_of(self.scheme)} answered a ranged GET with the whole "
                "object (HTTP 200, not 206 Partial Content): it ignores the Range header, and checkpoints are "
                "read by ranges. Point AWS_ENDPOINT_URL at the store's S3 API itself, not at a web server or "
                "a proxy that drops Range", uri, key)
        if isinstance(e, PreconditionError):  # 412 to a GET pinned with If-Match
            return ObjectChangedError(
                "the object changed while it was read: the store no longer holds the version it had when it was "
                f"opened (412 Precondition Failed to If-Match with that ETag, while {doing}). Another process "
                "replaced the object during the read; read it again once that writer is done (a checkpoint "
                "should not be read before its save returned)", path=uri, key=key)
        if isinstance(e, PermissionDeniedError | UnauthenticatedError | PermissionError) or any(w in text for w in _AUTH_WORDS):
            return StorageAuthError(
                f"the object store at {endpoint_of(self.scheme)} refused the credentials for bucket "
                f"{self.bucket!r} while {doing} ({type(e).__name__}: {_first_line(text)}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or the profile in "
                "~/.aws), AWS_ENDPOINT_URL and AWS_REGION", path=uri, key=key)
        if "NoSuchBucket" in text:
            return self._no_bucket(uri, key)
        if isinstance(e, NotFoundError | FileNotFoundError):
            held = f" (for {key!r})" if key is not None else ""
            return MissingFileError(f"object {uri} does not exist{held}; the checkpoint is incomplete or the "
                                    "URI is wrong: check it, or copy the missing object", path=uri, key=key)
        if "builder error" in text:  # the client cannot build the request: no retry can help
            return StorageConfigError(
                f"the object-store client cannot build a request to {endpoint_of(self.scheme)} "
                f"({endpoint_source(self.scheme)}) while {doing} ({_first_line(text)}): check "
                "AWS_ENDPOINT_URL (a full http:// or https:// address) and AWS_ALLOW_HTTP", path=uri, key=key)
        return StorageError(f"{doing} failed at {endpoint_of(self.scheme)} after retries "
                            f"({type(e).__name__}: {_first_line(text)}); check that the endpoint is reachable "
                            "and retry, or raise DCP_STORAGE_TOTAL_TIMEOUT (seconds) for a slow store", path=uri, key=key)

    def _no_bucket(self, uri: str, key: str | None) -> MissingFileError:
        held = f" (for {key!r})" if key is not None else ""
        return MissingFileError(
            f"bucket {self.bucket!r} does not exist at {endpoint_of(self.scheme)} "
            f"({endpoint_source(self.scheme)}){held}: create it (for example `aws s3 mb s3://{self.bucket}` "
            f"with the same endpoint), or check the bucket name in {self.root} and the endpoint",
            path=uri, key=key)

    def _call(self, fn: Any, name: str, key: str | None, doing: str, *args: Any, **kw: Any) -> Any:
        """``fn(store, ...)`` retried as GETs are (``_retrying``)."""
        reach(self.scheme, self.root, min(10.0, self.options.stall_timeout))
        return self._retrying(lambda: fn(self.store, *args, **kw), name, key, doing,
                              time.monotonic() + self.options.total_timeout)

    def _retrying(self, attempt_fn: Any, name: str, key: str | None, doing: str, deadline: float) -> Any:
        """``attempt_fn()`` until it returns something other than ``_SHORT``, retried with
        backoff and full jitter on anything but a missing object or refused credentials
        (obstore retries 5xx and resets itself, but not a connection that broke while its
        body was read, nor a pooled connection the server had closed), until ``deadline``."""
        attempt, last = 0, ""
        while True:
            try:
                out = attempt_fn()
                if not (isinstance(out, tuple) and out and out[0] is _SHORT):
                    return out
                last = out[1]
            except Exception as e:  # noqa: BLE001 - classified: permanent ones raise, the rest retry
                err = self._error(e, name, key, doing)
                if type(err) is not StorageError or getattr(err, "permanent", False):
                    raise err from None
                last = f"{type(e).__name__}: {_short(str(e))}"
            attempt += 1
            pause = random.uniform(0, min(5.0, 0.05 * 2 ** attempt))
            if time.monotonic() + pause > deadline:
                raise StorageError(f"{doing} of {key or 'the object'!r} still failed after {attempt} attempt(s) "
                                   f"within {self.options.total_timeout:g} s (DCP_STORAGE_TOTAL_TIMEOUT); last: "
                                   f"{last}. The object store at {endpoint_of(self.scheme)} is failing or "
                                   "overloaded: retry later", path=self.uri(name), key=key)
            logger.debug("retrying %s of %s in %.3f s (attempt %d): %s", doing, self.uri(name), pause, attempt, last)
            time.sleep(pause)

    # -- the Storage protocol --------------------------------------------------------------
    def list(self) -> dict[str, int]:
        import obstore

        lead = f"{self.prefix}/" if self.prefix else ""

        def listing(store: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            for batch in obstore.list(store, lead or None, chunk_size=1000):
                for meta in batch:
                    out[meta["path"][len(lead):]] = int(meta["size"])
            return out

        return self._call(listing, "", None, "listing the prefix")

    def names(self) -> set[str]:
        """The names at the top level of the root (one listing with a delimiter)."""
        import obstore

        lead = f"{self.prefix}/" if self.prefix else ""
        res = self._call(obstore.list_with_delimiter, "", None, "listing the prefix", lead or None)
        found = {m["path"][len(lead):] for m in res["objects"]}
        found |= {p[len(lead):].rstrip("/") for p in res["common_prefixes"]}
        return found

    def size(self, name: str, *, key: str | None = None) -> int:
        return self.head(name, key=key)[0]

    def head(self, name: str, *, key: str | None = None) -> tuple[int, str | None]:
        """(size, ETag) of the object: one HEAD request."""
        import obstore

        meta = self._call(obstore.head, name, key, "reading the object's size", self.key(name))
        return int(meta["size"]), meta.get("e_tag")

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except MissingFileError:
            return False
        return True

    def open(self, name: str, *, key: str | None = None) -> ObjectFile:
        check_name(name, root=self.root, key=key)
        return ObjectFile(self, name, key)

    handle = open  #: what ``pread_into`` / ``pread_runs`` read (``_protocol.Storage.handle``)

    def map(self, fn: Any, names: Sequence[str]) -> list[Any]:
        """``[fn(n) for n in names]`` on up to 16 threads: each call waits on round trips of
        20-50 ms, which a loop would pay one after the other. The first failure in ``names``
        order is raised, as the loop would."""
        if len(names) < 2:
            return [fn(n) for n in names]
        with ThreadPoolExecutor(min(16, len(names)), thread_name_prefix="dcp-open") as pool:
            futures = [pool.submit(fn, n) for n in names]
            return [f.result() for f in futures]

    def sync(self, *, parent: bool = False) -> None:
        """Nothing to do: an object is durable once its request returned."""

    def read_small(self, name: str, *, limit: int, key: str | None = None) -> bytes:
        f = self.open(name, key=key)
        if f.size > limit:
            raise UnsafePathError(f"{name!r} is {f.size} bytes, more than the {limit} bytes a metadata or index "
                                  "file may have here; the object is corrupt or not a checkpoint file",
                                  path=f.path, key=key)
        buf = bytearray(f.size)
        if f.size:
            f.read_into(buf, 0, key=key)
        return bytes(buf)

    def check_files(self, names: Iterable[tuple[str, str | None]]) -> None:
        by_name: dict[str, str | None] = {}
        for n, k in names:
            by_name.setdefault(n, k)
        unsafe = [n for n in by_name if name_problem(n)]
        if unsafe:
            check_name(unsafe[0], root=self.root, key=by_name[unsafe[0]])  # raises, naming it
        listed = self.list()
        missing = sorted(n for n in by_name if n not in listed)
        if missing:
            raise MissingFileError(f"{len(missing)} object(s) named in the metadata do not exist under "
                                   f"{self.root}: {summarise(missing)}. The checkpoint is incomplete (copy or "
                                   "save interrupted); copy the missing objects or re-save",
                                   path=self.uri(missing[0]), key=by_name[missing[0]], offenders=missing)

    def put(self, name: str, chunks: Sequence[Any], *, if_absent: bool = False, if_match: str | None = None) -> int:
        """One PUT for a small file, else a multipart upload in ``part_bytes`` parts (S3
        shows the object only once the upload completes: an interrupted one leaves none).
        ``if_absent`` (``If-None-Match: *``) or ``if_match`` (an ETag): a conditional write,
        always one PUT, that raises ObjectChangedError when the object is not in that state
        (another writer got there first); a store that refuses conditional writes is a
        StorageError saying so."""
        import obstore

        views = [memoryview(c).cast("B") for c in chunks]
        total = sum(len(v) for v in views)
        if if_absent or if_match:
            self._put_conditional(name, b"".join(views), if_match)
            return total
        multipart = total > self.options.part_bytes
        self._call(obstore.put, name, None, "writing the object", self.key(name),
                   views if multipart else b"".join(views), use_multipart=multipart,
                   chunk_size=self.options.part_bytes, max_concurrency=self.options.concurrency)
        return total

    def _put_conditional(self, name: str, body: bytes, if_match: str | None) -> None:
        """``body`` as ``name`` if the object is absent (``if_match`` None) or has that ETag.
        Sent by a client without obstore's retries, so that a refusal (501) is seen at once;
        failures are retried here. When the object already holds ``body`` (an earlier
        attempt landed, its answer lost), the write succeeded."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, NotSupportedError, PreconditionError

        store = _client(self.scheme, self.bucket, self.options, retries=False)
        state = f"the ETag {if_match}" if if_match else "no object"
        uri = self.uri(name)

        def attempt() -> None:
            try:
                obstore.put(store, self.key(name), body, mode={"e_tag": if_match} if if_match else "create",
                            use_multipart=False)
            except (AlreadyExistsError, PreconditionError, NotFoundError):
                if self._holds(name, body):
                    return
                raise ObjectChangedError(f"the object is no longer what this write expected ({state}): another "
                                         "process wrote or deleted it meanwhile", path=uri) from None
            except Exception as e:  # noqa: BLE001 - a refusal is told apart from a failure
                if isinstance(e, NotSupportedError) or "NotImplemented" in str(e) or "501 Not Implemented" in str(e):
                    raise _permanent(f"the store at {endpoint_of(self.scheme)} does not support conditional "
                                     f"writes (If-None-Match / If-Match on PUT: {_first_line(str(e))[:160]}), which "
                                     "a save's commit uses to refuse a concurrent save into the same prefix. "
                                     f"Set {CONDITIONAL_VAR}=false to commit without them (then nothing detects "
                                     "a second writer: make sure one job saves into a prefix at a time)",
                                     uri, None) from None
                raise

        self._retrying(attempt, name, None, "writing the object (conditionally)",
                       time.monotonic() + self.options.total_timeout)

    def _holds(self, name: str, body: bytes) -> bool:
        """Whether the object exists and its bytes are ``body``."""
        import obstore

        try:
            size, _ = self.head(name)
            return size == len(body) and bytes(obstore.get(self.store, self.key(name)).bytes()) == body
        except MissingFileError:
            return False

    def delete(self, name: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self.store, self.key(name))
        except (NotFoundError, FileNotFoundError):
            return
        except Exception as e:  # noqa: BLE001 - typed below
            raise self._error(e, name, None, "deleting the object") from None

    def delete_many(self, names: Sequence[str]) -> dict[str, str]:
        """Delete ``names`` (bulk requests where the store has them, retried as GETs are);
        returns {name: why} for each one that is still there: the store refused to delete
        it (a bucket policy without s3:DeleteObject) or kept failing."""
        import obstore
        from obstore.exceptions import NotFoundError

        if not names:
            return {}
        try:
            self._call(obstore.delete, "", None, "deleting objects", [self.key(n) for n in names])
            return {}
        except StorageAuthError:
            pass  # refused: find out which, one by one (a policy may deny only some)
        except (StorageError, MissingFileError) as e:
            return dict.fromkeys(names, _first_line(e.message))
        failed = {}
        for n in names:
            try:
                obstore.delete(self.store, self.key(n))
            except NotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - reported, never raised: the caller only warns
                failed[n] = _refusal(str(e))
        return failed

    # -- ranged reads ----------------------------------------------------------------------
    def fetch(self, name: str, spans: Sequence[tuple[int, memoryview]], *, key: str | None,
              etag: str | None = None) -> int:
        """Fill each (offset, view) of ``spans`` (ascending, not overlapping) with the
        object's bytes; returns the bytes fetched (gaps included). Coalesces spans closer
        than ``coalesce_gap`` while the gaps stay within ``max_overread`` (``_parts``), cuts
        the result into GETs of at most ``part_bytes`` and runs up to ``concurrency`` of them
        at once; every wait is bounded by ``total_timeout``.
        Each response is copied into ``spans`` as it arrives, in pieces of ``STREAM_BYTES``,
        so the memory held is bounded by ``concurrency`` pieces whatever the range. With
        ``etag`` (the version the caller opened), every GET is pinned to it: another version
        raises ObjectChangedError, and no byte of it is copied. A failed fetch may leave
        part of ``spans`` filled (with this version's bytes), the rest as it was."""
        parts = _parts(spans, self.options.part_bytes, self.options.coalesce_gap, self.options.max_overread)
        if not parts:  # only empty spans
            return 0
        deadline = time.monotonic() + self.options.total_timeout
        starts = [o for o, _ in spans]
        if len(parts) == 1:
            self._get_into(name, key, *parts[0], spans, starts, etag, deadline)
            return parts[0][1] - parts[0][0]
        with ThreadPoolExecutor(max_workers=min(self.options.concurrency, len(parts)),
                                thread_name_prefix="dcp-get") as pool:
            futures = [pool.submit(self._get_into, name, key, lo, hi, spans, starts, etag, deadline)
                       for lo, hi in parts]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return sum(hi - lo for lo, hi in parts)

    def _get_into(self, name: str, key: str | None, lo: int, hi: int, spans: Sequence[tuple[int, memoryview]],
                  starts: list[int], etag: str | None, deadline: float) -> None:
        """The bytes [lo, hi) of the object, streamed into ``spans``. A body that breaks off
        or comes back short is retried from its first missing byte (pinned to ``etag``, the
        rest comes from the same version)."""
        pos = lo

        def attempt() -> Any:
            nonlocal pos
            got, chunks = self._response(name, pos, hi, etag)
            self._check_version(got, etag, name, key)
            for chunk in chunks:
                n = len(chunk)
                if n > hi - pos:  # obstore checks the range it got; this cannot be retried away either
                    raise _permanent(f"the endpoint {endpoint_of(self.scheme)} sent more than the "
                                     f"{hi - lo} bytes [{lo}, {hi}) asked for: it does not serve byte ranges "
                                     "as S3 does", self.uri(name), key)
                _copy((pos, pos + n), memoryview(chunk), spans, starts)
                pos += n
            return None if pos == hi else (_SHORT, f"short body: {pos - lo} of {hi - lo} bytes")

        self._retrying(attempt, name, key, f"reading bytes [{lo}, {hi})", deadline)

    def _response(self, name: str, lo: int, hi: int, etag: str | None) -> tuple[str | None, Iterable[Any]]:
        """(the response's ETag, its body as buffers of ``STREAM_BYTES`` as they arrive) of
        one GET of [lo, hi), pinned to ``etag``."""
        import obstore

        options: dict[str, Any] = {"range": (lo, hi)}
        if etag:
            options["if_match"] = etag
        res = obstore.get(self.store, self.key(name), options=options)
        return res.meta.get("e_tag"), res.stream(min_chunk_size=STREAM_BYTES)

    def _check_version(self, got: str | None, etag: str | None, name: str, key: str | None) -> None:
        """ObjectChangedError when a response is of another version than ``etag`` (a store
        that ignored If-Match; one that honours it answers 412, classified in ``_error``)."""
        if etag and got and got != etag:
            raise ObjectChangedError(
                f"the object changed while it was read: its ETag was {etag} when it was opened and a "
                f"response now carries {got}. Another process replaced the object during the read; read it "
                "again once that writer is done (a checkpoint should not be read before its save "
                "returned)", path=self.uri(name), key=key)


def _permanent(message: str, uri: str, key: str | None) -> StorageError:
    """A StorageError that ``_retrying`` raises at once: retrying cannot help."""
    err = StorageError(message, path=uri, key=key)
    err.permanent = True  # type: ignore[attr-defined]
    return err


def _refusal(text: str) -> str:
    """The S3 error code and status of a refused request, from obstore's message."""
    code = re.search(r"<Code>(\w+)</Code>", text)
    status = re.search(r"status code: (\d{3}[^:]*)", text)
    return " ".join(x for x in (status and status.group(1), code and code.group(1)) if x) or _short(text)[:200]


def _short(text: str) -> str:
    """obstore's message without its debug dump, on one line."""
    return " ".join(text.split("Debug source:")[0].split())[:400]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def _copy(part: tuple[int, int], body: memoryview, spans: Sequence[tuple[int, memoryview]],
          starts: list[int]) -> None:
    """The bytes of ``body`` (the object's [lo, hi)) into the spans they overlap."""
    lo, hi = part
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(spans) and spans[i][0] < hi:
        off, view = spans[i]
        a, b = max(lo, off), min(hi, off + len(view))
        if a < b:
            view[a - off:b - off] = body[a - lo:b - lo]
        i += 1


#: The prices that decide which gaps one GET reads through (``_parts``): a GET's latency and
#: one stream's bandwidth. Assumed for real S3 (20-50 ms a request, ~100 MB/s a stream: the
#: dcp-reader README, "Object storage"; moto on loopback answers in ~1-3 ms, which would
#: undervalue a request). A gap is read through only when its bytes cost less than a
#: request: below ``REQUEST_S * STREAM_BYTES_PER_S`` (3 MB), and ``coalesce_gap`` caps it.
REQUEST_S = 0.03
STREAM_BYTES_PER_S = 100e6


def _parts(spans: Sequence[tuple[int, memoryview]], part_bytes: int, gap: int,
           max_overread: float) -> list[tuple[int, int]]:
    """The GETs that cover ``spans``: near spans merged, each merged range cut into equal
    parts of at most ``part_bytes``. A gap is read through (one GET instead of two) when it
    is at most ``gap`` bytes and cheaper than a request (``REQUEST_S``), smallest gaps
    first, while the gap bytes read stay within ``max_overread`` x the wanted bytes: gaps
    are usually bytes other ranks own (the other column shards of a row-major tensor), so
    reading them fetches them twice in the job."""
    ranges = sorted((off, off + len(view)) for off, view in spans if len(view))
    if not ranges:
        return []
    wanted = sum(hi - lo for lo, hi in ranges)
    limit = min(gap, int(REQUEST_S * STREAM_BYTES_PER_S))
    budget = max_overread * wanted
    joined = [False] * len(ranges)  # joined[i]: range i shares the GET of range i - 1
    reach = ranges[0][1]
    gaps = []
    for i in range(1, len(ranges)):
        g = ranges[i][0] - reach
        if g <= 0:
            joined[i] = True  # touching or overlapping: free
        elif g <= limit:
            gaps.append((g, i))
        reach = max(reach, ranges[i][1])
    for g, i in sorted(gaps):
        if g > budget:
            break
        budget -= g
        joined[i] = True
    merged: list[list[int]] = []
    for (lo, hi), j in zip(ranges, joined, strict=True):
        if merged and j:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    parts = []
    for lo, hi in merged:
        n = -(-(hi - lo) // part_bytes)
        step = -(-(hi - lo) // n)
        parts.extend((a, min(hi, a + step)) for a in range(lo, hi, step))
    return parts


class ObjectFile:
    """An object opened for reading: its size (one HEAD) and ranged reads."""

    def __init__(self, storage: ObjectStorage, name: str, key: str | None):
        self.storage, self.name = storage, name
        self.path = storage.uri(name)
        self.size, etag = storage.head(name, key=key)
        self.etag = etag  # every later GET is pinned to this version
        # the first bytes, shared by the readers of one process while the object is unchanged
        self._head_key = (self.path, etag, self.size) if etag else None
        self._head: bytes | None = _HEADS.get(self._head_key) if self._head_key else None
        self._own_head = False  # this file's GET fetched ``_head`` (not the process's cache)
        self._claims: HeadClaims | None = None
        self.fetched = 0  # bytes fetched, gaps and header included (``_fetch_count``)

    def join(self, claims: HeadClaims) -> None:
        """Count this file's head in ``claims``' reader (``_fetch_count``): once per reader,
        its whole length when it came from the process's cache."""
        self._claims = claims
        if self._head is not None and self._head_key is not None and claims.claim(self._head_key) \
                and not self._own_head:
            self.fetched += len(self._head)

    def _check(self, offset: int, n: int, key: str | None) -> None:
        if offset < 0 or offset + n > self.size:
            raise TruncatedFileError(f"bytes [{offset}, {offset + n}) of {key!r} run past the end of the "
                                     f"{self.size}-byte object; it is truncated (or was replaced during the "
                                     "load): re-copy or re-save it", path=self.path, key=key)

    def read_into(self, buf: Any, offset: int, *, key: str | None) -> None:
        view = memoryview(buf).cast("B")
        n = len(view)
        self._check(offset, n, key)
        if n == 0:
            return
        if offset + n <= HEAD_BYTES and (self._head is not None or n < HEAD_BYTES // 2):
            if self._head is None:
                head = bytearray(min(self.size, HEAD_BYTES))
                sent = self.storage.fetch(self.name, [(0, memoryview(head))], key=key, etag=self.etag)
                self._count(sent, self._head_key)
                self._head, self._own_head = bytes(head), True
                if self._claims is not None and self._head_key is not None:
                    self._claims.claim(self._head_key)
                if self._head_key:
                    _HEADS.put(self._head_key, self._head)
            view[:] = self._head[offset:offset + n]
            return
        self._count(self.storage.fetch(self.name, [(offset, view)], key=key, etag=self.etag))

    def _count(self, sent: int, head: Any = None) -> None:
        self.fetched += sent
        metered(self.path, sent, head)

    def read_runs(self, out: Any, base: int, offsets: Iterable[int], run: int, *, key: str | None) -> None:
        view = memoryview(out).cast("B")
        spans = [(base + o, view[i * run:(i + 1) * run]) for i, o in enumerate(offsets)]
        if len(spans) * run != len(view):
            raise ValueError(f"read_runs: {len(spans) * run} bytes of runs for a buffer of {len(view)}")
        if spans:
            self._check(spans[0][0], spans[-1][0] + run - spans[0][0], key)
            self._count(self.storage.fetch(self.name, spans, key=key, etag=self.etag))

    def close(self) -> None:
        self._head = None
