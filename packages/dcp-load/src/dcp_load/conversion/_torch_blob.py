"""The ``torch.save`` blob of one tensor, split around its data, for ``--to torch-dcp``.

torch.distributed.checkpoint stores each tensor as a ``torch.save`` blob: an uncompressed
zip whose ``<archive>/data/<key>`` record holds the raw storage, with the data-descriptor
flag set (the local headers hold no sizes or CRC-32; a descriptor after each record's data
and the central directory hold them). Everything before the data depends only on the
tensor's dtype and shape, and everything after it on those and on the data's CRC-32.

So a conversion can place every blob before reading anything: ``template`` has torch itself
save a stand-in tensor (its storage an untouched anonymous mapping, never read: CRC-32 is
switched off for that call, so no page is faulted in), keeps the bytes written around the
stand-in's storage, gives every small record its CRC-32, and notes the two places the data
record's CRC-32 goes. The data is then filled in place, like any output tensor, and its
CRC-32 written there (``patch_crc``).
"""

from __future__ import annotations

import mmap
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any

__all__ = ["BlobTemplate", "template"]

_CENTRAL, _LOCAL, _DESCRIPTOR = b"PK\x01\x02", b"PK\x03\x04", b"PK\x07\x08"
_EOCD64_LOCATOR, _EOCD64 = b"PK\x06\x07", b"PK\x06\x06"
_LOCK = threading.Lock()  # torch's CRC-32 switch is process-wide: one template at a time


@dataclass(frozen=True)
class BlobTemplate:
    """A tensor's blob without its data: ``head`` + ``nbytes`` data bytes + ``tail``, and
    the blob-relative offsets of the data record's two CRC-32 fields (its descriptor's and
    its central directory entry's)."""

    head: bytes
    nbytes: int
    tail: bytes
    crc_at: tuple[int, int] | None

    @property
    def size(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


class _Split:
    """A stream ``torch.save`` writes into: keeps every byte except those of the stand-in's
    storage (address range ``[lo, hi)``), which it only counts."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.kept = bytearray()
        self.pos = 0
        self.cut: int | None = None
        self.skipped = 0

    def write(self, data: Any) -> int:
        import numpy as np

        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if n:
            addr = np.frombuffer(mv, np.uint8).ctypes.data
            if self.lo <= addr and addr + n <= self.hi:
                if self.cut is None:
                    self.cut = self.pos
                elif self.cut + self.skipped != self.pos:
                    raise RuntimeError("torch.save wrote a tensor's storage in pieces apart")
                self.skipped += n
            else:
                self.kept += mv
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def _stand_in(shape: tuple[int, ...], dtype: str) -> tuple[Any, Any]:
    """(a tensor of ``shape`` and ``dtype`` whose storage is exactly its elements, in an
    anonymous mapping no one touches; the mapping)."""
    import torch

    dt = getattr(torch, dtype)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dt).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dt), None
    anon = mmap.mmap(-1, nbytes)
    return torch.frombuffer(anon, dtype=torch.uint8).view(dt).view(shape), anon


def template(shape: tuple[int, ...], dtype: str) -> BlobTemplate:
    """The blob ``torch.save`` writes for a contiguous CPU tensor of ``shape`` and ``dtype``
    (the ``TORCH_SAVE`` serialization of ``FileSystemWriter``), without its data."""
    import torch
    from torch.utils.serialization import config

    t, anon = _stand_in(tuple(shape), dtype)
    lo = t.data_ptr()
    nbytes = t.numel() * t.element_size()
    out = _Split(lo, lo + nbytes)
    try:
        with _LOCK:
            old = config.save.compute_crc32
            config.save.compute_crc32 = False
            try:
                torch.save(t, out)
            finally:
                config.save.compute_crc32 = old
    finally:
        del t
        if anon is not None:
            anon.close()
    if out.skipped != nbytes:
        raise RuntimeError(f"torch.save wrote {out.skipped} of the {nbytes} bytes of a {dtype} {tuple(shape)} "
                           "tensor's storage where expected; this torch's format is not supported by convert")
    return _finish(out.kept, out.cut, nbytes)


def _finish(kept: bytearray, cut: int | None, nbytes: int) -> BlobTemplate:
    """Give each record but the data's its CRC-32 and locate the data's CRC-32 fields."""
    entries = _central_entries(kept, cut or 0, nbytes)
    crc_at = None
    for central, data_start, size, crc_field in entries:
        if nbytes and data_start == cut:
            if size != nbytes:
                raise RuntimeError(f"the storage record holds {size} bytes, expected {nbytes}")
            crc_at = (crc_field, central + 16)
            continue
        crc = zlib.crc32(_at(kept, cut, nbytes, data_start, size)) if size else 0
        for pos in (crc_field, central + 16):
            where = _at_pos(cut, nbytes, pos)
            if where is None:
                raise RuntimeError("a record of the blob lies inside the tensor's data")
            struct.pack_into("<I", kept, where, crc)
    if nbytes and crc_at is None:
        raise RuntimeError("no record of the blob holds the tensor's storage")
    split = len(kept) if cut is None else cut
    return BlobTemplate(bytes(kept[:split]), nbytes, bytes(kept[split:]), crc_at)


def _at_pos(cut: int | None, nbytes: int, pos: int) -> int | None:
    """Where blob position ``pos`` lies in the kept bytes (None: inside the data)."""
    if cut is None or pos < cut:
        return pos
    if pos < cut + nbytes:
        return None
    return pos - nbytes


def _at(kept: bytearray, cut: int | None, nbytes: int, pos: int, n: int) -> bytes:
    """``n`` bytes of the blob at ``pos``, outside the data."""
    start = _at_pos(cut, nbytes, pos)
    end = _at_pos(cut, nbytes, pos + n - 1) if n else start
    if start is None or end is None or (n and end - start != n - 1):
        raise RuntimeError("a record of the blob overlaps the tensor's data")
    return bytes(kept[start:start + n])


def _zip64(extra: bytes, values: list[int]) -> list[int]:
    """``values`` (uncompressed size, compressed size, local header offset) with each one
    saturated at 0xFFFFFFFF replaced from the zip64 extra field, in that order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            body, k = extra[pos + 4:pos + 4 + length], 0
            for i, v in enumerate(values):
                if v == 0xFFFFFFFF:
                    values[i] = struct.unpack_from("<Q", body, k)[0]
                    k += 8
            return values
        pos += 4 + length
    return values


def _central_entries(kept: bytearray, cut: int, nbytes: int) -> list[tuple[int, int, int, int]]:
    """(central entry offset, data offset, data size, offset of its other CRC-32 field: in
    its data descriptor, or its local header) of every record, blob-relative, read
    from the zip64 end records and the central directory (all outside the data)."""
    size = len(kept) + nbytes
    locator = _at(kept, cut, nbytes, size - 22 - 20, 20)
    if locator[:4] != _EOCD64_LOCATOR:
        raise RuntimeError("torch.save wrote no zip64 end record locator")
    (eocd64,) = struct.unpack_from("<Q", locator, 8)
    record = _at(kept, cut, nbytes, eocd64, 56)
    if record[:4] != _EOCD64:
        raise RuntimeError("torch.save's zip64 end record is not where its locator says")
    count, dir_size, dir_at = struct.unpack_from("<QQQ", record, 32)
    raw = _at(kept, cut, nbytes, dir_at, dir_size)
    out, pos = [], 0
    for _ in range(count):
        if raw[pos:pos + 4] != _CENTRAL:
            raise RuntimeError("torch.save's central directory is not a zip central directory")
        comp, plain = struct.unpack_from("<II", raw, pos + 20)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, pos + 28)
        (local,) = struct.unpack_from("<I", raw, pos + 42)
        extra = raw[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        plain, comp, local = _zip64(extra, [plain, comp, local])
        header = _at(kept, cut, nbytes, local, 30)
        (flags,) = struct.unpack_from("<H", header, 6)
        if header[:4] != _LOCAL or comp != plain:
            raise RuntimeError("torch.save wrote a record that is not stored uncompressed")
        loc_name, loc_extra = struct.unpack_from("<HH", header, 26)
        data = local + 30 + loc_name + loc_extra
        crc_field = local + 14  # no descriptor (an empty record): the local header holds it
        if flags & 8:
            if _at(kept, cut, nbytes, data + plain, 4) != _DESCRIPTOR:
                raise RuntimeError("torch.save wrote a record without its data descriptor")
            crc_field = data + plain + 4
        out.append((dir_at + pos, data, plain, crc_field))
        pos += 46 + name_len + extra_len + comment_len
    return out


def patch_crc(buf: Any, blob_offset: int, t: BlobTemplate, data: Any) -> None:
    """Write the CRC-32 of ``data`` (the tensor's bytes) into its blob at ``blob_offset`` of
    ``buf`` (a writable mapping of the file)."""
    if t.crc_at is None:
        return
    crc = zlib.crc32(data)
    for rel in t.crc_at:
        struct.pack_into("<I", buf, blob_offset + rel, crc)
