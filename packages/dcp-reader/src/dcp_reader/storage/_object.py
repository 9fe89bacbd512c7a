"""The object-store backend (S3 and compatibles, GCS, Azure) through obstore.

obstore (Rust ``object_store``) releases the GIL while a request runs and hands back the
body as a buffer, so one Python thread per GET in flight costs little and each part is
copied once, from the response straight into the caller's buffer (the destination tensor
where the reader reads in place). A range is cut into GETs of ``part_bytes``; ranges closer
than ``coalesce_gap`` share one GET; at most ``concurrency`` run at once per read.

Faults: obstore retries 5xx (SlowDown included), connection errors and timeouts with
exponential backoff and jitter; on top of that every GET whose body came back short or
broke off is retried here (backoff with full jitter) until ``total_timeout``, then
StorageError. A response that stalls longer than ``stall_timeout`` is abandoned and retried.
A missing object is MissingFileError naming its URI; refused credentials are
StorageAuthError naming the endpoint and the bucket.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from .._errors import (
    MissingFileError,
    StorageAuthError,
    StorageError,
    TruncatedFileError,
    UnsafePathError,
    summarise,
)
from ._names import check_name, name_problem
from ._options import ObjectOptions
from ._uri import split_uri

logger = logging.getLogger(__name__)

#: The first read of a file's first bytes fetches this many at once and keeps them: a
#: safetensors header is read as 8 bytes then its length, and a torch-dcp blob's zip header
#: likewise: one GET instead of two or three (64 KiB holds the header of a ~500-tensor file).
HEAD_BYTES = 64 * 1024

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


class _Heads:
    """First bytes of objects by (URI, ETag, size), least recently used dropped past
    ``limit``: the sibling readers of a load (one per read thread) each open every file
    and would each fetch its header again (8 readers x 4 ranks x 32 files x 64 KiB was 6 %
    of a 1 GiB checkpoint, benchmarks/bench_s3.py); the ETag changes when the object does."""

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


def endpoint_of(scheme: str) -> str:
    """The endpoint requests go to, for messages."""
    if scheme.startswith("s3"):
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or \
            f"https://s3.{region}.amazonaws.com"
    return {"gs": "https://storage.googleapis.com", "gcs": "https://storage.googleapis.com"}.get(
        scheme, "the Azure blob endpoint of the account")


def _client(scheme: str, bucket: str, opts: ObjectOptions) -> Any:
    key = (scheme, bucket, opts, _env_key())
    with _CLIENTS_LOCK:
        store = _CLIENTS.get(key)
        if store is None:
            store = _CLIENTS[key] = _make_client(scheme, bucket, opts)
        return store


def _make_client(scheme: str, bucket: str, opts: ObjectOptions) -> Any:
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
    retry = {"max_retries": 10, "retry_timeout": timedelta(seconds=opts.total_timeout),
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
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        text = str(e)
        uri = self.uri(name)
        if isinstance(e, PermissionDeniedError | UnauthenticatedError | PermissionError) or any(w in text for w in _AUTH_WORDS):
            return StorageAuthError(
                f"the object store at {endpoint_of(self.scheme)} refused the credentials for bucket "
                f"{self.bucket!r} while {doing} ({type(e).__name__}: {_first_line(text)}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (or the profile in "
                "~/.aws), AWS_ENDPOINT_URL and AWS_REGION", path=uri, key=key)
        if isinstance(e, NotFoundError | FileNotFoundError) or "NoSuchBucket" in text:
            where = (f"bucket {self.bucket!r} does not exist at {endpoint_of(self.scheme)}"
                     if "NoSuchBucket" in text else f"object {uri} does not exist")
            return MissingFileError(f"{where} (for {key!r}); the checkpoint is incomplete or the URI is "
                                    "wrong: check it, or copy the missing object", path=uri, key=key)
        return StorageError(f"{doing} failed at {endpoint_of(self.scheme)} after retries "
                            f"({type(e).__name__}: {_first_line(text)}); check that the endpoint is reachable "
                            "and retry, or raise DCP_STORAGE_TOTAL_TIMEOUT (seconds) for a slow store", path=uri, key=key)

    def _call(self, fn: Any, name: str, key: str | None, doing: str, *args: Any, **kw: Any) -> Any:
        """``fn(store, ...)`` retried as GETs are (``_retrying``)."""
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
                if type(err) is not StorageError:
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

    def put(self, name: str, chunks: Sequence[Any]) -> int:
        """One PUT for a small file, else a multipart upload in ``part_bytes`` parts (S3
        shows the object only once the upload completes: an interrupted one leaves none)."""
        import obstore

        views = [memoryview(c).cast("B") for c in chunks]
        total = sum(len(v) for v in views)
        multipart = total > self.options.part_bytes
        self._call(obstore.put, name, None, "writing the object", self.key(name),
                   views if multipart else b"".join(views), use_multipart=multipart,
                   chunk_size=self.options.part_bytes, max_concurrency=self.options.concurrency)
        return total

    def delete(self, name: str) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self.store, self.key(name))
        except (NotFoundError, FileNotFoundError):
            return
        except Exception as e:  # noqa: BLE001 - typed below
            raise self._error(e, name, None, "deleting the object") from None

    # -- ranged reads ----------------------------------------------------------------------
    def fetch(self, name: str, spans: Sequence[tuple[int, memoryview]], *, key: str | None) -> int:
        """Fill each (offset, view) of ``spans`` (ascending, not overlapping) with the
        object's bytes; returns the bytes fetched (gaps included). Coalesces spans closer
        than ``coalesce_gap``, cuts the result into GETs of at most ``part_bytes`` and runs
        up to ``concurrency`` of them at once; every wait is bounded by ``total_timeout``.
        Nothing is written into ``spans`` unless every GET succeeded (the bodies are held
        until then): a failed fetch leaves the destination as it was."""
        parts = _parts(spans, self.options.part_bytes, self.options.coalesce_gap)
        if not parts:  # only empty spans
            return 0
        deadline = time.monotonic() + self.options.total_timeout
        if len(parts) == 1:
            bodies = [self._get(name, key, *parts[0], deadline)]
        else:
            with ThreadPoolExecutor(max_workers=min(self.options.concurrency, len(parts)),
                                    thread_name_prefix="dcp-get") as pool:
                futures = [pool.submit(self._get, name, key, lo, hi, deadline) for lo, hi in parts]
                try:
                    bodies = [f.result() for f in futures]
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
        starts = [o for o, _ in spans]
        for part, body in zip(parts, bodies, strict=True):
            _copy(part, memoryview(body).cast("B"), spans, starts)
        return sum(hi - lo for lo, hi in parts)

    def _get(self, name: str, key: str | None, lo: int, hi: int, deadline: float) -> Any:
        """The bytes [lo, hi) of the object; a short body is retried like an error."""
        import obstore

        def attempt() -> Any:
            body = obstore.get_range(self.store, self.key(name), start=lo, end=hi)
            return body if len(body) == hi - lo else (_SHORT, f"short body: {len(body)} of {hi - lo} bytes")

        return self._retrying(attempt, name, key, f"reading bytes [{lo}, {hi})", deadline)


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


def _parts(spans: Sequence[tuple[int, memoryview]], part_bytes: int, gap: int) -> list[tuple[int, int]]:
    """The GETs that cover ``spans``: near spans merged, each merged range cut into equal
    parts of at most ``part_bytes``."""
    merged: list[list[int]] = []
    for off, view in spans:
        end = off + len(view)
        if end == off:
            continue
        if merged and off - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([off, end])
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
        # the first bytes, shared by the readers of one process while the object is unchanged
        self._head_key = (self.path, etag, self.size) if etag else None
        self._head: bytes | None = _HEADS.get(self._head_key) if self._head_key else None
        self.fetched = 0  # bytes fetched, gaps and header included

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
                self.fetched += self.storage.fetch(self.name, [(0, memoryview(head))], key=key)
                self._head = bytes(head)
                if self._head_key:
                    _HEADS.put(self._head_key, self._head)
            view[:] = self._head[offset:offset + n]
            return
        self.fetched += self.storage.fetch(self.name, [(offset, view)], key=key)

    def read_runs(self, out: Any, base: int, offsets: Iterable[int], run: int, *, key: str | None) -> None:
        view = memoryview(out).cast("B")
        spans = [(base + o, view[i * run:(i + 1) * run]) for i, o in enumerate(offsets)]
        if len(spans) * run != len(view):
            raise ValueError(f"read_runs: {len(spans) * run} bytes of runs for a buffer of {len(view)}")
        if spans:
            self._check(spans[0][0], spans[-1][0] + run - spans[0][0], key)
            self.fetched += self.storage.fetch(self.name, spans, key=key)

    def close(self) -> None:
        self._head = None
