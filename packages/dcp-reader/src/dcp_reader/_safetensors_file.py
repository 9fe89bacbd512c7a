"""One open safetensors file: its header, parsed and checked against the file size once
when the file is opened, and reads of a box of one key (torch through ``safe_open``,
numpy/MindSpore through a read-only memory map and the header's byte offsets)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from ._dtypes import _FROM_CODE, itemsize, numpy_dtype
from ._errors import MetadataError, MissingFileError, MissingKeyError, TruncatedFileError, summarise

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
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MetadataError(f"invalid safetensors header JSON ({e}); the file is corrupt", path=name) from None
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


def read_header_at(path: str, name: str) -> Header:
    """Open, parse the header of, and close a file (metadata discovery for hf formats)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MissingFileError(f"file {name!r} does not exist; the checkpoint is incomplete",
                               path=path) from None
    try:
        return read_header(fd, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


class SafetensorsFile:
    """An open safetensors data file (held in the reader's LRU)."""

    def __init__(self, real_path: str):
        self.path = real_path
        try:
            self._fd = os.open(real_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise MissingFileError("the data file does not exist; the checkpoint is incomplete: copy "
                                   "the missing file or re-save", path=real_path) from None
        try:
            self.header = read_header(self._fd, os.fstat(self._fd).st_size, real_path)
        except BaseException:
            os.close(self._fd)
            raise
        self._st: Any = None
        self._mm: mmap.mmap | None = None

    def entry(self, key: str) -> Entry:
        try:
            return self.header.entries[key]
        except KeyError:
            raise MissingKeyError(f"key {key!r} is not in this safetensors file (it has "
                                  f"{len(self.header.entries)} keys); the checkpoint's metadata and "
                                  "data files do not match: re-save it", path=self.path, key=key) from None

    def torch_box(self, key: str, slices: tuple[slice, ...]) -> Any:
        from safetensors import SafetensorError, safe_open

        try:
            if self._st is None:
                self._st = safe_open(self.path, framework="pt")
            sl = self._st.get_slice(key)
            # 0-dim needs [...]: [:] raises IndexError on a 0-dim slice (FACTS.md)
            return sl[slices] if slices else sl[...]
        except SafetensorError as e:  # a problem our header check does not look for
            raise MetadataError(f"safetensors cannot read key {key!r} ({e}); the file is corrupt: "
                                "re-save it", path=self.path, key=key) from None

    def numpy_box(self, key: str, dtype: str, slices: tuple[slice, ...]) -> Any:
        import numpy as np

        e = self.header.entries[key]
        if e.end == e.start:  # empty tensor: nothing to map (mmap of 0 bytes is an error)
            return np.empty(e.shape, dtype=numpy_dtype(dtype))[slices]
        if self._mm is None:
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        arr = np.ndarray(e.shape, dtype=numpy_dtype(dtype), buffer=self._mm,
                         offset=self.header.data_start + e.start)
        return arr[slices] if slices else arr

    def close(self) -> None:
        st, self._st = self._st, None
        if st is not None and hasattr(st, "__exit__"):
            st.__exit__(None, None, None)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # arrays handed out still view it; the map closes when they are freed
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
