"""One open safetensors file: its header, parsed and checked against the file size once
when the file is opened, and reads of a box of one key as a view of a private memory map
cut with the header's byte offsets (numpy; torch through ``torch.from_numpy``)."""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from ._dtypes import _FROM_CODE, itemsize, numpy_bits_dtype, numpy_dtype
from ._errors import MetadataError, MissingKeyError, TruncatedFileError, summarise
from ._json import load_json
from ._paths import open_regular

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
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > file_size - 8 or n > _HEADER_LIMIT:
        raise TruncatedFileError(f"header length {n} runs past the end of the {file_size}-byte file; "
                                 "the file is truncated or not safetensors: re-copy it", path=name)
    raw = os.pread(fd, n, 8)
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
        return read_header(fd, os.fstat(fd).st_size, os.path.join(root_real, name))
    finally:
        os.close(fd)


class SafetensorsFile:
    """An open safetensors data file (held in the reader's LRU)."""

    def __init__(self, root_real: str, name: str, key: str | None = None):
        self.path = os.path.join(root_real, name)
        self._fd = open_regular(root_real, name, key=key)
        try:
            self.header = read_header(self._fd, os.fstat(self._fd).st_size, self.path)
        except BaseException:
            os.close(self._fd)
            raise
        self._mm: mmap.mmap | None = None

    def entry(self, key: str) -> Entry:
        try:
            return self.header.entries[key]
        except KeyError:
            raise MissingKeyError(f"key {key!r} is not in this safetensors file (it has "
                                  f"{len(self.header.entries)} keys); the checkpoint's metadata and "
                                  "data files do not match: re-save it", path=self.path, key=key) from None

    def array_box(self, key: str, np_dtype: Any, slices: tuple[slice, ...]) -> Any:
        """A numpy view of the box, straight from the memory map and the header's offsets."""
        import numpy as np

        e = self.header.entries[key]
        if e.end == e.start:  # empty tensor: nothing to map (an mmap of 0 bytes is an error)
            return np.empty(e.shape, dtype=np_dtype)[slices]
        if self._mm is None:
            # A private copy-on-write map: views handed out are writable (torch.from_numpy
            # needs that, without a warning) and a write to one never reaches the file.
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            # No speculative readahead around page faults: with the disk's 8 MiB readahead a
            # cold copy of one 4 MiB range fetched 16.1 MiB through a plain map and 4.1 MiB
            # with MADV_RANDOM (BENCHMARKS.md). Each box's own bytes are asked for below.
            if hasattr(mmap, "MADV_RANDOM"):
                self._mm.madvise(mmap.MADV_RANDOM)
        start = self.header.data_start + e.start
        arr = np.ndarray(e.shape, dtype=np_dtype, buffer=self._mm, offset=start)
        self._prefetch(start, e.shape, arr.itemsize, slices)
        return arr[slices] if slices else arr

    def _prefetch(self, start: int, shape: tuple[int, ...], itemsize: int, slices: tuple[slice, ...]) -> None:
        """Ask for the box's bytes. A contiguous box (a dim-0 slice) is read ahead exactly
        (MADV_WILLNEED), since MADV_RANDOM leaves page faults to fetch one page each. A
        strided box touches every row of its span anyway: normal fault readahead is kept
        there, measured 3x faster than page faults inside a WILLNEED span (a cold half of a
        2048 x 2048 float32 tensor by columns: 40 ms against 120 ms, fetching 32 against
        16 MiB)."""
        if not hasattr(mmap, "MADV_WILLNEED") or self._mm is None:
            return
        first = last = 0
        stride = 1
        for dim in range(len(shape) - 1, -1, -1):
            lo, hi = (slices[dim].start or 0, slices[dim].stop) if dim < len(slices) else (0, shape[dim])
            hi = shape[dim] if hi is None else hi
            if hi <= lo:
                return  # an empty box reads nothing
            first += lo * stride
            last += (hi - 1) * stride
            stride *= shape[dim]
        begin = start + first * itemsize
        end = start + (last + 1) * itemsize
        aligned = begin - begin % mmap.PAGESIZE
        box = itemsize
        for dim, size in enumerate(shape):
            sl = slices[dim] if dim < len(slices) else slice(0, size)
            box *= (size if sl.stop is None else sl.stop) - (sl.start or 0)
        contiguous = box == end - begin
        self._mm.madvise(mmap.MADV_WILLNEED if contiguous else mmap.MADV_NORMAL, aligned, end - aligned)

    def numpy_box(self, key: str, dtype: str, slices: tuple[slice, ...]) -> Any:
        return self.array_box(key, numpy_dtype(dtype), slices)

    def torch_box(self, key: str, dtype: str, slices: tuple[slice, ...]) -> Any:
        """A torch view of the box. Measured (README): indexing safetensors'
        ``safe_open(..., "pt").get_slice(key)[slices]`` costs 70-130 us per call here against
        ~10 us for this map + ``torch.from_numpy``; both are lazy views of a file map."""
        import torch

        t = torch.from_numpy(self.array_box(key, numpy_bits_dtype(dtype), slices))
        return t.view(getattr(torch, dtype)) if t.dtype != getattr(torch, dtype) else t

    def close(self) -> None:
        # Never mm.close(): arrays made with np.ndarray(buffer=mm) keep the mmap object alive
        # but not a buffer export, so close() would unmap memory that views handed out still
        # use (a segfault). Dropping the reference unmaps it once the last view is freed.
        self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
