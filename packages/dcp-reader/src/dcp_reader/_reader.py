"""CheckpointReader and open_checkpoint: metadata plus narrowed reads of saved chunks."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import pickle
import time
from collections import OrderedDict
from typing import Any

from ._dtypes import itemsize, numpy_dtype, to_safetensors, torch_dtype_name
from ._errors import (
    CheckpointError,
    MetadataError,
    MissingKeyError,
    TruncatedFileError,
    UnsafePickleError,
    clean_text,
)
from ._frameworks import FRAMEWORKS, numpy_to_mindspore, torch_to_numpy
from ._model import FORMATS, CheckpointMetadata, ChunkMeta
from ._opened import opened
from .formats._detect import detect_format
from .formats._hf import load_hf
from .formats._hyper import FORMAT as HYPER_FORMAT
from .formats._hyper import load_hyper
from .formats._native import load_native
from .formats._safetensors_file import SafetensorsFile
from .formats._torch_dcp import load_blob, load_torch_dcp
from .formats._torch_save_box import BlobLayouts, _span, read_box, read_box_into
from .formats._torch_save_zip import BlobTensor
from .formats._unpickle import memo_problem
from .formats._zstd_items import BLOB_SLACK, VALUE_LIMIT, Inflated, InflatedItems, inflate, read_stored
from .integrity._checksum import BlockSums, read_verified
from .integrity._dcp_blocks import check_loaded, chunk_key, inside, read_box_verified
from .integrity._hash_worker import HashWorker
from .integrity._value_sums import check_bytes, check_value
from .storage._fetch_count import HeadClaims, metering
from .storage._names import METADATA_LIMIT
from .storage._pread import close_fd, fd_size, pread_bytes, pread_into
from .storage._protocol import Storage
from .storage._roots import check_files, open_regular, read_regular, storage_at
from .storage._uri import real_root

logger = logging.getLogger(__name__)


class _RawFile:
    """An open .distcp file and its size (taken once, at open)."""

    def __init__(self, root_real: str, name: str, key: str | None):
        self.fd = open_regular(root_real, name, key=key)
        self.path = os.path.join(root_real, name)
        self.size = fd_size(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            close_fd(self.fd)
            self.fd = None


def _handle(f: Any) -> Any:
    """What an open data file reads through: a descriptor, or an object store's ``ObjectFile``."""
    return f.fd if isinstance(f, _RawFile) else f._fd


class CheckpointReader:
    """Reads boxes of saved chunks. Use from one thread at a time (``sibling()`` gives another
    thread its own reader); a context manager.

    Keeps at most ``max_open_files`` files open (least recently used is closed first):
    opening a safetensors file costs ~0.7 ms against ~0.05 ms for a slice read (dcp-reader
    README, "Measured facts").
    """

    def __init__(self, path: str, metadata: CheckpointMetadata, *, allow_pickle: bool = False,
                 max_open_files: int = 64, verify_checksums: bool = True):
        if isinstance(max_open_files, bool) or not isinstance(max_open_files, int) or max_open_files < 1:
            raise ValueError(f"max_open_files must be an int >= 1, got {max_open_files!r}")
        self.path = path
        self.metadata = metadata
        self.format = metadata.format
        self.allow_pickle = bool(allow_pickle)
        self.verify_checksums = bool(verify_checksums)
        # (file, key) of a safetensors chunk, or (file, (offset, length)) of a torch-dcp blob
        self._sums: dict[tuple[str, Any], BlockSums] = {}
        self._max_open = max_open_files
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._bytes_read = 0
        self._overread = 0  # bytes covering reads fetched beyond their boxes
        self._served = 0  # bytes an object store sent for files since closed (``bytes_fetched``)
        self._claims = HeadClaims()  # heads counted in bytes_fetched (shared with siblings)
        self._blob: tuple[str, tuple[int, int], Any] | None = None  # last torch-dcp chunk decoded
        self._layouts = BlobLayouts()  # torch-dcp: where each blob's tensor lies
        self._inflated = InflatedItems()  # torch-dcp: items stored compressed, inflated (formats._zstd_items)
        # file -> (its unpickled values, the value checksums its bytes were verified against)
        self._pickles: dict[str, tuple[Any, set[str | None]]] = {}
        # hashes blocks while the next ones are read; its thread starts with the first
        # read of two or more unverified blocks and stops in close()
        self._hasher = HashWorker()

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    @property
    def bytes_fetched(self) -> int:
        """Bytes taken from storage: ``bytes_read`` plus what covering reads fetched around
        their boxes (``read_covering``). From an object store, every byte its GETs sent for
        this reader's files: the gaps a GET read through between wanted ranges and the
        files' headers included; a file's first bytes that this process had fetched before
        (through another reader, or an earlier load) count once, as if fetched
        (``storage._fetch_count``), so it is never below ``bytes_read``."""
        served = [h.fetched for h in map(_handle, self._files.values()) if hasattr(h, "fetched")]
        if served or self._served:
            return self._served + sum(served)
        return self._bytes_read + self._overread

    def _drop(self, f: Any) -> None:
        """Close an open file, keeping what an object store sent for it."""
        h = _handle(f)
        self._served += getattr(h, "fetched", 0)
        f.close()

    @property
    def storage(self) -> Storage:
        """Where the checkpoint's bytes live (``dcp_reader.storage.Storage``): ask it, for
        example ``local``, rather than the path."""
        return storage_at(self.path)

    def sibling(self) -> CheckpointReader:
        """Another reader of the same checkpoint, for another thread: it shares this reader's
        parsed metadata (nothing is read or checked again) and has its own open files, byte
        counter and hashing thread, so two threads can read at once. Close it when done."""
        sibling = CheckpointReader(self.path, self.metadata, allow_pickle=self.allow_pickle,
                                   max_open_files=self._max_open, verify_checksums=self.verify_checksums)
        sibling._claims = self._claims  # one load: a head counts once over the siblings
        return sibling

    @property
    def torch_save_reads(self) -> dict[str, int]:
        """torch-dcp: boxes read narrowed from a row-major tensor (``narrowed``), as the byte
        span of a tensor saved with other strides (``strided``), and blobs loaded whole
        because their layout cannot be narrowed (``whole``)."""
        return dict(self._layouts.counts)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointReader({self.path!r}, format={self.format!r}, tensors={len(self.metadata.tensors)}, "
                f"open_files={len(self._files)})")

    def close(self) -> None:
        files, self._files = self._files, OrderedDict()
        for f in files.values():
            self._drop(f)
        self._blob = None
        self._pickles.clear()
        self._layouts.clear()
        self._inflated.clear()
        self._hasher.close()

    def _open(self, name: str, key: str | None) -> Any:
        inflated = self._inflated.named(name)
        if inflated is not None:
            return inflated
        f = self._files.get(name)
        if f is not None:
            self._files.move_to_end(name)
            return f
        f = self._new_file(name, key)
        self._files[name] = f
        if len(self._files) > self._max_open:
            _, old = self._files.popitem(last=False)
            self._drop(old)
        return f

    def prefetch(self, files: list[str]) -> None:
        """Open ``files`` at once (object stores: their HEAD and header requests run in
        parallel instead of one after the other); a no-op for a directory. A file that
        fails to open is left out: opening it again when it is read reports why."""
        todo = [f for f in dict.fromkeys(files) if f not in self._files][:self._max_open]
        storage = self.storage
        if storage.local or len(todo) < 2:
            return
        key = {c.file: n for n, t in self.metadata.tensors.items() for c in t.chunks}

        def open_one(name: str) -> Any:
            try:
                return self._new_file(name, key.get(name))
            except CheckpointError:
                return None  # reported by the open at read time, with its own message

        for name, f in zip(todo, storage.map(open_one, todo), strict=True):
            if f is not None:
                self._files[name] = f
                if len(self._files) > self._max_open:
                    self._drop(self._files.popitem(last=False)[1])

    def _new_file(self, name: str, key: str | None) -> Any:
        f = _RawFile(self.path, name, key) if self.format == "torch-dcp" else SafetensorsFile(self.path, name, key)
        handle = _handle(f)
        if hasattr(handle, "join"):  # an object: its head counts once in bytes_fetched
            handle.join(self._claims)
        return f

    # -- tensors ---------------------------------------------------------------------------
    def _box(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...]
             ) -> tuple[Any, tuple[slice, ...]]:
        t = self.metadata.tensors.get(name)
        if t is None:
            raise MissingKeyError(f"no tensor {name!r} in the checkpoint ({len(self.metadata.tensors)} "
                                  "tensors); check the name", path=self.path, key=name)
        nd = len(t.shape)
        if len(offsets) != nd or len(sizes) != nd or len(chunk.offsets) != nd:
            raise ValueError(f"{name!r} has {nd} dims; got offsets={offsets} sizes={sizes} "
                             f"chunk.offsets={chunk.offsets}")
        slices = []
        for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=False):
            lo = o - co
            if lo < 0 or s < 0 or lo + s > cs:
                raise ValueError(f"box offsets={tuple(offsets)} sizes={tuple(sizes)} of {name!r} is not "
                                 f"inside the chunk offsets={chunk.offsets} sizes={chunk.sizes}")
            slices.append(slice(lo, lo + s))
        return t, tuple(slices)

    def _safetensors(self, name: str, dtype: str, chunk: ChunkMeta, verify: bool = True
                     ) -> tuple[Any, BlockSums | None]:
        """The open file of a safetensors chunk (entry checked against the metadata) and its
        parsed block checksums when they are to be verified (``verify`` and the reader's
        ``verify_checksums``)."""
        f = self._open(chunk.file, chunk.key)
        e = f.entry(chunk.key)
        if e.shape != chunk.sizes or e.code != to_safetensors(dtype):
            raise MetadataError(f"key {chunk.key!r} is {e.code} {list(e.shape)} in the file but the "
                                f"metadata says {dtype} {list(chunk.sizes)}; the checkpoint is "
                                "inconsistent: re-save it", path=f.path, key=chunk.key)
        if not (verify and self.verify_checksums and chunk.checksum is not None):
            return f, None
        sums = self._sums.get((chunk.file, chunk.key))
        if sums is None:
            sums = BlockSums.parse(chunk.checksum, e.end - e.start, path=f.path, key=chunk.key)
            self._sums[(chunk.file, chunk.key)] = sums
        return f, sums

    def read(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...], *,
             framework: str = "torch", verify: bool = True) -> Any:
        """The box [offsets, offsets + sizes) (global coordinates, inside ``chunk``) of tensor
        ``name``, in memory of its own (read with ``preadv``; possibly a strided view of a
        slightly larger buffer). With ``verify_checksums`` the blocks it touches are checked
        first (ChecksumError); ``verify=False`` skips that for this read (bytes another
        process on this host read and verified through the same page cache)."""
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
        t, sl = self._box(name, chunk, offsets, sizes)
        if self.format == "torch-dcp":
            return self._read_dcp(t.dtype, name, chunk, sl, framework, verify)
        f, sums = self._safetensors(name, t.dtype, chunk, verify)
        if framework == "torch":
            out = f.torch_box(chunk.key, t.dtype, sl, sums=sums, name=name, worker=self._hasher)
        else:
            out = f.numpy_box(chunk.key, t.dtype, sl, sums=sums, name=name, worker=self._hasher)
            if framework == "mindspore":
                out = numpy_to_mindspore(out, t.dtype)
        self._bytes_read += math.prod(sizes) * t.itemsize
        return out

    def read_into(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...],
                  out: Any, *, verify: bool = True) -> None:
        """Read the box into ``out``, a CPU torch tensor or numpy array of the box's shape and
        of the tensor's item size. A box contiguous in the file read into a contiguous ``out``
        goes straight there (one copy instead of two); anything else is ``read`` + copy.
        On ChecksumError ``out`` may hold the bytes that failed verification. ``verify``: as
        for ``read``."""
        t, sl = self._box(name, chunk, offsets, sizes)
        raw = _raw_bytes(out, tuple(sizes), t.itemsize)
        if raw is not None and self.format != "torch-dcp":
            f, sums = self._safetensors(name, t.dtype, chunk, verify)
            if f.read_into(chunk.key, sl, t.itemsize, raw, sums=sums, name=name, worker=self._hasher):
                self._bytes_read += math.prod(sizes) * t.itemsize
                return
        elif raw is not None and self._read_dcp_into(t.dtype, name, chunk, sl, raw, verify):
            return
        framework = "numpy" if type(out).__module__.startswith("numpy") else "torch"
        data = self.read(name, chunk, offsets, sizes, framework=framework, verify=verify)
        if framework == "numpy":
            import numpy as np

            np.copyto(out.view(data.dtype) if out.dtype != data.dtype else out, data)
        else:
            out.copy_(data)

    # -- covering reads: a box's covering byte range into a staging buffer -----------------
    def _covering(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...],
                  verify: bool) -> tuple[Any, int, int, int, tuple[int, ...], Any, int] | None:
        """(file, lo, hi, box offset from lo, box byte strides, sums, file offset of the
        chunk's first byte: torch-dcp only) of the byte range [lo, hi) covering the box,
        relative to its chunk's first byte; None for a torch-dcp blob loaded whole (it has
        no byte layout to cover)."""
        t, sl = self._box(name, chunk, offsets, sizes)
        if self.format != "torch-dcp":
            f, sums = self._safetensors(name, t.dtype, chunk, verify)
            lo, hi, box, sums = f.covering(chunk.key, sl, t.itemsize, sums)
            return f, lo, hi, box.lo - lo, box.strides, sums, 0
        chunk = self._plain(name, t.dtype, chunk, verify)
        f, layout = self._dcp_layout(t.dtype, name, chunk)
        if layout is None:
            return None
        strides = tuple(st * t.itemsize for st in layout.stride)
        lo = sum(s.start * st for s, st in zip(sl, strides, strict=True))
        hi = sum((s.stop - 1) * st for s, st in zip(sl, strides, strict=True)) + t.itemsize if math.prod(sizes) else lo
        base = chunk.storage[0] + layout.start
        sums = self._dcp_sums(f, t.dtype, name, chunk, verify)
        if sums is None or hi == lo or sums.done(lo, hi):
            return f, lo, hi, 0, strides, None, base
        nbytes = chunk.numel * t.itemsize
        inside(hi, nbytes, path=f.path, name=name)
        a, b = sums.span(lo, hi, nbytes)
        return f, a, b, lo - a, strides, sums, base

    def covering_bytes(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...], *,
                       verify: bool = True) -> int | None:
        """The staging bytes ``read_covering`` needs for the box: the byte range that covers
        it in the file (widened to whole checksum blocks still to be verified); None when the
        box cannot be read that way (a torch-dcp blob loaded whole)."""
        found = self._covering(name, chunk, offsets, sizes, verify)
        return None if found is None else found[2] - found[1]

    def read_covering(self, name: str, chunk: ChunkMeta, offsets: tuple[int, ...], sizes: tuple[int, ...],
                      buf: Any, *, verify: bool = True) -> Any:
        """Read the byte range covering the box into ``buf`` (a contiguous CPU uint8 torch
        tensor of at least ``covering_bytes``) with one ranged read, and return the box as
        a strided torch view of ``buf`` in the tensor's dtype, for the caller to copy out.
        ``bytes_read`` counts the box, ``bytes_fetched`` the whole range. ValueError when
        the box cannot be read this way (``covering_bytes`` said None)."""
        import torch

        found = self._covering(name, chunk, offsets, sizes, verify)
        if found is None:
            raise ValueError(f"{name!r} in {chunk.file!r} is loaded whole; read it with read_into")
        f, lo, hi, start, strides, sums, base = found
        t = self.metadata.tensors[name]
        if buf.numel() < hi - lo:
            raise ValueError(f"buf has {buf.numel()} bytes; the range covering the box needs {hi - lo}")
        dtype = getattr(torch, t.dtype)
        if hi == lo:
            return torch.empty(sizes, dtype=dtype)
        raw = buf[:hi - lo]
        if self.format == "torch-dcp":
            self._layouts.counts["narrowed"] += 1
            if sums is not None:
                read_verified(f.fd, raw.numpy(), base + lo, lo, sums, worker=self._hasher, path=f.path,
                              key=chunk_key(name, chunk.offsets), name=name)
            else:
                pread_into(f.fd, raw.numpy(), base + lo, path=f.path, key=name)
        else:
            f.read_range(chunk.key, lo, raw.numpy(), sums=sums, name=name, worker=self._hasher)
        nbytes = math.prod(sizes) * t.itemsize
        self._bytes_read += nbytes
        self._overread += hi - lo - nbytes
        width = t.itemsize
        span = sum((n - 1) * st for n, st in zip(sizes, strides, strict=True)) + width
        return raw[start:start + span].view(dtype).as_strided(sizes, tuple(st // width for st in strides))

    def check_chunk(self, name: str, chunk: ChunkMeta) -> None:
        """Check a saved chunk without reading its data, before anything is written: its file
        opens, its header (safetensors) or blob index (torch-dcp: zip directory and data.pkl,
        ~2 KiB) parses, agrees with the metadata and places the chunk inside the file. A
        torch-dcp blob that cannot be narrowed (rare: torch's legacy format) is loaded whole,
        as reading it would, and kept for the next read."""
        t, _ = self._box(name, chunk, chunk.offsets, chunk.sizes)
        if self.format == "torch-dcp":
            chunk = self._plain(name, t.dtype, chunk, True)
            f, layout = self._dcp_layout(t.dtype, name, chunk)
            if layout is None:
                self._read_dcp_whole(f, t.dtype, name, chunk, tuple(slice(0, 0) for _ in chunk.sizes), "torch")
        else:
            self._safetensors(name, t.dtype, chunk)

    def _stored_file(self, name: str, file: str, storage: tuple[int, int] | None) -> Any:
        """The open file of a torch-dcp item stored at ``storage``, checked to lie inside it."""
        if storage is None:
            raise MetadataError(f"{name!r} in {file!r} has no storage (offset, length)", path=self.path, key=name)
        f = self._open(file, name)
        off, length = storage
        if off < 0 or length < 0 or off + length > f.size:
            raise TruncatedFileError(f"{name!r} is stored at bytes [{off}, {off + length}) but the file "
                                     f"has {f.size} bytes; the file is truncated: re-copy it",
                                     path=f.path, key=name)
        return f

    def _plain(self, name: str, dtype: str, chunk: ChunkMeta, verify: bool) -> ChunkMeta:
        """``chunk``; or, stored compressed (``chunk.transforms``: torch's ZStandard), the same
        chunk in its inflated copy (``formats._zstd_items``), which this reader keeps for the
        next boxes: its stored bytes are read once, checked against their block checksums
        (``verify``, as for reads), and inflated up to the chunk's bytes plus a blob's zip."""
        if not chunk.transforms:
            return chunk
        where = (chunk.file, chunk.storage)
        check = verify and self.verify_checksums and chunk.checksum is not None
        item = self._inflated.get(where)
        if item is None or (check and not item.verified):
            f = self._stored_file(name, chunk.file, chunk.storage)
            key = chunk_key(name, chunk.offsets)
            sums = BlockSums.parse(chunk.checksum, chunk.storage[1], path=f.path, key=key) if check else None
            raw = read_stored(_handle(f), chunk.storage, path=f.path, file=chunk.file, key=key, name=name, sums=sums,
                              worker=self._hasher)
            nbytes = chunk.numel * itemsize(dtype)
            item = inflate(raw, limit=nbytes + BLOB_SLACK, what=f"a torch.save blob of its {nbytes}-byte {dtype} "
                           f"chunk {list(chunk.sizes)} (the metadata's)", path=f.path, file=chunk.file, key=name,
                           storage=chunk.storage, name=f"{chunk.file}\0{chunk.storage[0]}", verified=check)
            self._inflated.put(where, item)
            self._overread += chunk.storage[1]
        return dataclasses.replace(chunk, file=item.name, storage=(0, item.size), transforms=(), checksum=None)

    def _dcp_layout(self, dtype: str, name: str, chunk: ChunkMeta) -> tuple[_RawFile, BlobTensor | None]:
        """The open file of a torch-dcp chunk, its blob checked to lie inside the file, and
        where the blob's tensor lies (parsed once per blob; None: load the blob whole)."""
        f = self._stored_file(name, chunk.file, chunk.storage)
        layout, spent = self._layouts.get(f.fd, chunk.file, chunk.storage, path=f.path, key=name)
        self._bytes_read += spent
        if layout is not None and (layout.shape != chunk.sizes or layout.dtype != dtype):
            raise MetadataError(f"payload of {name!r} is {layout.dtype} {list(layout.shape)} but the "
                                f"metadata says {dtype} {list(chunk.sizes)}", path=f.path, key=name)
        return f, layout

    def _dcp_sums(self, f: _RawFile, dtype: str, name: str, chunk: ChunkMeta, verify: bool) -> BlockSums | None:
        """The parsed block checksums of a torch-dcp chunk (dcp-checksums.json) when they are
        to be verified (``verify`` and the reader's ``verify_checksums``); kept per blob, so
        that a block is verified once per reader."""
        if not (verify and self.verify_checksums and chunk.checksum is not None):
            return None
        sums = self._sums.get((chunk.file, chunk.storage))
        if sums is None:
            sums = BlockSums.parse(chunk.checksum, chunk.numel * itemsize(dtype), path=f.path,
                                   key=chunk_key(name, chunk.offsets))
            self._sums[(chunk.file, chunk.storage)] = sums
        return sums

    def _read_dcp_into(self, dtype: str, name: str, chunk: ChunkMeta, sl: tuple[slice, ...], raw: Any,
                       verify: bool = True) -> bool:
        """A box contiguous in a narrowable blob, read straight into ``raw``; False when not
        (also when checksums still to be verified need more bytes than the box)."""
        chunk = self._plain(name, dtype, chunk, verify)
        f, layout = self._dcp_layout(dtype, name, chunk)
        if layout is None:
            return False
        sums = self._dcp_sums(f, dtype, name, chunk, verify)
        if sums is not None:
            _, lo, hi, contiguous = _span(layout, sl, itemsize(dtype))
            if hi > lo and not sums.done(lo, hi):
                nbytes = chunk.numel * itemsize(dtype)
                if not contiguous or hi > nbytes or sums.span(lo, hi, nbytes) != (lo, hi):
                    return False  # read() reads and verifies the whole blocks
                read_verified(f.fd, raw, chunk.storage[0] + layout.start + lo, lo, sums, worker=self._hasher,
                              path=f.path, key=chunk_key(name, chunk.offsets), name=name)
                self._layouts.counts["narrowed"] += 1
                self._bytes_read += hi - lo
                return True
        n = read_box_into(f.fd, chunk.storage[0], layout, sl, raw, path=f.path, key=name,
                          counts=self._layouts.counts)
        if n is None:
            return False
        self._bytes_read += n
        return True

    def _read_dcp(self, dtype: str, name: str, chunk: ChunkMeta, sl: tuple[slice, ...], framework: str,
                  verify: bool = True) -> Any:
        chunk = self._plain(name, dtype, chunk, verify)
        f, layout = self._dcp_layout(dtype, name, chunk)
        sums = self._dcp_sums(f, dtype, name, chunk, verify)
        if layout is None:
            return self._read_dcp_whole(f, dtype, name, chunk, sl, framework, sums)
        got = None if sums is None else read_box_verified(
            f.fd, chunk.storage[0] + layout.start, layout, sl, sums, worker=self._hasher, path=f.path,
            key=chunk_key(name, chunk.offsets), name=name, counts=self._layouts.counts)
        if got is None:
            got = read_box(f.fd, chunk.storage[0], layout, sl, path=f.path, key=name, counts=self._layouts.counts)
        arr, n = got
        self._bytes_read += n
        if framework == "torch":
            import torch

            out = torch.from_numpy(arr)
            return out.view(getattr(torch, dtype)) if out.dtype != getattr(torch, dtype) else out
        np_dt = numpy_dtype(dtype)
        out = arr.view(np_dt) if arr.dtype != np_dt else arr
        return numpy_to_mindspore(out, dtype) if framework == "mindspore" else out

    def _read_dcp_whole(self, f: _RawFile, dtype: str, name: str, chunk: ChunkMeta, sl: tuple[slice, ...],
                        framework: str, sums: BlockSums | None = None) -> Any:
        """A box of a blob whose layout cannot be narrowed: torch.load(weights_only=True) of
        the whole blob (the last one decoded is kept), its tensor's blocks checked against
        ``sums`` when given."""
        blob = self._blob
        if blob is None or blob[0] != chunk.file or blob[1] != chunk.storage:
            tensor = self._blob_of(f, name, chunk.storage, weights_only=True)
            import torch

            if not isinstance(tensor, torch.Tensor):
                raise MetadataError(f"the payload of {name!r} at {chunk.storage} holds a "
                                    f"{type(tensor).__name__}, not a tensor; the metadata and the file "
                                    "disagree: re-save the checkpoint", path=f.path, key=name)
            if tuple(tensor.shape) != chunk.sizes or torch_dtype_name(tensor.dtype) != dtype:
                raise MetadataError(f"payload of {name!r} is {tensor.dtype} {list(tensor.shape)} but the "
                                    f"metadata says {dtype} {list(chunk.sizes)}", path=f.path, key=name)
            self._bytes_read += chunk.storage[1]
            self._layouts.counts["whole"] += 1
            blob = self._blob = (chunk.file, chunk.storage, tensor)
        if sums is not None and not sums.done(0, chunk.numel * itemsize(dtype)):
            check_loaded(blob[2], sums, path=f.path, key=chunk_key(name, chunk.offsets), name=name)
        out = blob[2][sl].clone()  # memory of its own: the blob stays cached for the next read
        if framework != "torch":
            out = torch_to_numpy(out, dtype)
            if framework == "mindspore":
                out = numpy_to_mindspore(out, dtype)
        return out

    # -- values ----------------------------------------------------------------------------
    def read_value(self, name: str) -> Any:
        """A non-tensor entry. Pickled entries need allow_pickle=True (trusted checkpoints).
        With ``verify_checksums``, a value saved with a checksum (native format) is checked
        first: ChecksumError naming it when the metadata or its file changed since."""
        v = self.metadata.values.get(name)
        if v is None:
            raise MissingKeyError(f"no value {name!r} in the checkpoint ({len(self.metadata.values)} "
                                  "values); check the name", path=self.path, key=name)
        if v.file is None:
            if self.verify_checksums and v.checksum is not None:
                check_value(name, v.value, v.checksum, path=self.path)
            return copy.deepcopy(v.value)
        if self.format == "torch-dcp":
            return self._read_dcp_value(name, v.file, v.storage, v.checksum if self.verify_checksums else None,
                                        v.transforms)
        if not self.allow_pickle:
            raise UnsafePickleError(f"value {name!r} is pickled in {v.file!r}; loading it could run code "
                                    "from the checkpoint. Pass allow_pickle=True only if you trust it",
                                    path=self.path, key=name)
        if self.format == HYPER_FORMAT and v.storage is not None:
            return self._read_pickled_range(name, v.file, v.storage)
        entry = self._pickles.get(v.file)
        check = self.verify_checksums and v.checksum is not None
        if entry is None or (check and v.checksum not in entry[1]):
            raw = read_regular(self.path, v.file, limit=METADATA_LIMIT, key=name)
            if check:  # before unpickling anything from it
                check_bytes(name, v.file, raw, v.checksum, path=os.path.join(self.path, v.file))
            entry = (_trusted_pickle(raw, os.path.join(self.path, v.file), name), {v.checksum})
            self._pickles[v.file] = entry
        d = entry[0]
        if not isinstance(d, dict) or v.key not in d:
            raise MissingKeyError(f"value {name!r} (key {v.key!r}) is not in {v.file!r}", path=self.path, key=name)
        return d[v.key]

    def _read_pickled_range(self, name: str, file: str, storage: tuple[int, int]) -> Any:
        """A value pickled at (offset, length) of ``file`` (hyper-parallel ``.bytes``): a
        regular file inside the checkpoint, bytes bounded by its size, the same checked
        unpickling as other opted-in pickles."""
        offset, length = storage
        fd = open_regular(self.path, file, key=name)
        try:
            size = fd_size(fd)
            path = os.path.join(self.path, file)
            if offset + length > size:
                raise TruncatedFileError(f"value {name!r} is stored at bytes [{offset}, {offset + length}) but the "
                                         f"file has {size} bytes; the file is truncated: re-copy it", path=path,
                                         key=name)
            raw = pread_bytes(fd, length, offset, path=path, key=name)
        finally:
            close_fd(fd)
        return _trusted_pickle(raw, path, name)

    def _read_dcp_value(self, name: str, file: str, storage: tuple[int, int] | None, checksum: str | None,
                        transforms: tuple[str, ...] = ()) -> Any:
        """A torch-dcp value: its blob checked against ``checksum`` when given (ChecksumError),
        then loaded with torch.load(weights_only=True), or with weights_only=False where the
        caller opted in (``allow_pickle``). One stored compressed (``transforms``) is checked
        as stored, then inflated (at most ``VALUE_LIMIT`` bytes) and loaded the same way."""
        f = self._stored_file(name, file, storage)
        assert storage is not None
        if not transforms:
            return self._load_value(f, name, storage, checksum)
        raw = read_stored(_handle(f), storage, path=f.path, file=file, key=name, name=name, value_sum=checksum)
        item = inflate(raw, limit=VALUE_LIMIT, what=f"the {VALUE_LIMIT} bytes a value's blob may hold",
                       path=f.path, file=file, key=name, storage=storage, name=file, verified=checksum is not None)
        try:
            return self._load_value(item, name, (0, item.size), None)
        finally:
            item.close()

    def _load_value(self, f: _RawFile | Inflated, name: str, storage: tuple[int, int], checksum: str | None) -> Any:
        try:
            return load_blob(f.fd, storage, path=f.path, key=name, weights_only=True, checksum=checksum)
        except pickle.UnpicklingError as e:
            if not self.allow_pickle:
                raise UnsafePickleError(f"value {name!r} holds objects that torch.load(weights_only=True) "
                                        f"refuses ({_weights_only_reason(e)}); nothing was executed. If you "
                                        "trust this checkpoint, pass allow_pickle=True: the value is then "
                                        "unpickled with torch.load(weights_only=False), which can run code "
                                        "from the file", path=f.path, key=name) from None
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load's errors on corrupt bytes vary by version
            raise _corrupt_blob(f.path, name, storage, e) from None
        return self._blob_of(f, name, storage, weights_only=False, checksum=checksum)  # opted in by the caller

    @staticmethod
    def _blob_of(f: _RawFile | Inflated, name: str, storage: tuple[int, int], *, weights_only: bool,
                 checksum: str | None = None) -> Any:
        try:
            return load_blob(f.fd, storage, path=f.path, key=name, weights_only=weights_only, checksum=checksum)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load's errors on corrupt bytes vary by version
            raise _corrupt_blob(f.path, name, storage, e) from None


def _trusted_pickle(raw: bytes, path: str, name: str) -> Any:
    """pickle.loads of a file the caller opted in to (allow_pickle=True); a corrupt one (its
    memo indices checked first, as a flipped byte can make pickle allocate gigabytes) is a
    MetadataError, whatever pickle raises."""
    problem = memo_problem(raw)
    if problem:
        raise MetadataError(f"the pickled values cannot be read ({problem}); the file is corrupt",
                            path=path, key=name)
    try:
        return pickle.loads(raw)  # opted in by the caller (allow_pickle=True)
    except Exception as e:  # noqa: BLE001 - unpickling corrupt bytes raises nearly anything
        raise MetadataError(f"the pickled values cannot be read ({type(e).__name__}: {str(e)[:200]}); the "
                            "file is corrupt: re-save the checkpoint", path=path, key=name) from None


def _raw_bytes(out: Any, sizes: tuple[int, ...], itemsize: int) -> Any:
    """A writable uint8 numpy view of ``out``'s bytes when it is a contiguous CPU tensor or
    array of ``sizes`` with ``itemsize``-byte items; None otherwise (then read + copy);
    ValueError when its shape or item size does not match the box."""
    shape = tuple(out.shape)
    size = out.element_size() if hasattr(out, "element_size") else out.itemsize
    if shape != sizes or size != itemsize:
        raise ValueError(f"out has shape {shape} and {size}-byte items; the box needs {sizes} and "
                         f"{itemsize}-byte items")
    if type(out).__module__.startswith("torch"):
        if out.device.type != "cpu" or not out.is_contiguous():
            return None
        import torch

        return out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
    if not (out.flags.c_contiguous and out.flags.writeable) or not out.size:
        return None
    return out.reshape(-1).view("uint8")


def _weights_only_reason(e: BaseException) -> str:
    """The one sentence of torch.load's weights_only refusal that says what it refused
    (torch's text is ~900 characters of advice about torch.load, with terminal escapes)."""
    text = str(e)
    _, found, reason = text.partition("WeightsUnpickler error:")
    return clean_text(reason if found else text, 160)


def _corrupt_blob(path: str, name: str, storage: tuple[int, int], e: BaseException) -> CheckpointError:
    why = _weights_only_reason(e) if isinstance(e, pickle.UnpicklingError) else clean_text(str(e), 300)
    return MetadataError(f"cannot load the torch.save payload of {name!r} at (offset, length) {storage} "
                         f"({type(e).__name__}: {why}); the file is corrupt: re-copy or re-save it",
                         path=path, key=name)


# What parsing a corrupt checkpoint can raise besides CheckpointError; open_checkpoint reports
# each as a typed error (the fuzzer in tests-integration found all of these once).
_PARSE_ERRORS = (OSError, ValueError, LookupError, TypeError, AttributeError, RecursionError, EOFError,
                 RuntimeError, pickle.UnpicklingError, MemoryError)


def _load_metadata(root: str, fmt: str, rank: int | None) -> CheckpointMetadata:
    if fmt == "native":
        meta = load_native(root)
        files = [(c.file, n) for n, t in meta.tensors.items() for c in t.chunks]
        files += [(v.file, n) for n, v in meta.values.items() if v.file is not None]
        check_files(root, files)
        return meta
    if fmt == "hf":
        return load_hf(root, sharded=False)
    if fmt == "torch-dcp-hf":
        return load_hf(root, sharded=True)
    if fmt == HYPER_FORMAT:
        return load_hyper(root, rank=rank)
    return load_torch_dcp(root)


def _parse(root: str, format: str | None, rank: int | None) -> tuple[str, CheckpointMetadata]:
    fmt = detect_format(root) if format is None else format
    return fmt, _load_metadata(root, fmt, rank)


def open_checkpoint(path: str | os.PathLike[str], *, format: str | None = None, allow_pickle: bool = False,
                    max_open_files: int = 64, verify_checksums: bool = True,
                    rank: int | None = None, metadata: CheckpointMetadata | None = None) -> CheckpointReader:
    """Open a checkpoint directory: detect (or take) its format, read and validate its
    metadata (file names, existence, coverage; a directory's metadata is reused while none
    of its files changed, ``_opened``), and return a reader. ``verify_checksums``:
    check the block checksums (native format; torch DCP that dcp saved, ``dcp-checksums.json``)
    of every block a read touches, and the checksum of every value read. Every problem with the
    checkpoint is a CheckpointError; ValueError/TypeError only for bad arguments.

    ``rank``: for hyper-parallel checkpoints saved without collectives (no ``.metadata``,
    one ``{rank}.metadata`` per rank), the rank whose metadata to read; ignored otherwise.

    ``path``: a directory, or an object-store URI (``s3://bucket/prefix``; ``gs://``, ``az://``)
    read through ranged GETs (dcp-reader README, "Object storage").
    ``metadata``: the checkpoint's metadata as another process read it (its ``to_json``
    round trip): nothing is listed or read to open the reader, so that of N ranks only one
    lists a bucket and reads the index."""
    t0 = time.perf_counter()
    root = real_root(path)
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} or None (detect), got {format!r}")
    if metadata is not None:
        if not isinstance(metadata, CheckpointMetadata):
            raise TypeError(f"metadata must be a CheckpointMetadata or None, got {type(metadata).__name__}")
        return CheckpointReader(root, metadata, allow_pickle=allow_pickle, max_open_files=max_open_files,
                                verify_checksums=verify_checksums)
    try:
        with metering(root) as parse:  # the headers' GETs: this reader's (bytes_fetched)
            fmt, meta = opened(root, (format, rank), lambda: _parse(root, format, rank))
    except CheckpointError:
        raise
    except _PARSE_ERRORS as e:
        raise MetadataError(f"cannot read the checkpoint's metadata ({type(e).__name__}: {str(e)[:300]}); "
                            "it is corrupt or unreadable: check its files or re-save it", path=root) from e
    reader = CheckpointReader(root, meta, allow_pickle=allow_pickle, max_open_files=max_open_files,
                              verify_checksums=verify_checksums)
    reader._served, reader._claims = parse.bytes, HeadClaims(parse.heads)
    logger.debug("opened %s (%s): %d tensors, %d values in %.3f s", root, fmt, len(meta.tensors),
                 len(meta.values), time.perf_counter() - t0)
    return reader
