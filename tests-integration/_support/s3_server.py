"""A real S3 server on loopback (moto's ThreadedMotoServer) and a fault-injecting HTTP proxy in
front of it, for the object-storage tests and benchmarks/storage/bench_s3.py.

The proxy forwards each request to the server and can, for the requests a filter selects
(default: ranged GETs, the data reads): answer 503 SlowDown, reset the connection, cut the
body half way, stall after half the body, refuse the credentials (403
InvalidAccessKeyId, what S3 answers for an unknown key), deny a delete (403 AccessDenied,
what a bucket policy without s3:DeleteObject answers, to DELETE and to ``POST ?delete``),
ignore the Range header (a 200 with the whole object), drop the If-Match header (a server
without conditional reads), refuse conditional writes (501 NotImplemented to a PUT with
If-Match or If-None-Match), or run a callback first (``hook``: replace the object, start a
second writer). It can also add a per-request latency and cap each connection's
bandwidth, and it counts requests and bytes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY_ID, SECRET = "testing", "testing-secret"
BAD_KEY = "AKIAWRONGWRONGWRONG"


def start_moto() -> tuple[Any, str]:
    """(the server, its http://127.0.0.1:port endpoint)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def s3_env(endpoint: str, *, key: str = KEY_ID) -> dict[str, str]:
    """The standard AWS variables that point a client at ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def bucket_behind_proxy(bucket: str) -> Iterator[FaultProxy]:
    """A moto server with ``bucket``, a counting ``FaultProxy`` in front and the AWS
    variables pointing at the proxy, for the ``with`` block; the server stops after it."""
    server, endpoint = start_moto()
    try:
        make_bucket(endpoint, bucket)
        with FaultProxy(endpoint) as proxy, env(s3_env(proxy.endpoint)):
            yield proxy
    finally:
        server.stop()


def make_bucket(endpoint: str, bucket: str) -> None:
    conn = http.client.HTTPConnection(endpoint.removeprefix("http://"), timeout=30)
    conn.request("PUT", f"/{bucket}")
    resp = conn.getresponse()
    resp.read()
    if resp.status not in (200, 409):
        raise RuntimeError(f"creating bucket {bucket}: HTTP {resp.status}")


def is_ranged_get(method: str, path: str, headers: Any) -> bool:
    return method == "GET" and "range" in {k.lower() for k in headers}


def is_delete(method: str, path: str, headers: Any) -> bool:
    """DeleteObject, and DeleteObjects (``POST /bucket?delete``)."""
    return method == "DELETE" or (method == "POST" and "?delete" in path)


def is_conditional_put(method: str, path: str, headers: Any) -> bool:
    return method == "PUT" and bool({"if-match", "if-none-match"} & {k.lower() for k in headers})


def put_of(name: str) -> Callable[[str, str, Any], bool]:
    """Selects the PUT of an object whose key ends with ``/name``."""
    return lambda method, path, headers: method == "PUT" and path.split("?")[0].endswith("/" + name)


def replace_object(endpoint: str, path: str) -> None:
    """Replace the object at ``path`` (``/bucket/key``) on the server at ``endpoint`` by one
    of the same size with every byte inverted: a new version, a new ETag (moto accepts
    unsigned requests)."""
    conn = http.client.HTTPConnection(endpoint.removeprefix("http://"), timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"reading {path}: HTTP {resp.status}")
    inverted = (int.from_bytes(data, "little") ^ ((1 << (8 * len(data))) - 1)).to_bytes(len(data), "little")
    conn.request("PUT", path, body=inverted)
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"replacing {path}: HTTP {resp.status}")


@dataclass
class Faults:
    """What the proxy does to the requests ``select`` picks: ``kind`` is one of None,
    "slowdown", "reset", "cut", "stall", "badcreds", "denied" (403 AccessDenied),
    "norange" (the Range header dropped), "noifmatch" (the If-Match header dropped),
    "nocond" (501 NotImplemented), "hook" (``hook(method, path)`` runs, then the request
    goes on); ``count`` of them (then requests pass; -1: all), ``stall_s`` how long a stall
    lasts."""

    kind: str | None = None
    count: int = 0
    stall_s: float = 3600.0
    select: Callable[[str, str, Any], bool] = is_ranged_get
    hook: Callable[[str, str], None] | None = None
    latency_s: tuple[float, float] = (0.0, 0.0)
    bandwidth: float = 0.0  # bytes/s per connection; 0: no cap
    lock: threading.Lock = field(default_factory=threading.Lock)
    gets: int = 0
    get_bytes: int = 0
    requests: int = 0
    lists: int = 0  # bucket listings (GET with a prefix= or list-type= query)
    injected: int = 0
    inflight: int = 0
    max_inflight: int = 0  # most requests served at once (the connections really used)

    def take(self, method: str, path: str, headers: Any) -> str | None:
        with self.lock:
            self.requests += 1
            if self.kind is None or self.count == 0 or not self.select(method, path, headers):
                return None
            if self.count > 0:
                self.count -= 1
            self.injected += 1
            return self.kind

    def reset_counts(self) -> None:
        with self.lock:
            self.gets = self.get_bytes = self.requests = self.injected = self.lists = 0
            self.max_inflight = 0


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")
_NOTIMPL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code><Message>A header you '
            b"provided implies functionality that is not implemented</Message></Error>")
_BADKEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
           b"Access Key Id you provided does not exist in our records.</Message></Error>")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(self.server.upstream, timeout=600)
        return conn

    def _forward(self) -> None:
        faults = self.server.faults
        with faults.lock:
            faults.inflight += 1
            faults.max_inflight = max(faults.max_inflight, faults.inflight)
        try:
            self._serve(faults)
        finally:
            with faults.lock:
                faults.inflight -= 1

    def _serve(self, faults: Faults) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        kind = faults.take(self.command, self.path, self.headers)
        if faults.latency_s[1] > 0:
            time.sleep(random.uniform(*faults.latency_s))
        if kind == "badcreds" or (kind is None and BAD_KEY in (self.headers.get("Authorization") or "")):
            return self._reply(403, _BADKEY)
        if kind == "slowdown":
            return self._reply(503, _SLOWDOWN)
        if kind == "denied":
            return self._reply(403, _DENIED)
        if kind == "nocond":
            return self._reply(501, _NOTIMPL)
        if kind == "hook" and faults.hook is not None:
            faults.hook(self.command, self.path)
        if kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return None
        dropped = {"connection", "keep-alive"} | {"norange": {"range"}, "noifmatch": {"if-match"}}.get(kind or "", set())
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        conn = self._upstream()
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._conn = None
            return self._reply(502, b"upstream failed")
        if self.command == "GET" and "?" in self.path and ("list-type=" in self.path or "prefix=" in self.path):
            with faults.lock:
                faults.lists += 1
        elif self.command == "GET":
            with faults.lock:
                faults.gets += 1
                faults.get_bytes += len(data)
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length",
                                 "server", "date"):
                self.send_header(k, v)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return None
        if kind in ("cut", "stall"):
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            if kind == "stall":
                self.server.stop_event.wait(faults.stall_s)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return None
        self._send(data, faults.bandwidth)
        return None

    def _send(self, data: bytes, bandwidth: float) -> None:
        if not bandwidth:
            self.wfile.write(data)
            return
        view, step, t0 = memoryview(data), 256 * 1024, time.perf_counter()
        for i in range(0, len(view), step):
            self.wfile.write(view[i:i + step])
            ahead = (i + step) / bandwidth - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, faults: Faults):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream.removeprefix("http://")
        self.faults = faults
        self.stop_event = threading.Event()


class FaultProxy:
    """``with FaultProxy(endpoint) as p``: ``p.endpoint`` forwards to ``endpoint``; set
    ``p.faults`` fields to inject faults."""

    def __init__(self, upstream: str, faults: Faults | None = None):
        self.faults = faults or Faults()
        self.upstream = upstream  # the server's endpoint, for requests that bypass the proxy
        self._server = _ProxyServer(upstream, self.faults)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop_event.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
