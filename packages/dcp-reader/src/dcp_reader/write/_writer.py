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
from collections.abc import Iterable, Mapping
from typing import Any

from .._dtypes import DTYPE_NAMES, to_safetensors, torch_dtype_name
from .._errors import CheckpointError, MissingFileError, UnknownDtypeError, summarise
from .._model import CheckpointMetadata, ValueMeta
from .._values import decode_value, is_storable_value
from ..formats._native import (
    CHECKSUMS_KEY,
    MARKER_KEY,
    MARKER_VALUE,
    METADATA_FILE,
    files_named,
    load_native,
    stray_among,
    stray_files,
)
from ..formats._safetensors_file import read_header_at
from ..integrity._checksum import block_digests
from ..integrity._value_sums import bytes_checksum, canonical_json, value_checksum
from ..storage._names import check_name
from ..storage._object import ObjectChangedError, conditional_writes
from ..storage._roots import storage_type, write_atomic
from ._save_lock import NoLock, WriterLock, WriterLockError

logger = logging.getLogger(__name__)

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


#: The file or object at a full location, written whole or not at all (the storage's ``put``).
_atomic_write = write_atomic


def _legacy_named(root_real: str) -> set[str]:
    """The files the committed metadata names, read only when a ``values.pkl`` (a name of
    dcp-reader 0.3 and earlier, that nothing else tells apart from a user's file) is there."""
    if not os.path.lexists(os.path.join(root_real, "values.pkl")):
        return set()
    try:
        return files_named(load_native(root_real))
    except (CheckpointError, OSError):
        return set()  # no readable native metadata: nothing in the directory was committed by the writer


@dataclasses.dataclass(frozen=True)
class EncodedValues:
    """Non-tensor values serialised by ``NativeWriter.encode_values``: the JSON ones (with
    their checksums) and the pickle of the others (None when there are none)."""

    inline: dict[str, Any]
    checksums: dict[str, str]
    pickled_names: tuple[str, ...]
    pickled: bytes | None


def _json_checksum(value: Any) -> str:
    """The value's checksum, after checking that its JSON text decodes back to itself at the
    depth the metadata holds it (three objects down: document, values, entry)."""
    raw = canonical_json(value)
    back = decode_value(json.loads(b'{"v":{"n":{"value":' + raw + b"}}}")["v"]["n"]["value"])
    if canonical_json(back) != raw:
        raise ValueError("its JSON text does not decode back to the same value")
    return bytes_checksum(raw)  # the checksum of the canonical text: value_checksum(value)


def _pickle_values(pickled: Mapping[str, Any]) -> bytes:
    try:
        return pickle.dumps(dict(pickled), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - find and name the offending values below
        pass
    bad = []
    for name, v in pickled.items():
        try:
            pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickling runs arbitrary __reduce__ code
            bad.append(f"{name!r}: {type(e).__name__}: {str(e)[:120]}")
    raise TypeError(f"{len(bad) or len(pickled)} value(s) cannot be pickled: "
                    f"{summarise(bad) if bad else summarise([repr(n) for n in pickled])}. Convert them")


class NativeWriter:
    """Writes a native checkpoint into ``path``.

    Call order: rank 0 takes the directory's single-writer ``lock()`` and serialises the
    non-tensor values with ``encode_values`` (so that every refusal comes before anything
    is written); every writing rank calls ``write_file`` for its own file(s) (distinct
    names); rank 0 may call ``write_values``; after all ranks are done (a barrier in the
    caller), rank 0 calls ``commit(metadata)``, which writes ``dcp-metadata.json`` last,
    then ``remove_stray(metadata)``, then releases the lock.

    Saving over a committed checkpoint: write files under names the committed metadata does
    not use (``data_file_name(rank, save_id)`` with a new save id, as ``dcp_load.save``
    does). The old checkpoint stays whole until ``commit`` replaces its metadata in one
    rename, so a crash at any point leaves the old checkpoint or the new one, never a mix.
    (Rewriting files under the names the committed metadata uses is not safe; for that
    case only, ``invalidate()`` first removes the old metadata.)

    On an object store, which has no locks, ``lock()`` records the metadata object's ETag
    and the prefix's names instead: ``commit`` writes the metadata only if it is still that
    version (``If-Match``, or ``If-None-Match: *`` where there was none), so of two saves
    into one prefix the second to commit fails with ``WriterLockError``; ``remove_stray``
    removes only objects that were there when the save began.
    """

    #: the dcp-reader format this writer writes (``CheckpointMetadata.format``)
    format = "native"

    #: (ETag of the metadata object or None, names under the prefix), recorded by ``lock()``
    #: on an object store
    _seen: tuple[str | None, frozenset[str]] | None = None

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool = False):
        path = os.fspath(path)
        #: where every file goes (``Storage.put``): a directory (made now) or an object prefix
        self.storage = storage_type(path).create(path)
        self.path = os.path.abspath(path) if self.storage.local else self.storage.root
        self.allow_pickle = bool(allow_pickle)
        self._replaced: set[str] = set()  # legacy files the metadata replaced by commit() named

    def _target(self, file_name: str) -> str:
        name = check_name(file_name, root=self.path)
        if name == METADATA_FILE:
            raise ValueError(f"file_name {file_name!r} is reserved for the metadata")
        return name

    def write_file(self, file_name: str, tensors: Mapping[str, Any]) -> int:
        """Write one safetensors data file holding ``tensors`` ({key: tensor}, torch tensors,
        numpy arrays or MindSpore tensors); atomic (tmp + fsync + rename). Returns its size."""
        t0 = time.perf_counter()
        name = self._target(file_name)
        final = self.storage.path(name)
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
        n = self.storage.put(name, [len(hjson).to_bytes(8, "little"), hjson, *bufs])
        logger.debug("wrote %s: %d tensors, %d bytes in %.3f s", final, len(bufs), n,
                     time.perf_counter() - t0)
        return n

    def encode_values(self, values: Mapping[str, Any]) -> EncodedValues:
        """Serialise every non-tensor value now, with the serialisers ``commit`` and
        ``write_values`` use, so that a value that cannot be stored is refused before
        anything is written: TypeError or ValueError naming every offending key. JSON values
        are encoded and decoded back (an int beyond Python's 4,300-digit conversion limit,
        nesting too deep to read back); others are pickled when ``allow_pickle``, else
        listed."""
        inline: dict[str, str] = {}
        pickled: dict[str, Any] = {}
        bad: list[str] = []
        for name, v in values.items():
            try:
                if not is_storable_value(v):
                    pickled[name] = v
                    continue
                inline[name] = _json_checksum(v)
            except (ValueError, TypeError, RecursionError) as e:
                bad.append(f"{name!r}: {type(e).__name__}: {str(e)[:120]}")
        if bad:
            raise ValueError(f"{len(bad)} value(s) cannot be stored in the metadata's JSON: {summarise(bad)}. "
                             "Convert them (for example a huge int to a str)")
        if pickled and not self.allow_pickle:
            kinds = [f"{k!r}: {type(v).__module__}.{type(v).__name__}" for k, v in pickled.items()]
            raise TypeError(f"{len(pickled)} value(s) cannot be stored as JSON (None, bool, int, float, "
                            f"str, and lists, tuples and dicts of them): {summarise(kinds)}. Convert them, or pass "
                            "allow_pickle=True on save and on load (only for trusted checkpoints)")
        raw = _pickle_values(pickled) if pickled else None
        return EncodedValues({n: values[n] for n in inline}, inline, tuple(pickled), raw)

    def write_values(self, values: Mapping[str, Any] | EncodedValues, *,
                     file_name: str = "values.pkl") -> dict[str, ValueMeta]:
        """ValueMeta for each non-tensor value: JSON values inline; others pickled into
        ``file_name`` when allow_pickle, else TypeError listing every offender. Each carries
        a checksum (of its JSON text, or of the bytes of ``file_name``). ``values`` may be
        what ``encode_values`` returned (nothing is serialised twice)."""
        enc = values if isinstance(values, EncodedValues) else self.encode_values(values)
        out = {name: ValueMeta(name=name, value=v, checksum=enc.checksums[name]) for name, v in enc.inline.items()}
        if enc.pickled is not None:
            self.storage.put(self._target(file_name), [enc.pickled])
            checksum = bytes_checksum(enc.pickled)
            for name in enc.pickled_names:
                out[name] = ValueMeta(name=name, file=file_name, key=name, checksum=checksum)
        return out

    def lock(self, note: Mapping[str, Any] | None = None) -> WriterLock:
        """Take the directory's single-writer lock (``WriterLockError`` naming the holder
        when another process writes into it); release it after ``commit``. ``note``: added
        to the record the next writer reads as ``WriterLock.previous``. An object store has
        no locks: there the save goes ahead unlocked (see the README)."""
        if not self.storage.local:
            self._seen = self._object_state()
            return NoLock()
        return WriterLock(self.path, note).acquire()

    def discard(self, file_names: Iterable[str]) -> None:
        """Remove files this save wrote (after a failure, before ``commit``); best effort."""
        for name in file_names:
            try:
                self.storage.delete(self._target(name))
            except (OSError, CheckpointError):  # refused (a policy without s3:DeleteObject) too
                pass  # already gone or unreachable: the next save's remove_stray takes it

    def remove_stray(self, metadata: CheckpointMetadata) -> list[str]:
        """After ``commit(metadata)``: remove the files the native writer names (data, values
        and temporary files) that ``metadata`` does not refer to, left by an earlier save or
        a killed one. Other files are never touched. Returns the names removed."""
        removed = []
        if not self.storage.local:
            return self._remove_stray_objects(metadata)
        for name in stray_files(os.path.realpath(self.path), metadata, self._replaced):
            try:
                os.unlink(os.path.join(self.path, name))
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as e:  # the checkpoint is committed; a leftover only costs space
                logger.warning("could not remove the leftover %s: %s", os.path.join(self.path, name), e)
        if removed:  # not synced: a crash that undoes a removal leaves a stray the next save removes
            logger.debug("removed %d leftover file(s) from %s: %s", len(removed), self.path, summarise(removed))
        return removed

    def invalidate(self) -> None:
        """Remove a committed metadata file (rank 0, before any rank writes new data)."""
        self.storage.delete(METADATA_FILE)
        self.storage.sync()
        if self._seen is not None:
            self._seen = (None, self._seen[1])  # the commit now creates the metadata object

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
        root = self.storage.root
        self.storage.check_files(files)
        metadata = with_checksums(root, metadata)
        self._replaced = _legacy_named(root) if self.storage.local else set()
        if self.storage.local:
            # A directory that held committed metadata had its entry made durable by that
            # commit's parent sync; one fsync fewer per save into the same directory (2 ms of
            # a 40 ms 8 MiB save on 4 gloo ranks, ext4, benchmarks/save/bench_save.py).
            fresh = not os.path.exists(os.path.join(root, METADATA_FILE))
            self.storage.put(METADATA_FILE, [metadata.to_json().encode()])
        else:
            fresh = True
            self._commit_object(metadata.to_json().encode())
        # The checkpoint directory's own entry lives in its parent: a directory this save
        # created is durable only once the parent is synced too.
        if fresh:
            self.storage.sync(parent=True)
        logger.debug("committed %s: %d tensors, %d values", self.path, len(metadata.tensors),
                     len(metadata.values))

    def _object_state(self) -> tuple[str | None, frozenset[str]]:
        """(the metadata object's ETag, None when there is none; the names under the prefix)."""
        try:
            etag = self.storage.head(METADATA_FILE)[1]
        except MissingFileError:
            etag = None
        return etag, frozenset(self.storage.names())

    def _commit_object(self, raw: bytes) -> None:
        """Put the metadata object if it is still the version ``lock()`` saw (when ``lock``
        was not called: the version there now); else WriterLockError, nothing written."""
        store = self.storage
        if not conditional_writes():
            store.put(METADATA_FILE, [raw])
            return
        etag = (self._seen or self._object_state())[0]
        try:
            store.put(METADATA_FILE, [raw], if_absent=etag is None, if_match=etag)
        except ObjectChangedError:
            try:
                now = f"ETag {store.head(METADATA_FILE)[1]}"
            except (CheckpointError, OSError):
                now = "no object"
            raise WriterLockError(
                f"another save committed into {self.path} while this one ran: {METADATA_FILE} had "
                f"{f'ETag {etag}' if etag else 'no object'} when this save began and has {now} now. This "
                "save's metadata was not written (a conditional write), so the checkpoint there is the other "
                "save's, whole. An object store has no locks: save again once the other job is done, or into "
                "a prefix of its own", path=self.path) from None

    def _remove_stray_objects(self, metadata: CheckpointMetadata) -> list[str]:
        """``remove_stray`` on an object store. Objects that appeared after ``lock()`` are
        another save's (one still running) and are left; one that cannot be deleted (a
        bucket policy without s3:DeleteObject) is a warning: the checkpoint is committed."""
        store = self.storage
        try:
            stray = stray_among(store.names(), metadata, legacy=False)
        except CheckpointError as e:
            logger.warning("could not list %s to remove the leftovers of earlier saves (%s); the new checkpoint "
                           "is committed, and the next save removes them", self.path, e)
            return []
        if self._seen is not None:
            stray = [n for n in stray if n in self._seen[1]]
        failed = store.delete_many(stray)
        if failed:
            why = sorted(set(failed.values()))
            logger.warning("could not remove %d leftover object(s) of earlier saves under %s: %s (%s). The new "
                           "checkpoint is committed and loads; they only cost space: delete them, or allow "
                           "s3:DeleteObject on the prefix and the next save removes them", len(failed), self.path,
                           summarise(sorted(failed)), "; ".join(why))
        removed = [n for n in stray if n not in failed]
        if removed:
            logger.debug("removed %d leftover object(s) from %s: %s", len(removed), self.path, summarise(removed))
        return removed
