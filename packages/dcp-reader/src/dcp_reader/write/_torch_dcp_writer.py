"""TorchDcpWriter: torch.distributed.checkpoint's own on-disk format, written by dcp's save.

What torch 2.13's ``FileSystemWriter`` writes with its default serialization (``TORCH_SAVE``),
which its ``FileSystemReader`` reads by default and which every earlier torch release reads
(the ``SAFETENSORS`` serialization of 2.13 is read only by readers told so):

* data files ``*.distcp``: each stored item a ``torch.save`` blob at (offset, length); a
  tensor chunk is saved as a tensor whose storage is exactly the chunk (torch saves a view's
  whole storage otherwise), a non-tensor value as ``torch.save(value)``;
* ``.metadata``: a pickled ``torch.distributed.checkpoint.metadata.Metadata``, written last
  (torch's commit point too): ``state_dict_metadata`` (a ``TensorStorageMetadata`` with the
  global size and every chunk's offsets and sizes, or ``BytesStorageMetadata``),
  ``planner_data`` (each flattened name's keys, which ``dcp_to_torch_save`` unflattens with),
  ``storage_data`` (``MetadataIndex(fqn, offsets)`` -> ``_StorageInfo(file, offset, length)``),
  ``storage_meta`` and ``version``.

dcp keeps what its own format does better: one writer per replicated box, the data durable
before the metadata, crash-safe overwrites (files carry the save id; the metadata is replaced
in one rename), and block checksums of every chunk's tensor bytes in ``dcp-checksums.json``, a
side file torch ignores, written before ``.metadata``. Each writing rank leaves the (offset,
length, checksum) of its chunks in ``<data file>.index.json`` beside its data file; rank 0's
``commit`` reads them (one small read per file, as the native commit reads each file's
header), and the tidy-up after the commit removes them. dcp reads the result with its safe
reader (``formats._torch_dcp``: no unpickling).

``transforms=("stream.zstd/1",)``: every item is written compressed as torch's
``FileSystemWriter(_extensions=[ZStandard()])`` writes it (``_zstd_blobs``), with that
descriptor in its ``_StorageInfo``; its checksums (block checksums of a chunk, the checksum of
a value) are then those of the bytes as stored, which a load checks before inflating them.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import CheckpointError, MetadataError, summarise
from .._model import CheckpointMetadata, ValueMeta
from ..formats._native import SAVE_ID_RE
from ..formats._torch_dcp import METADATA_FILE
from ..integrity._checksum import block_digests
from ..integrity._value_sums import bytes_checksum
from ..storage._names import METADATA_LIMIT
from ..storage._posix import write_unsynced
from ._torch_saved import TorchSavedValue
from ._writer import EncodedValues, NativeWriter
from ._zstd_blobs import check_transforms_written, zstd_bytes, zstd_torch_save

__all__ = ["CHECKSUMS_FILE", "TorchDcpWriter", "torch_dcp_own_file"]

logger = logging.getLogger(__name__)

#: Block checksums of every chunk and value, by name: {"tensors": {name: {offsets: sum}},
#: "values": {name: sum}}; torch's readers ignore the file.
CHECKSUMS_FILE = "dcp-checksums.json"
INDEX_SUFFIX = ".index.json"
# torch.save writes each blob in ~40 pieces (zip headers and records, mostly under 100 bytes):
# a piece up to this size is copied without asking whether it lies in the tensor's storage
# (the numpy address lookup cost ~0.1 ms a piece: 1.3 s of a 288-tensor save under cProfile).
_SMALL_WRITE = 4096
_INDEX_LIMIT = 64 * 1024 * 1024
# What this writer (and torch's FileSystemWriter: ``__<rank>_<n>.distcp``) names files at the
# top of a checkpoint directory, temporary files of a killed save included: only such files
# are removed as leftovers after a commit; anything else in the directory is the user's.
_OWN_FILE_RE = re.compile(rf"(?:__\d+_(?:\d+|{SAVE_ID_RE.pattern})\.distcp(?:{re.escape(INDEX_SUFFIX)})?"
                          rf"|__values_{SAVE_ID_RE.pattern}\.distcp|{re.escape(CHECKSUMS_FILE)}|\.metadata)"
                          r"(?:\.tmp-\d+)?")


def torch_dcp_own_file(name: str) -> bool:
    """Whether ``name`` is one of the files a torch-format save (dcp's or torch's) writes."""
    return bool(_OWN_FILE_RE.fullmatch(name))


class _Collect:
    """A write-only stream ``torch.save`` writes into, keeping its pieces as buffers for one
    ``Storage.put``: a piece inside the saved tensor's storage is kept as a view (no copy: the
    data record of a CPU tensor is written straight from its storage), any other is copied
    (the zip headers torch writes from buffers of its own)."""

    def __init__(self, lo: int, hi: int):
        self.parts: list[Any] = []
        self.nbytes = 0
        self._lo, self._hi = lo, hi

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if n > _SMALL_WRITE:
            import numpy as np

            addr = np.frombuffer(mv, np.uint8).ctypes.data
            self.parts.append(mv if self._lo <= addr and addr + n <= self._hi else bytes(mv))
        elif n:
            self.parts.append(bytes(mv))
        self.nbytes += n
        return n

    def flush(self) -> None:
        pass


def _exact(t: Any, key: str) -> Any:
    """``t`` on the CPU as a tensor whose storage holds exactly its elements, row-major."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {key!r}: the torch-dcp format stores torch tensors, got "
                        f"{type(t).__module__}.{type(t).__name__}; save numpy or MindSpore data in the native format")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == nbytes:
        return t
    if not nbytes:
        return torch.empty(t.shape, dtype=t.dtype)
    # A view of a larger storage (a box of a shard, a staging arena): torch.save would store
    # all of it. The same memory as a tensor of its own storage, without a copy.
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)


def _blob(t: Any) -> tuple[list[Any], int]:
    """(the buffers of ``torch.save(t)``, their total size)."""
    import torch

    lo = t.data_ptr()
    out = _Collect(lo, lo + t.numel() * t.element_size())
    torch.save(t, out)
    return out.parts, out.nbytes


class TorchDcpWriter(NativeWriter):
    """Writes torch DCP's format into ``path`` (module docstring), in ``NativeWriter``'s call
    order: rank 0 ``lock()`` and ``encode_values``; every writing rank ``write_file`` (its
    chunks, named by ``chunk_key``); rank 0 ``write_values``; once all ranks are done, rank
    0 ``commit(metadata)`` (the chunks' and values' files named in it) with ``planner_data``
    set, then ``remove_stray``, then releases the lock."""

    format = "torch-dcp"

    def __init__(self, path: Any, *, allow_pickle: bool = False, sync_files: bool = True,
                 transforms: tuple[str, ...] = ()):
        #: torch's transform descriptors applied to every item: () or ("stream.zstd/1",)
        self.transforms = check_transforms_written(transforms)  # before the directory is made
        super().__init__(path, allow_pickle=allow_pickle)
        #: {flattened name: its keys from the top}, set by the caller on rank 0 before ``commit``
        self.planner_data: dict[str, tuple[Any, ...]] = {}
        self.sync_files = bool(sync_files)

    @staticmethod
    def data_file_name(rank: int, save_id: str) -> str:
        return f"__{int(rank)}_{save_id}.distcp"

    @staticmethod
    def values_file_name(save_id: str) -> str:
        return f"__values_{save_id}.distcp"

    def write_file(self, file_name: str, tensors: Mapping[str, Any]) -> int:
        """One data file of ``tensors`` ({chunk key: tensor}) as torch.save blobs, atomic, and
        its index beside it. Returns the data file's size."""
        import torch

        t0 = time.perf_counter()
        name = self._target(file_name)
        parts: list[Any] = []
        index: dict[str, list[Any]] = {}
        keep: list[Any] = []  # the views in ``parts`` do not own their memory: hold each copy until put returns
        pos = 0
        for key, t in tensors.items():
            t = _exact(t, key)
            if self.transforms:  # the bytes as stored, and their checksums
                packed = zstd_torch_save(t)
                buffers, n, raw = [packed], len(packed), packed
            else:
                keep.append(t)
                buffers, n = _blob(t)
                raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else b""
            index[key] = [pos, n, block_digests(raw), list(self.transforms)]
            parts.extend(buffers)
            pos += n
        n = self.storage.put(name, parts)
        del keep
        self._put_index(name + INDEX_SUFFIX, json.dumps(index, separators=(",", ":")).encode())
        logger.debug("wrote %s: %d chunks, %d bytes in %.3f s", self.storage.path(name), len(index), n,
                     time.perf_counter() - t0)
        return n

    def _put_index(self, name: str, raw: bytes) -> None:
        """An index file, read by ``commit`` and removed after it: it needs to be whole when
        read (written to a temporary name, then renamed), not durable (a crash before the
        commit leaves no checkpoint to need it), so on local storage it is not synced (two
        fsyncs less per writing rank)."""
        if self.storage.local:
            write_unsynced(self.storage.path(name), raw)
        else:
            self.storage.put(name, [raw])

    def write_values(self, values: Mapping[str, Any] | EncodedValues, *,
                     file_name: str = "__values.distcp") -> dict[str, ValueMeta]:
        """Every non-tensor value as a torch.save blob in ``file_name`` (torch's
        ``BytesStorageMetadata`` items); JSON values need no ``allow_pickle``, others do."""
        import torch

        enc = values if isinstance(values, EncodedValues) else self.encode_values(values)
        every = dict(enc.inline)
        if enc.pickled is not None:
            import pickle

            every.update(pickle.loads(enc.pickled))  # noqa: S301 - bytes this process pickled just now
        out: dict[str, ValueMeta] = {}
        parts: list[bytes] = []
        pos = 0
        for name, value in every.items():
            if isinstance(value, TorchSavedValue):  # serialised by the rank holding it: written unread
                raw = value.blob
            else:
                buf = io.BytesIO()
                torch.save(value, buf)
                raw = buf.getvalue()
            if self.transforms:  # the bytes as stored, and their checksum
                raw = zstd_bytes(raw)
            out[name] = ValueMeta(name=name, file=file_name, key=name, storage=(pos, len(raw)),
                                  checksum=bytes_checksum(raw), transforms=self.transforms)
            parts.append(raw)
            pos += len(raw)
        if parts:
            self.storage.put(self._target(file_name), parts)
        return out

    def commit(self, metadata: CheckpointMetadata) -> None:
        """Write ``dcp-checksums.json``, then ``.metadata`` last and atomically (the chunks'
        (offset, length) read from the index files their writers left)."""
        if not isinstance(metadata, CheckpointMetadata):
            raise TypeError(f"metadata must be a CheckpointMetadata, got {type(metadata).__name__}")
        files = [(c.file, name) for name, t in metadata.tensors.items() for c in t.chunks]
        files += [(v.file, name) for name, v in metadata.values.items() if v.file is not None]
        self.storage.check_files(files)
        stored = self._stored({c.file for t in metadata.tensors.values() for c in t.chunks})
        sums = {"tensors": {}, "values": {n: v.checksum for n, v in metadata.values.items() if v.checksum}}
        for name, t in metadata.tensors.items():
            sums["tensors"][name] = {",".join(map(str, c.offsets)): stored[(c.file, c.key)][2] for c in t.chunks}
        self.storage.put(CHECKSUMS_FILE, [json.dumps(sums, separators=(",", ":")).encode()])
        raw = torch_metadata(metadata, stored, self.planner_data, self.path)
        fresh = not self.storage.exists(METADATA_FILE)
        if self.storage.local:
            self.storage.put(METADATA_FILE, [raw])
        else:
            self._commit_object_named(METADATA_FILE, raw)
        if fresh and self.storage.local:
            self.storage.sync(parent=True)
        logger.debug("committed %s (torch-dcp): %d tensors, %d values", self.path, len(metadata.tensors),
                     len(metadata.values))

    def _commit_object_named(self, name: str, raw: bytes) -> None:
        self.storage.put(name, [raw])

    def _stored(self, files: Iterable[str]) -> dict[tuple[str, str], list[Any]]:
        """{(data file, chunk key): [offset, length, checksum, transforms]} from each file's index."""
        out: dict[tuple[str, str], list[Any]] = {}
        for file in sorted(files):
            raw = self.storage.read_small(file + INDEX_SUFFIX, limit=_INDEX_LIMIT, key=file)
            try:
                index = json.loads(raw)
                for key, (off, length, digest, transforms) in index.items():
                    out[(file, key)] = [int(off), int(length), str(digest), tuple(map(str, transforms))]
            except (ValueError, TypeError) as e:
                raise MetadataError(f"the index of {file!r} is not what this writer wrote ({e}); save again",
                                    path=self.storage.path(file + INDEX_SUFFIX)) from None
        return out

    def remove_stray(self, metadata: CheckpointMetadata) -> list[str]:
        """After ``commit``: remove the torch-format files (this writer's and torch's own
        ``__<rank>_<n>.distcp``) that the new metadata does not name, and the index files."""
        named = {c.file for t in metadata.tensors.values() for c in t.chunks}
        named |= {v.file for v in metadata.values.values() if v.file is not None}
        keep = named | {METADATA_FILE, CHECKSUMS_FILE}
        try:
            names = self.storage.names()
        except (OSError, CheckpointError) as e:
            logger.warning("could not list %s to remove the leftovers of earlier saves: %s", self.path, e)
            return []
        stray = sorted(n for n in names if n not in keep and torch_dcp_own_file(n))
        removed = []
        for name in stray:
            try:
                self.storage.delete(name)
                removed.append(name)
            except (OSError, CheckpointError) as e:  # the checkpoint is committed; a leftover only costs space
                logger.warning("could not remove the leftover %s: %s", self.storage.path(name), e)
        if removed:
            logger.debug("removed %d leftover file(s) from %s: %s", len(removed), self.path, summarise(removed))
        return removed

    def invalidate(self) -> None:
        self.storage.delete(METADATA_FILE)
        self.storage.sync()


def torch_metadata(metadata: CheckpointMetadata, stored: Mapping[tuple[str, str], list[Any]],
                   planner_data: Mapping[str, tuple[Any, ...]], checkpoint_id: str) -> bytes:
    """The pickled torch ``Metadata`` of ``metadata`` (chunks at ``stored``: offset, length,
    checksum and, optionally, transform descriptors), as torch's ``FileSystemWriter.finish``
    pickles it."""
    import pickle

    import torch
    from torch.distributed.checkpoint import metadata as tm
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for name, t in metadata.tensors.items():
        dtype = getattr(torch, t.dtype)
        chunks = []
        for i, c in enumerate(t.chunks):
            chunks.append(tm.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
            off, length, _, *transforms = stored[(c.file, c.key)]
            storage[tm.MetadataIndex(name, c.offsets, i)] = _info(c.file, off, length, *transforms)
        state[name] = tm.TensorStorageMetadata(tm.TensorProperties(dtype=dtype), torch.Size(t.shape), chunks)
    for name, v in metadata.values.items():
        state[name] = tm.BytesStorageMetadata()
        storage[tm.MetadataIndex(name)] = _info(v.file, *v.storage, v.transforms)
    plan = {n: tuple(planner_data.get(n) or _keys_of(n)) for n in state}
    md = tm.Metadata(state_dict_metadata=state, planner_data=plan, storage_data=storage,
                     storage_meta=tm.StorageMeta(checkpoint_id=checkpoint_id, save_id=None),
                     version=CURRENT_DCP_VERSION)
    raw = pickle.dumps(md)
    if len(raw) > METADATA_LIMIT:
        raise ValueError(f"the torch-dcp metadata would be {len(raw)} bytes, over dcp's read limit of "
                         f"{METADATA_LIMIT}: save in the native format")
    return raw


def _info(file: str, offset: int, length: int, transforms: tuple[str, ...] = ()) -> Any:
    """torch's ``_StorageInfo`` of an item; its ``transform_descriptors`` left out (None, as
    torch leaves it, and as torch releases before the field read) when there are none."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not transforms:
        return _StorageInfo(file, offset, length)
    return _StorageInfo(file, offset, length, transform_descriptors=list(transforms))


def _keys_of(name: str) -> tuple[Any, ...]:
    """A name's keys when no rank-0 leaf recorded them (a tensor rank 0 does not hold)."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))
