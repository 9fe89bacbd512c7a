"""verify_checkpoint: check a whole checkpoint without loading it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from .._dtypes import itemsize
from .._errors import CheckpointError, MetadataError, MissingFileError, MissingMetadataError, summarise
from .._model import CheckpointMetadata, ChunkMeta
from .._reader import CheckpointReader, open_checkpoint
from ..formats._detect import detect_format
from ..formats._hf import INDEX_FILE, INDEX_LIMIT, load_hf
from ..formats._native import load_native, stray_among, stray_files
from ..formats._torch_dcp import CHECKSUMS_FILE, check_storage, load_torch_dcp, stored_ranges
from ..storage._names import METADATA_LIMIT
from ..storage._pread import pread_bytes
from ..storage._protocol import Storage, StorageFile
from ..storage._roots import read_regular, storage_at
from ..storage._uri import real_root
from ._checksum import BlockSums
from ._dcp_blocks import check_loaded, chunk_key, verify_chunk
from ._value_sums import check_bytes, check_value


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` checked and every problem it found (empty: all good)."""

    path: str
    format: str
    tensors: int
    chunks: int
    chunks_with_checksums: int
    bytes_verified: int
    seconds: float
    problems: tuple[str, ...]
    values: int = 0
    values_with_checksums: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike[str], *, format: str | None = None) -> VerifyReport:
    """Check a checkpoint: its metadata and structure (file names, regular files inside the
    directory, coverage of every tensor by its chunks: what ``open_checkpoint`` checks),
    every data file's header against its size and against the metadata (shape, dtype,
    key), torch DCP byte ranges against file sizes, every block of every chunk that has
    checksums (native format; torch DCP that dcp wrote: ``dcp-checksums.json``), reading
    each file once in 64 MiB windows, and every value that has a checksum (its JSON text,
    the bytes of its file, or of its torch DCP blob: nothing is unpickled). A torch DCP
    checksums file that cannot be used is a problem, and the rest is checked without it.

    Missing, truncated and unreadable data files are problems (one line each, naming what
    they hold), and the other files are still checked; the counts are the checkpoint's own,
    bad files' entries included. Stray files are problems too (native format: files the
    writer names, ``rank-*.safetensors``, ``values*.pkl`` and temporary files, that the
    metadata does not refer to).

    Returns a VerifyReport listing one line per problem; raises CheckpointError only when
    the checkpoint cannot be opened at all (no or unreadable metadata)."""
    t0 = time.perf_counter()
    chunks = with_sums = verified = 0
    r, bad = _open(path, format)
    problems = list(bad.lines)
    with r:
        meta = r.metadata
        for name, t in meta.tensors.items():
            for c in t.chunks:
                chunks += 1
                if c.file in bad.files or (r.format == "torch-dcp" and c.checksum is None):
                    continue  # torch DCP byte ranges were checked against file sizes when opening; bad: listed
                try:
                    if r.format == "torch-dcp":
                        with_sums += 1
                        verified += _verify_dcp_chunk(r, name, t.dtype, c)
                        continue
                    f, sums = r._safetensors(name, t.dtype, c)
                    if sums is not None:
                        with_sums += 1
                        verified += f.verify_entry(c.key, sums, name=name, worker=r._hasher)
                except CheckpointError as e:
                    problems.append(str(e))
        value_sums = _verify_values(r, problems, bad.files)
        if r.format == "native":
            problems.extend(f"stray file {n!r}: the metadata does not name it (left by an earlier or killed save, "
                            "or written by a save in progress); the next save into this directory removes it, "
                            "or delete it" for n in _strays(r.path, meta))
        return VerifyReport(path=r.path, format=r.format, tensors=len(meta.tensors) + len(bad.tensors),
                            chunks=chunks + bad.chunks, chunks_with_checksums=with_sums, bytes_verified=verified,
                            seconds=time.perf_counter() - t0, problems=tuple(dict.fromkeys(problems)),
                            values=len(meta.values), values_with_checksums=value_sums)


@dataclass
class _Bad:
    """The data files that cannot be checked entry by entry: their problem lines, and the
    tensors and chunks they hold that the reader's metadata lacks (HF: they come from the
    files' headers)."""

    files: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)
    tensors: set[str] = field(default_factory=set)
    chunks: int = 0


def _verify_dcp_chunk(r: CheckpointReader, name: str, dtype: str, c: ChunkMeta) -> int:
    """Every block of a torch DCP chunk that has checksums (its blob loaded whole where its
    layout cannot be read in place; a chunk stored compressed: its bytes as stored, which
    the checksums cover and a load checks before inflating them); the bytes checked."""
    if c.transforms:
        assert c.checksum is not None and c.storage is not None
        f = r._stored_file(name, c.file, c.storage)
        sums = BlockSums.parse(c.checksum, c.storage[1], path=f.path, key=chunk_key(name, c.offsets))
        return verify_chunk(f.fd, c.storage[0], c.storage[1], sums, worker=r._hasher, path=f.path,
                            key=chunk_key(name, c.offsets), name=name)
    f, layout = r._dcp_layout(dtype, name, c)
    sums = r._dcp_sums(f, dtype, name, c, True)
    assert sums is not None and c.storage is not None
    nbytes = c.numel * itemsize(dtype)
    if layout is None:
        r._read_dcp_whole(f, dtype, name, c, tuple(slice(0, 0) for _ in c.sizes), "torch")
        assert r._blob is not None
        check_loaded(r._blob[2], sums, path=f.path, key=chunk_key(name, c.offsets), name=name)
        return nbytes
    return verify_chunk(f.fd, c.storage[0] + layout.start, nbytes, sums, worker=r._hasher, path=f.path,
                        key=chunk_key(name, c.offsets), name=name)


def _open(path: str | os.PathLike[str], format: str | None) -> tuple[CheckpointReader, _Bad]:
    """The reader of the checkpoint's good files, and its bad ones. A checkpoint that opens
    has none (bad headers of native files are found entry by entry); else its metadata is
    read again without the file checks, each file is checked on its own, and HF files whose
    header cannot be read are left out of the metadata. A torch DCP checksums file that
    cannot be used is a problem: the checkpoint is then checked without it."""
    try:
        return open_checkpoint(path, format=format), _Bad()
    except MissingMetadataError:
        raise
    except MetadataError as e:
        if not _about_checksums(e):
            raise
        first: CheckpointError = e
    except CheckpointError as e:
        first = e
    root = real_root(path)  # a local path resolved, or an s3:// root as it is
    try:
        fmt = format or detect_format(root)
    except CheckpointError as e:  # the header it reads (HF: the first file's) is the bad one
        if not (_file_of(root, e.path) or "").endswith(".safetensors"):
            raise
        fmt = "hf"
    storage = storage_at(root)
    if fmt == "native":
        meta = load_native(root)
        bad = _missing(storage, meta, first)
    elif fmt == "torch-dcp":
        meta, unusable = _torch_dcp_meta(root)
        bad = _missing(storage, meta, first)
        bad.lines[:0] = unusable
        _check_ranges(root, meta, bad)
    elif fmt in ("hf", "torch-dcp-hf"):
        meta, bad = _hf_without_bad(root, fmt == "torch-dcp-hf", storage, first)
    else:
        raise first
    return CheckpointReader(root, meta), bad


def _about_checksums(e: CheckpointError) -> bool:
    return (e.path or "").endswith("/" + CHECKSUMS_FILE)


def _torch_dcp_meta(root: str) -> tuple[CheckpointMetadata, list[str]]:
    """A torch DCP checkpoint's metadata without the file checks, with its checksums, or
    without them and the problem line of the checksums file when it cannot be used."""
    try:
        return load_torch_dcp(root, check=False), []
    except CheckpointError as e:
        if not _about_checksums(e):
            raise
        return load_torch_dcp(root, check=False, checksums=False), [str(e)]


def _holds(meta: CheckpointMetadata) -> dict[str, list[str]]:
    """{file: the entries (tensors and values) it holds}."""
    out: dict[str, list[str]] = {}
    for n, t in meta.tensors.items():
        for f in dict.fromkeys(c.file for c in t.chunks):
            out.setdefault(f, []).append(n)
    for n, v in meta.values.items():
        if v.file is not None:
            out.setdefault(v.file, []).append(n)
    return out


def _entries(names: list[str]) -> str:
    return (f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}"
            f" ({summarise([repr(x) for x in names], limit=5)})")


def _missing(storage: Storage, meta: CheckpointMetadata, first: CheckpointError) -> _Bad:
    """The files the metadata names that are missing, one line each; ``first`` (what the
    open raised) again when it is about something else."""
    holds = _holds(meta)
    try:
        storage.check_files([(f, n[0]) for f, n in holds.items()])
    except MissingFileError as e:
        missing = [n for n in e.offenders if n in holds]
    else:
        missing = []
    if not missing and meta.format == "native":
        raise first
    bad = _Bad(files=set(missing))
    bad.lines = [f"missing file {n!r}: named by the metadata for {_entries(sorted(holds[n]))}, not in the directory; "
                 "copy it or re-save" for n in missing]
    return bad


def _check_ranges(root: str, meta: CheckpointMetadata, bad: _Bad) -> None:
    """torch DCP: every present file's stored byte ranges against its size, file by file."""
    by_file: dict[str, list[tuple[str, str, tuple[int, int]]]] = {}
    for item in stored_ranges(dict(meta.tensors), dict(meta.values)):
        by_file.setdefault(item[0], []).append(item)
    for f, items in by_file.items():
        if f in bad.files:
            continue
        try:
            check_storage(root, items)
        except CheckpointError as e:
            bad.files.add(f)
            bad.lines.append(str(e))


def _hf_without_bad(root: str, sharded: bool, storage: Storage, first: CheckpointError
                    ) -> tuple[CheckpointMetadata, _Bad]:
    """HF metadata from the headers that can be read: each file whose header cannot be (or
    that is missing) is left out and listed with the entries the index or its header names."""
    bad = _Bad()
    index = _weight_map(root)
    err: CheckpointError = first
    for _ in range(len(storage.names()) + 1):
        named = [n for n in getattr(err, "offenders", []) or [] if n in set(index.values())]
        if isinstance(err, MissingFileError) and named:  # shards the index names, missing
            for n in named:
                bad.files.add(n)
                bad.lines.append(f"missing file {n!r}: named by the index for "
                                 f"{_entries(sorted(k for k, f in index.items() if f == n))}, not in the "
                                 "directory; copy it or re-save")
        else:
            name = _file_of(root, err.path)
            if name is None or name in bad.files:
                raise first
            bad.files.add(name)
            bad.lines.append(str(err))
        try:
            meta = load_hf(root, sharded=sharded, skip=bad.files)
            break
        except CheckpointError as e:
            err = e
    else:
        raise first
    for f in bad.files:
        keys = sorted(k for k, g in index.items() if g == f) or _header_keys(storage, f)
        bad.tensors |= set(keys) - set(meta.tensors)
        bad.chunks += len(keys)
    return meta, bad


def _weight_map(root: str) -> dict[str, str]:
    try:
        doc = json.loads(read_regular(root, INDEX_FILE, limit=INDEX_LIMIT, key=INDEX_FILE))
    except (CheckpointError, ValueError):
        return {}
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    return {k: v for k, v in wm.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(wm, dict) else {}


def _file_of(root: str, path: str | None) -> str | None:
    """The file under ``root`` that an error's ``path`` names, None when it names none."""
    if not path or not path.startswith(root.rstrip("/") + "/"):
        return None
    return path[len(root.rstrip("/")) + 1:]


def _header_keys(storage: Storage, name: str) -> list[str]:
    """The tensor names in a safetensors header that failed its checks (a truncated file's
    header is usually whole); [] when even that cannot be read."""
    try:
        f = storage.open(name)
        try:
            n = int.from_bytes(_read(f, 0, 8), "little")
            doc = json.loads(_read(f, 8, min(n, INDEX_LIMIT)))
        finally:
            f.close()
    except (CheckpointError, ValueError, OSError):
        return []
    return sorted(k for k in doc if k != "__metadata__") if isinstance(doc, dict) else []


def _read(f: StorageFile, offset: int, n: int) -> bytes:
    buf = bytearray(max(0, min(n, f.size - offset)))
    f.read_into(buf, offset, key=None)
    return bytes(buf)


def _strays(root: str, meta: CheckpointMetadata) -> list[str]:
    storage = storage_at(root)
    if storage.local:
        return stray_files(root, meta)
    return stray_among(storage.names(), meta, legacy=False)  # a listing alone: no legacy names


def _verify_values(r: CheckpointReader, problems: list[str], missing: set[str]) -> int:
    """Check every value that has a checksum (each file read once); returns their count."""
    raws: dict[str, bytes | CheckpointError] = {}
    n = 0
    for name, v in r.metadata.values.items():
        if v.checksum is None or v.file in missing:
            continue
        n += 1
        try:
            if v.file is None:
                check_value(name, v.value, v.checksum, path=r.path)
                continue
            if r.format == "torch-dcp" and v.storage is not None:  # its blob, not the file
                f = r._open(v.file, name)
                raw = pread_bytes(f.fd, v.storage[1], v.storage[0], path=f.path, key=name)
                check_bytes(name, v.file, raw, v.checksum, path=f.path, at=v.storage)
                continue
            if v.file not in raws:
                try:
                    raws[v.file] = read_regular(r.path, v.file, limit=METADATA_LIMIT, key=name)
                except CheckpointError as e:
                    raws[v.file] = e
            raw = raws[v.file]
            if isinstance(raw, CheckpointError):
                raise raw
            check_bytes(name, v.file, raw, v.checksum, path=os.path.join(r.path, v.file))
        except CheckpointError as e:
            problems.append(str(e))
    return n
