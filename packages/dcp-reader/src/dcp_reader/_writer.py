"""NativeWriter: each rank writes its own safetensors data file(s); rank 0 commits the
JSON metadata last, atomically, so a reader sees either a whole checkpoint or none."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import sys
import time
from collections.abc import Mapping
from typing import Any

from ._checksum import block_digests
from ._dtypes import DTYPE_NAMES, to_safetensors, torch_dtype_name
from ._errors import UnknownDtypeError, summarise
from ._model import CheckpointMetadata, ValueMeta
from ._value_sums import bytes_checksum, value_checksum
from ._values import is_storable_value
from .formats._native import CHECKSUMS_KEY, MARKER_KEY, MARKER_VALUE, METADATA_FILE
from .formats._safetensors_file import read_header_at
from .storage._object import ObjectStorage
from .storage._paths import check_files, check_name
from .storage._uri import is_uri, real_root

logger = logging.getLogger(__name__)

_COPY_BLOCK = 64 * 1024 * 1024  # bytes per write() call: bounds the transient copy, not a tuning knob


def _as_bytes(t: Any, key: str) -> tuple[str, tuple[int, ...], Any]:
    """(neutral dtype, shape, flat uint8 buffer) of a torch tensor, numpy array or MindSpore
    tensor, without copying a contiguous host tensor."""
    import numpy as np

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):  # by type: nn.Parameter and other subclasses too
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        dtype = torch_dtype_name(t.dtype)
        if dtype not in DTYPE_NAMES:
            raise UnknownDtypeError(f"tensor {key!r} has dtype {t.dtype}, which has no safetensors code; "
                                    "convert it before saving", key=key)
        shape = tuple(t.shape)
        t = t.contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        return dtype, shape, raw
    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(t, ms.Tensor):  # MindSpore Tensor or Parameter (module "abc")
        t = t.asnumpy()
    if isinstance(t, np.ndarray):
        dtype = t.dtype.name
        if dtype not in DTYPE_NAMES:
            raise UnknownDtypeError(f"array {key!r} has numpy dtype {t.dtype}, which has no safetensors "
                                    "code; convert it before saving", key=key)
        shape = tuple(t.shape)
        return dtype, shape, np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    raise TypeError(f"tensor {key!r}: expected a torch tensor, numpy array or MindSpore tensor, got "
                    f"{type(t).__module__}.{type(t).__name__}")


def with_checksums(root_real: str, metadata: CheckpointMetadata) -> CheckpointMetadata:
    """``metadata`` with each chunk's missing checksum taken from its file's header (written
    there by ``write_file``; chunks of files without them stay as they are) and each inline
    value's missing checksum computed."""
    by_file: dict[str, dict[str, str]] = {}
    tensors = {}
    for name, t in metadata.tensors.items():
        chunks = []
        for c in t.chunks:
            if c.checksum is None:
                if c.file not in by_file:
                    raw = (read_header_at(root_real, c.file).metadata or {}).get(CHECKSUMS_KEY)
                    by_file[c.file] = json.loads(raw) if isinstance(raw, str) else {}
                digest = by_file[c.file].get(c.key)
                if isinstance(digest, str):
                    c = dataclasses.replace(c, checksum=digest)
            chunks.append(c)
        tensors[name] = dataclasses.replace(t, chunks=tuple(chunks))
    values = {name: v if v.checksum is not None or v.file is not None
              else dataclasses.replace(v, checksum=value_checksum(v.value)) for name, v in metadata.values.items()}
    return dataclasses.replace(metadata, tensors=tensors, values=values)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported on this filesystem; nothing more can be done
    finally:
        os.close(fd)


def _atomic_write(final: str, chunks: list[Any]) -> int:
    if is_uri(final):  # one PUT, or a multipart upload: the object appears whole or not at all
        root, _, name = final.rpartition("/")
        return ObjectStorage(root).put(name, chunks)
    tmp = f"{final}.tmp-{os.getpid()}"
    n = 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                mv = memoryview(c).cast("B")
                for i in range(0, len(mv), _COPY_BLOCK):
                    n += f.write(mv[i:i + _COPY_BLOCK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(os.path.dirname(final))
    return n


class NativeWriter:
    """Writes a native checkpoint into ``path``.

    Call order: every writing rank calls ``write_file`` for its own file(s) (distinct names,
    e.g. ``rank-00003.safetensors``); rank 0 may call ``write_values``; after all ranks are
    done (a barrier in the caller), rank 0 calls ``commit(metadata)``, which writes
    ``dcp-metadata.json`` last. Saving over a committed checkpoint: call ``invalidate()`` on
    rank 0 before any rank writes, so a crash never leaves old metadata over new data.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool = False):
        # an object store (s3://bucket/prefix): files go up with storage.put, see _atomic_write
        self.path = real_root(path) if is_uri(os.fspath(path)) else os.path.abspath(os.fspath(path))
        self.allow_pickle = bool(allow_pickle)
        if not is_uri(self.path):
            os.makedirs(self.path, exist_ok=True)

    def _target(self, file_name: str) -> str:
        name = check_name(file_name, root=self.path)
        if name == METADATA_FILE:
            raise ValueError(f"file_name {file_name!r} is reserved for the metadata")
        if is_uri(self.path):
            return f"{self.path}/{name}"
        full = os.path.join(self.path, name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        return full

    def write_file(self, file_name: str, tensors: Mapping[str, Any]) -> int:
        """Write one safetensors data file holding ``tensors`` ({key: tensor}, torch tensors,
        numpy arrays or MindSpore tensors); atomic (tmp + fsync + rename). Returns its size."""
        t0 = time.perf_counter()
        final = self._target(file_name)
        header: dict[str, Any] = {"__metadata__": {MARKER_KEY: MARKER_VALUE, "format": "pt"}}
        sums: dict[str, str] = {}
        bufs = []
        pos = 0
        bad = []
        for key, t in tensors.items():
            if not isinstance(key, str):
                raise TypeError(f"keys must be str, got {key!r} in {file_name!r}")
            try:
                dtype, shape, raw = _as_bytes(t, key)
            except UnknownDtypeError as e:
                bad.append(e)
                continue
            header[key] = {"dtype": to_safetensors(dtype), "shape": list(shape),
                           "data_offsets": [pos, pos + raw.nbytes]}
            pos += raw.nbytes
            bufs.append(raw)
            sums[key] = block_digests(raw)
        if bad:
            raise UnknownDtypeError(f"{len(bad)} tensor(s) cannot be saved: {summarise([e.message for e in bad])}",
                                    path=final, key=bad[0].key, offenders=[e.key or "" for e in bad])
        # Each rank's digests travel in its own file's header; commit() on rank 0 moves them
        # into the metadata (one header read per file), so savers need not gather them.
        header["__metadata__"][CHECKSUMS_KEY] = json.dumps(sums, separators=(",", ":"))
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # safetensors aligns the data section to 8 bytes
        n = _atomic_write(final, [len(hjson).to_bytes(8, "little"), hjson, *bufs])
        logger.debug("wrote %s: %d tensors, %d bytes in %.3f s", final, len(bufs), n,
                     time.perf_counter() - t0)
        return n

    def write_values(self, values: Mapping[str, Any], *, file_name: str = "values.pkl") -> dict[str, ValueMeta]:
        """ValueMeta for each non-tensor value: JSON values inline; others pickled into
        ``file_name`` when allow_pickle, else TypeError listing every offender. Each carries
        a checksum (of its JSON text, or of the bytes of ``file_name``)."""
        out: dict[str, ValueMeta] = {}
        pickled: dict[str, Any] = {}
        for name, v in values.items():
            if is_storable_value(v):
                out[name] = ValueMeta(name=name, value=v, checksum=value_checksum(v))
            else:
                pickled[name] = v
        if pickled and not self.allow_pickle:
            kinds = [f"{k!r}: {type(v).__module__}.{type(v).__name__}" for k, v in pickled.items()]
            raise TypeError(f"{len(pickled)} value(s) cannot be stored as JSON (None, bool, int, float, "
                            f"str, and lists, tuples and dicts of them): {summarise(kinds)}. Convert them, or pass "
                            "allow_pickle=True on save and on load (only for trusted checkpoints)")
        if pickled:
            final = self._target(file_name)
            raw = pickle.dumps(pickled, protocol=pickle.HIGHEST_PROTOCOL)
            _atomic_write(final, [raw])
            checksum = bytes_checksum(raw)
            for name in pickled:
                out[name] = ValueMeta(name=name, file=file_name, key=name, checksum=checksum)
        return out

    def invalidate(self) -> None:
        """Remove a committed metadata file (rank 0, before any rank writes new data)."""
        if is_uri(self.path):
            ObjectStorage(self.path).delete(METADATA_FILE)
            return
        try:
            os.unlink(os.path.join(self.path, METADATA_FILE))
        except FileNotFoundError:
            return
        _fsync_dir(self.path)

    def commit(self, metadata: CheckpointMetadata) -> None:
        """Write the metadata last and atomically. Checks first that every file it names
        exists inside the checkpoint (MissingFileError / UnsafePathError listing all). Chunks
        without a checksum get the block checksums ``write_file`` recorded in their file;
        inline values without one get the checksum of their JSON text."""
        if not isinstance(metadata, CheckpointMetadata):
            raise TypeError(f"metadata must be a CheckpointMetadata, got {type(metadata).__name__}")
        if metadata.format != "native":
            raise ValueError(f"metadata.format must be 'native' for NativeWriter, got {metadata.format!r}")
        files = [(c.file, name) for name, t in metadata.tensors.items() for c in t.chunks]
        files += [(v.file, name) for name, v in metadata.values.items() if v.file is not None]
        root = real_root(self.path)
        check_files(root, files)
        metadata = with_checksums(root, metadata)
        _atomic_write(os.path.join(self.path, METADATA_FILE), [metadata.to_json().encode()])
        logger.debug("committed %s: %d tensors, %d values", self.path, len(metadata.tensors),
                     len(metadata.values))
