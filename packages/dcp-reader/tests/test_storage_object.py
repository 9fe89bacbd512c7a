"""The object-store backend without a server: how ranges become GETs (every byte covered,
no GET over the part size, near ranges merged, far ones not), that a fetch fills every
destination span exactly, with short bodies and transient errors retried and permanent
ones raised at once, the header cache, the settings from the environment, and URIs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from dcp_reader import MissingFileError, StorageError, TruncatedFileError
from dcp_reader.storage import ObjectOptions, ObjectStorage, is_uri, real_root
from dcp_reader.storage._object import ObjectFile, _parts
from dcp_reader.storage._uri import split_uri
from hypothesis import given, settings
from hypothesis import strategies as st

MiB = 1024 * 1024


@st.composite
def spans(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Ascending, non-overlapping (offset, length) pairs."""
    out, pos = [], draw(st.integers(0, 3 * MiB))
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.integers(0, 20 * MiB))
        out.append((pos, length))
        pos += length + draw(st.integers(0, 3 * MiB))
    return out


@given(spans(), st.sampled_from([5 * MiB, 8 * MiB, 16 * MiB]), st.sampled_from([0, 4096, MiB]))
@settings(max_examples=300, deadline=None)
def test_parts_cover_every_span_within_the_part_size(sp, part, gap):
    views = [(o, _FakeView(n)) for o, n in sp]  # only the lengths matter here
    parts = _parts(views, part, gap, 1.0)
    assert all(0 < hi - lo <= part for lo, hi in parts)
    assert all(a[1] <= b[0] for a, b in zip(parts, parts[1:], strict=False)), "parts overlap or are unordered"
    for o, n in sp:  # every byte of every span lies in some part
        if n:
            covered = sum(max(0, min(hi, o + n) - max(lo, o)) for lo, hi in parts)
            assert covered == n
    fetched = sum(hi - lo for lo, hi in parts)
    assert fetched <= sum(n for _, n in sp) + gap * len(sp)


class _FakeView:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Store(ObjectStorage):
    """An ObjectStorage whose GETs come from memory, optionally failing at first."""

    def __init__(self, data: bytes, *, short: int = 0, flaky: int = 0, options: ObjectOptions | None = None):
        self.scheme, self.bucket, self.prefix, self.root = "s3", "b", "p", "s3://b/p"
        self.options = options or ObjectOptions(total_timeout=5.0)
        self.data, self.short, self.flaky, self.gets = data, short, flaky, 0
        self.lock = threading.Lock()

    def head(self, name, *, key=None):
        if name != "f":
            raise MissingFileError(f"object {self.uri(name)} does not exist", path=self.uri(name), key=key)
        return len(self.data), "etag-1"

    def _response(self, name, lo, hi, etag):
        with self.lock:
            self.gets += 1
            if self.flaky:
                self.flaky -= 1
                raise ConnectionResetError("connection reset by peer")
            if self.short:  # the body ends half way
                self.short -= 1
                return "etag-1", [memoryview(self.data)[lo:lo + (hi - lo) // 2]]
        return "etag-1", [memoryview(self.data)[a:min(hi, a + MiB)] for a in range(lo, hi, MiB)]


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_a_fetch_fills_every_span_exactly(data):
    size = data.draw(st.integers(1, 40 * MiB))
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    store = _Store(raw, options=ObjectOptions(part_bytes=5 * MiB, coalesce_gap=data.draw(st.sampled_from([0, MiB]))))
    sp = [(o, n) for o, n in data.draw(spans()) if o + n <= size]
    bufs = [bytearray(n) for _, n in sp]
    if sp:
        store.fetch("f", [(o, memoryview(b)) for (o, _), b in zip(sp, bufs, strict=True)], key="k")
    for (o, n), b in zip(sp, bufs, strict=True):
        assert bytes(b) == raw[o:o + n]


def test_short_bodies_and_resets_are_retried():
    raw = bytes(range(256)) * 100_000
    store = _Store(raw, short=2, flaky=2)
    buf = bytearray(len(raw))
    store.fetch("f", [(0, memoryview(buf))], key="k")
    assert bytes(buf) == raw and store.gets >= 5


def test_a_fault_that_persists_ends_in_storage_error_within_the_bound():
    store = _Store(b"x" * 1000, flaky=10**9, options=ObjectOptions(total_timeout=0.5))
    buf = bytearray(100)
    with pytest.raises(StorageError) as e:
        store.fetch("f", [(0, memoryview(buf))], key="w")
    assert "s3://b/p/f" in str(e.value) and "ConnectionResetError" in str(e.value)
    assert bytes(buf) == bytes(100), "the destination was written"


def test_object_file_checks_bounds_and_shares_the_header():
    raw = bytes(range(256)) * 1000
    store = _Store(raw)
    f = ObjectFile(store, "f", None)
    head = bytearray(8)
    f.read_into(head, 0, key=None)
    g = ObjectFile(store, "f", None)
    before = store.gets
    g.read_into(head, 8, key=None)  # served from the header fetched by ``f``
    assert store.gets == before and bytes(head) == raw[8:16]
    with pytest.raises(TruncatedFileError):
        f.read_into(bytearray(10), len(raw) - 5, key="k")
    with pytest.raises(MissingFileError):
        ObjectFile(store, "nope", "k")
    out = bytearray(3 * 4)
    f.read_runs(out, 100, [0, 1000, 2000], 4, key=None)
    assert bytes(out) == raw[100:104] + raw[1100:1104] + raw[2100:2104]


def test_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("DCP_STORAGE_CONCURRENCY", "4")
    monkeypatch.setenv("DCP_STORAGE_TOTAL_TIMEOUT", "12.5")
    o = ObjectOptions.from_env()
    assert o.concurrency == 4 and o.total_timeout == 12.5 and o.part_bytes == 8 * MiB
    monkeypatch.setenv("DCP_STORAGE_READERS", "many")
    with pytest.raises(ValueError, match="DCP_STORAGE_READERS"):
        ObjectOptions.from_env()
    with pytest.raises(ValueError, match="part_bytes"):
        ObjectOptions(part_bytes=MiB)


def test_uris():
    assert is_uri("s3://b/x") and is_uri("gs://b") and is_uri("az://c/p") and not is_uri("/tmp/s3://x")
    assert not is_uri("http://host/x") and not is_uri(None)
    assert real_root("s3://bucket//a/b/") == "s3://bucket/a/b"
    assert split_uri("s3://bucket") == ("s3", "bucket", "")
    with pytest.raises(ValueError, match="'..'"):
        split_uri("s3://bucket/a/../b")
    with pytest.raises(ValueError, match="no bucket"):
        split_uri("s3:///x")
