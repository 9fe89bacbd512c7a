"""Items torch DCP stored through its ZStandard extension (``_zstd_frames``), inflated into
an anonymous in-memory file that the readers of uncompressed items then read, as they read
a data file: the blob's zip index, narrowed boxes, values through ``load_blob``.

An item is inflated whole (a zstd stream has no random access): its compressed bytes are
read once (checked against dcp's block checksums or value checksum when dcp wrote them:
those cover the bytes as stored), its frames are walked (``check_frames``), then it is
inflated 1 MiB at a time, never past ``limit``: what the metadata says the item holds (a
chunk: its bytes plus ``BLOB_SLACK`` for the ``torch.save`` zip around them; a value:
``VALUE_LIMIT``, the bound of dcp's other pickled values). A frame that inflates past it
is a MetadataError naming the file and the key before more memory is taken.

``InflatedItems`` keeps a reader's inflated chunks, up to ``BUDGET`` bytes (the last one
inflated is always kept), so that the boxes of one chunk cost one inflation.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Any

from .._errors import CheckpointError, MetadataError
from ..integrity._checksum import read_verified
from ..integrity._value_sums import check_bytes
from ..storage._names import METADATA_LIMIT
from ..storage._pread import pread_into
from ._zstd_frames import check_frames, zstandard_module

__all__ = ["BLOB_SLACK", "BUDGET", "VALUE_LIMIT", "Inflated", "InflatedItems", "inflate", "read_stored"]

#: Bytes a chunk's ``torch.save`` blob may hold beyond the chunk's own (its zip entries,
#: headers and 64-byte alignment take ~1.5 KiB).
BLOB_SLACK = 64 * 1024
#: The most bytes a value's blob inflates to (the metadata gives no size for a value).
VALUE_LIMIT = METADATA_LIMIT
#: Inflated bytes a reader keeps for later boxes of the same chunks.
BUDGET = 256 * 1024 * 1024
#: Inflated items a reader keeps open at most (each holds a descriptor): a checkpoint of
#: thousands of small tensors stays far below the process's open-file limit.
MAX_KEPT = 64
_PIECE = 1024 * 1024


class Inflated:
    """An inflated item: ``fd``, an anonymous file of ``size`` bytes; ``path``, the data file
    it was stored in (errors name it); ``name``, how the reader opens it; ``verified``:
    its stored bytes were checked against their checksum."""

    def __init__(self, fd: int, size: int, path: str, name: str, verified: bool):
        self.fd: int | None = fd
        self.size, self.path, self.name, self.verified = size, path, name, verified

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _anonymous_file(label: str) -> int:
    """A descriptor of a new file that lives in memory and vanishes when closed."""
    if hasattr(os, "memfd_create"):
        # the kernel takes at most 249 bytes, without NUL: a key may hold any character
        safe = "".join(c if c.isascii() and c.isprintable() else "?" for c in label)[:200]
        return os.memfd_create(safe or "dcp-item", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile(prefix="dcp-item-") as f:  # no memfd (not Linux): an unlinked file
        return os.dup(f.fileno())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def inflate(raw: Any, *, limit: int, what: str, path: str, file: str, key: str, storage: tuple[int, int],
            name: str, verified: bool) -> Inflated:
    """The compressed item ``raw`` (stored at ``storage`` of ``file``) inflated, at most
    ``limit`` bytes (``what``: what the metadata says it holds, for the error). A corrupt
    stream, or one inflating past ``limit``, is a MetadataError naming ``file`` and ``key``."""
    zstandard = zstandard_module(f"reading {key!r} from {file!r}", path=path, key=key)

    def bad(why: str) -> CheckpointError:
        return MetadataError(f"the zstd-compressed bytes of {key!r} at (offset, length) {storage} of {file!r} are "
                             f"corrupt: {why}; re-copy or re-save the checkpoint", path=path, key=key)

    check_frames(memoryview(raw).cast("B"), bad)
    fd = _anonymous_file(f"{file}:{key}")
    size = 0
    try:
        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        while True:
            try:
                piece = stream.read(_PIECE)
            except zstandard.ZstdError as e:
                raise bad(f"zstd cannot decode them after {size} inflated bytes ({e})") from None
            if not piece:
                break
            size += len(piece)
            if size > limit:
                raise MetadataError(f"the zstd-compressed bytes of {key!r} at (offset, length) {storage} of {file!r} "
                                    f"inflate past {limit} bytes, more than {what}: the item is corrupt or hostile "
                                    "(nothing more was inflated); re-save the checkpoint", path=path, key=key)
            _write_all(fd, piece)
    except BaseException:
        os.close(fd)
        raise
    return Inflated(fd, size, path, name, verified)


class InflatedItems:
    """A reader's inflated items by (file, (offset, length)), least recently used closed
    once they hold more than ``budget`` bytes or number more than ``MAX_KEPT``; the last one
    put is always kept."""

    def __init__(self, budget: int = BUDGET):
        self._items: OrderedDict[tuple[str, tuple[int, int]], Inflated] = OrderedDict()
        self._named: dict[str, Inflated] = {}
        self._budget = budget
        self._held = 0

    def get(self, where: tuple[str, tuple[int, int]]) -> Inflated | None:
        item = self._items.get(where)
        if item is not None:
            self._items.move_to_end(where)
        return item

    def named(self, name: str) -> Inflated | None:
        """The item a reader opens as ``name`` (``Inflated.name``), if kept."""
        return self._named.get(name)

    def put(self, where: tuple[str, tuple[int, int]], item: Inflated) -> None:
        self.drop(where)
        self._items[where] = item
        self._named[item.name] = item
        self._held += item.size
        while (self._held > self._budget or len(self._items) > MAX_KEPT) and len(self._items) > 1:
            self.drop(next(iter(self._items)))

    def drop(self, where: tuple[str, tuple[int, int]]) -> None:
        item = self._items.pop(where, None)
        if item is not None:
            self._named.pop(item.name, None)
            self._held -= item.size
            item.close()

    def clear(self) -> None:
        for where in list(self._items):
            self.drop(where)


def read_stored(fd: Any, storage: tuple[int, int], *, path: str, file: str, key: str, name: str,
                sums: Any = None, value_sum: str | None = None, worker: Any = None) -> Any:
    """The bytes of an item as stored at ``storage`` of the open ``fd`` (a uint8 numpy
    array), checked against ``sums`` (a chunk's ``BlockSums``; ``key``: its chunk key) or
    ``value_sum`` (a value's checksum) when given: ChecksumError naming the file and entry,
    before anything is inflated."""
    import numpy as np

    buf = np.empty(storage[1], dtype=np.uint8)
    if sums is not None:
        read_verified(fd, buf, storage[0], 0, sums, worker=worker, path=path, key=key, name=name)
        return buf
    pread_into(fd, buf, storage[0], path=path, key=name)
    if value_sum is not None:
        check_bytes(name, file, buf, value_sum, path=path, at=storage)
    return buf
