"""One open safetensors file: its header, parsed and checked against the file size once
when the file is opened, and reads of a box of one key with ``preadv`` into memory the
reader owns (the short runs of a strided box copied out of a memory map of their range,
``storage/_mapped.py``), cut with the header's byte offsets (numpy; torch through
``torch.from_numpy``)."""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from .._dtypes import _FROM_CODE, itemsize, numpy_bits_dtype, numpy_dtype
from .._errors import MetadataError, MissingKeyError, TruncatedFileError, summarise
from .._json import load_json
from ..integrity._checksum import BlockSums, read_verified
from ..integrity._hash_worker import HashWorker
from ..storage._mapped import map_runs
from ..storage._pread import close_fd, fd_size, pread_bytes, pread_into
from ..storage._roots import open_regular
from ..storage._scatter import pread_runs

_HEADER_LIMIT = 256 * 1024 * 1024  # a larger header is corrupt (real ones are kilobytes to a few MB)


@dataclass(frozen=True)
class Entry:
    """A key's header entry: safetensors dtype code, shape, byte range in the data section."""

    code: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    entries: dict[str, Entry]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int


def read_header(fd: int, file_size: int, name: str) -> Header:
    """Parse and validate a safetensors header; every error names ``name`` and the key."""
    if file_size < 8:
        raise TruncatedFileError(f"{file_size} bytes is too short for a safetensors file (the 8-byte "
                                 "header length is missing); the file is truncated: re-copy it", path=name)
    (n,) = struct.unpack("<Q", pread_bytes(fd, 8, 0, path=name))
    if n > file_size - 8 or n > _HEADER_LIMIT:
        raise TruncatedFileError(f"header length {n} runs past the end of the {file_size}-byte file; "
                                 "the file is truncated or not safetensors: re-copy it", path=name)
    raw = pread_bytes(fd, n, 8, path=name)
    if len(raw) != n:
        raise TruncatedFileError(f"read {len(raw)} of the {n}-byte header; the file shrank while being read",
                                 path=name)
    doc = load_json(raw, name, "the safetensors header is corrupt: re-copy or re-save the file")
    if not isinstance(doc, dict):
        raise MetadataError("safetensors header is not a JSON object; the file is corrupt", path=name)
    meta = doc.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise MetadataError("safetensors __metadata__ is not an object; the file is corrupt", path=name)
    data_start = 8 + n
    data_len = file_size - data_start
    entries: dict[str, Entry] = {}
    bad: list[tuple[str, str]] = []
    past: list[tuple[str, str]] = []
    for key, e in doc.items():
        try:
            code = e["dtype"]
            shape = tuple(e["shape"])
            start, end = e["data_offsets"]
            ok = (isinstance(code, str) and all(type(s) is int and s >= 0 for s in shape)
                  and type(start) is int and type(end) is int and 0 <= start <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            bad.append((key, f"{key!r}: {e!r:.120}"))
            continue
        if code in _FROM_CODE and end - start != math.prod(shape) * itemsize(_FROM_CODE[code]):
            bad.append((key, f"{key!r}: {end - start} bytes for shape {list(shape)} {code}"))
            continue
        if end > data_len:
            past.append((key, f"{key!r} ends at byte {data_start + end}"))
        entries[key] = Entry(code, shape, start, end)
    prev_key, prev_end = None, 0
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start < prev_end and e.end > e.start:
            bad.append((key, f"{key!r}: bytes [{e.start}, {e.end}) overlap {prev_key!r}"))
        if e.end > prev_end:
            prev_key, prev_end = key, e.end
    if bad:
        raise MetadataError(f"{len(bad)} malformed safetensors header entr(ies): "
                            f"{summarise([m for _, m in bad])}; the file is corrupt: re-save it",
                            path=name, key=bad[0][0], offenders=[k for k, _ in bad])
    if past:
        raise TruncatedFileError(f"the file has {file_size} bytes but its header places data past the "
                                 f"end: {summarise([m for _, m in past])}. The file is truncated (interrupted "
                                 "copy or save): re-copy or re-save it", path=name, key=past[0][0],
                                 offenders=[k for k, _ in past])
    return Header(entries, meta, data_start, file_size)


def read_header_at(root_real: str, name: str) -> Header:
    """Open (a regular file inside ``root_real`` only), parse the header of, and close a
    file (metadata discovery for hf formats)."""
    fd = open_regular(root_real, name)
    try:
        return read_header(fd, fd_size(fd), os.path.join(root_real, name))
    finally:
        close_fd(fd)


class SafetensorsFile:
    """An open safetensors data file (held in the reader's LRU)."""

    def __init__(self, root_real: str, name: str, key: str | None = None):
        self.path = os.path.join(root_real, name)
        self._fd = open_regular(root_real, name, key=key)
        try:
            self.header = read_header(self._fd, fd_size(self._fd), self.path)
        except BaseException:
            close_fd(self._fd)
            raise

    def entry(self, key: str) -> Entry:
        try:
            return self.header.entries[key]
        except KeyError:
            raise MissingKeyError(f"key {key!r} is not in this safetensors file (it has "
                                  f"{len(self.header.entries)} keys); the checkpoint's metadata and "
                                  "data files do not match: re-save it", path=self.path, key=key) from None

    def array_box(self, key: str, np_dtype: Any, slices: tuple[slice, ...], *, sums: BlockSums | None = None,
                  name: str | None = None, worker: HashWorker | None = None) -> Any:
        """A numpy array of the box, read with ``preadv`` into memory it owns (never a view of
        the file: a file truncated under a memory map kills the process with SIGBUS). With
        ``sums``, the whole blocks the box touches are read and verified (hashed as they
        arrive, on ``worker`` when given) before it returns."""
        import numpy as np

        e = self.header.entries[key]
        box = _Box(e.shape, np.dtype(np_dtype).itemsize, slices)
        if box.nbytes == 0:
            return np.empty(box.sizes, dtype=np_dtype)
        if sums is not None and sums.done(box.lo, box.hi):
            sums = None
        if sums is not None:
            lo, hi = sums.span(box.lo, box.hi, e.end - e.start)
        elif box.contiguous or box.hi - box.lo <= 2 * box.nbytes:
            lo, hi = box.lo, box.hi  # read the span, at most 2x the box: one call
        else:
            return self._runs(e, box, np_dtype, key)
        buf = np.empty(hi - lo, dtype=np.uint8)
        if sums is not None:
            read_verified(self._fd, buf, self.header.data_start + e.start + lo, lo, sums, worker=worker,
                          path=self.path, key=key, name=name or key)
        else:
            pread_into(self._fd, buf, self.header.data_start + e.start + lo, path=self.path, key=key)
        return np.ndarray(box.sizes, dtype=np_dtype, buffer=buf, offset=box.lo - lo, strides=box.strides)

    def _runs(self, e: Entry, box: _Box, np_dtype: Any, key: str) -> Any:
        """A sparse box (a few columns of many rows): its runs, scattered (``_scatter``; an
        object fetches near runs with one GET)."""
        import numpy as np

        out = np.empty(box.nbytes, dtype=np.uint8)
        read_runs(self._fd, out, self.header.data_start + e.start, box, path=self.path, key=key)
        return out.view(np_dtype).reshape(box.sizes)

    def read_into(self, key: str, slices: tuple[slice, ...], itemsize: int, out: Any, *,
                  sums: BlockSums | None = None, name: str | None = None,
                  worker: HashWorker | None = None) -> bool:
        """Read a box straight into ``out`` (a writable uint8 buffer of its size): one copy,
        from the page cache into place; a box that is not contiguous in the file by
        scattering reads of its runs (``_scatter``). False (nothing read) when checksums
        still to be verified need more bytes than the box."""
        e = self.header.entries[key]
        box = _Box(e.shape, itemsize, slices)
        if sums is not None and sums.done(box.lo, box.hi):
            sums = None
        if not box.contiguous:
            if sums is not None or not box.nbytes:
                return False  # checksums are over whole blocks: read + verify the span
            read_runs(self._fd, out, self.header.data_start + e.start, box, path=self.path, key=key)
            return True
        if box.nbytes and sums is not None and sums.span(box.lo, box.hi, e.end - e.start) != (box.lo, box.hi):
            return False
        if box.nbytes and sums is not None:
            read_verified(self._fd, out, self.header.data_start + e.start + box.lo, box.lo, sums, worker=worker,
                          path=self.path, key=key, name=name or key)
        elif box.nbytes:
            pread_into(self._fd, out, self.header.data_start + e.start + box.lo, path=self.path, key=key)
        return True

    def covering(self, key: str, slices: tuple[slice, ...], itemsize: int, sums: BlockSums | None
                 ) -> tuple[int, int, _Box, BlockSums | None]:
        """(lo, hi, box, sums): the byte range [lo, hi) of ``key``'s data that covers the box,
        widened to whole checksum blocks while ``sums`` has blocks of it still to verify
        (``sums`` None when none are left)."""
        e = self.header.entries[key]
        box = _Box(e.shape, itemsize, slices)
        if sums is not None and sums.done(box.lo, box.hi):
            sums = None
        if sums is not None and box.nbytes:
            lo, hi = sums.span(box.lo, box.hi, e.end - e.start)
            return lo, hi, box, sums
        return box.lo, box.hi, box, sums

    def read_range(self, key: str, lo: int, out: Any, *, sums: BlockSums | None, name: str | None = None,
                   worker: HashWorker | None = None) -> None:
        """Fill ``out`` (a writable uint8 buffer) with ``key``'s data bytes from ``lo`` (the
        ``lo`` of ``covering``), verifying the blocks with ``sums`` when given."""
        e = self.header.entries[key]
        at = self.header.data_start + e.start + lo
        if sums is not None:
            read_verified(self._fd, out, at, lo, sums, worker=worker, path=self.path, key=key, name=name or key)
        else:
            pread_into(self._fd, out, at, path=self.path, key=key)

    def verify_entry(self, key: str, sums: BlockSums, *, name: str, window_blocks: int = 16,
                     worker: HashWorker | None = None) -> int:
        """Verify every block of ``key`` (ChecksumError at the first bad one), reading
        ``window_blocks`` blocks at a time into one reused buffer. Returns the bytes checked.
        The buffer is a ``bytearray``, not NumPy's: ``dcp verify`` then imports no NumPy
        (0.1-0.4 s of a command that checks a small checkpoint in milliseconds)."""
        e = self.header.entries[key]
        nbytes = e.end - e.start
        window = sums.block * window_blocks
        buf = memoryview(bytearray(min(window, nbytes)))
        for lo in range(0, nbytes, window):
            part = buf[:min(window, nbytes - lo)]
            read_verified(self._fd, part, self.header.data_start + e.start + lo, lo, sums, worker=worker,
                          path=self.path, key=key, name=name)
        return nbytes

    def numpy_box(self, key: str, dtype: str, slices: tuple[slice, ...], **kw: Any) -> Any:
        return self.array_box(key, numpy_dtype(dtype), slices, **kw)

    def torch_box(self, key: str, dtype: str, slices: tuple[slice, ...], **kw: Any) -> Any:
        """A torch tensor of the box (sharing the numpy array's memory, reinterpreted as
        bf16/float8 where numpy has no such type)."""
        import torch

        t = torch.from_numpy(self.array_box(key, numpy_bits_dtype(dtype), slices, **kw))
        return t.view(getattr(torch, dtype)) if t.dtype != getattr(torch, dtype) else t

    def close(self) -> None:
        if self._fd is not None:
            close_fd(self._fd)
            self._fd = None


def read_runs(fd: int | Any, out: Any, base: int, box: _Box, *, path: str, key: str) -> None:
    """Fill ``out`` with the runs of ``box`` of the tensor at file offset ``base``: copied out
    of a memory map of their range when they are short (``_mapped``), else scattered
    (``_scatter``: ``preadv``, or an object's ranged GETs)."""
    sizes, strides = box.run_layout()
    if not map_runs(fd, out, base, box.lo, box.hi, sizes, strides, path=path, key=key):
        pread_runs(fd, out, base, box.run_offsets(), box.run_bytes, path=path, key=key)


class _Box:
    """Where a box of a C-contiguous tensor lies: its byte span [lo, hi) relative to the
    tensor's first byte, its byte strides, and its contiguous runs."""

    def __init__(self, shape: tuple[int, ...], itemsize: int, slices: tuple[slice, ...]):
        bounds = []
        for dim, size in enumerate(shape):
            sl = slices[dim] if dim < len(slices) else slice(0, size)
            lo = sl.start or 0
            bounds.append((lo, size if sl.stop is None else sl.stop))
        self.sizes = tuple(hi - lo for lo, hi in bounds)
        self.nbytes = math.prod(self.sizes) * itemsize
        strides = []
        step = itemsize
        for size in reversed(shape):
            strides.append(step)
            step *= size
        self.strides = tuple(reversed(strides))
        self.lo = sum(lo * st for (lo, _), st in zip(bounds, self.strides, strict=True))
        last = sum((hi - 1) * st for (_, hi), st in zip(bounds, self.strides, strict=True))
        self.hi = last + itemsize if self.nbytes else self.lo
        self.contiguous = self.hi - self.lo == self.nbytes
        # the runs: the trailing dims the box spans whole, plus the first one it does not
        k = len(shape)
        run = itemsize
        while k > 0 and self.sizes[k - 1] == shape[k - 1]:
            k -= 1
            run *= shape[k]
        if k > 0:
            run *= self.sizes[k - 1]
            k -= 1
        self.run_bytes = run
        self._outer = k

    def run_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sizes, strides) of the box's uint8 view: its outer dims, then one run of bytes."""
        k = self._outer
        return (*self.sizes[:k], self.run_bytes), (*self.strides[:k], 1)

    def run_offsets(self) -> Any:
        k = self._outer
        if k == 1:  # rows of a 2-D box, the common case: no per-run arithmetic
            return range(self.lo, self.lo + self.sizes[0] * self.strides[0], self.strides[0])
        return self._offsets(k)

    def _offsets(self, k: int) -> Any:
        import itertools

        ranges = [range(self.sizes[d]) for d in range(k)]
        base = self.lo
        for index in itertools.product(*ranges):
            yield base + sum(i * st for i, st in zip(index, self.strides[:k], strict=True))
