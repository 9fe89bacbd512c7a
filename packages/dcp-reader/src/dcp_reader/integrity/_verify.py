"""verify_checkpoint: check a whole checkpoint without loading it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .._errors import CheckpointError, MissingFileError, summarise
from .._model import CheckpointMetadata
from .._reader import CheckpointReader, open_checkpoint
from ..formats._detect import detect_format
from ..formats._native import load_native, stray_among, stray_files
from ..storage._names import METADATA_LIMIT
from ..storage._roots import read_regular, storage_at
from ..storage._uri import real_root
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
    checksums (native format), reading each file once in 64 MiB windows, and every value
    that has a checksum (its JSON text, or the bytes of its file: nothing is unpickled).

    Missing data files are problems (one line each, naming what they hold; a native
    checkpoint's other files are still checked), and so are stray files (native format:
    files the writer names, ``rank-*.safetensors``, ``values*.pkl`` and temporary files,
    that the metadata does not refer to).

    Returns a VerifyReport listing one line per problem; raises CheckpointError only when
    the checkpoint cannot be opened at all (no or unreadable metadata)."""
    t0 = time.perf_counter()
    problems: list[str] = []
    chunks = with_sums = verified = 0
    r, missing, fmt = _open(path, format)
    if r is None:  # a format whose files cannot be checked one by one: list what is missing
        return VerifyReport(path=real_root(path), format=fmt, tensors=0, chunks=0,
                            chunks_with_checksums=0, bytes_verified=0, seconds=time.perf_counter() - t0,
                            problems=tuple(f"missing file {n!r}: named by the metadata, not in the directory "
                                           "(copy it or re-save)" for n in missing))
    with r:
        meta = r.metadata
        problems.extend(_missing_lines(meta, missing))
        for name, t in meta.tensors.items():
            for c in t.chunks:
                chunks += 1
                if r.format == "torch-dcp" or c.file in missing:
                    continue  # byte ranges were checked against file sizes when opening; missing: listed
                try:
                    f, sums = r._safetensors(name, t.dtype, c)
                    if sums is not None:
                        with_sums += 1
                        verified += f.verify_entry(c.key, sums, name=name, worker=r._hasher)
                except CheckpointError as e:
                    problems.append(str(e))
        value_sums = _verify_values(r, problems, missing)
        if r.format == "native":
            problems.extend(f"stray file {n!r}: the metadata does not name it (left by an earlier or killed save, "
                            "or written by a save in progress); the next save into this directory removes it, "
                            "or delete it" for n in _strays(r.path, meta))
        return VerifyReport(path=r.path, format=r.format, tensors=len(meta.tensors), chunks=chunks,
                            chunks_with_checksums=with_sums, bytes_verified=verified,
                            seconds=time.perf_counter() - t0, problems=tuple(problems),
                            values=len(meta.values), values_with_checksums=value_sums)


def _open(path: str | os.PathLike[str], format: str | None) -> tuple[CheckpointReader | None, list[str], str]:
    """(reader, names of the missing data files, format). A native checkpoint with missing
    files is opened without them, so that the rest is still checked; for another format
    the reader is None."""
    try:
        r = open_checkpoint(path, format=format)
        return r, [], r.format
    except MissingFileError as e:
        if not e.offenders:
            raise
        root = real_root(path)  # a local path resolved, or an s3:// root as it is
        fmt = format or detect_format(root)
        if fmt != "native":
            return None, list(e.offenders), fmt
        return CheckpointReader(root, load_native(root)), list(e.offenders), fmt


def _strays(root: str, meta: CheckpointMetadata) -> list[str]:
    storage = storage_at(root)
    if storage.local:
        return stray_files(root, meta)
    return stray_among(storage.names(), meta, legacy=False)  # a listing alone: no legacy names


def _missing_lines(meta: CheckpointMetadata, missing: list[str]) -> list[str]:
    lines = []
    for n in missing:
        names = sorted({t for t, tm in meta.tensors.items() for c in tm.chunks if c.file == n}
                       | {v for v, vm in meta.values.items() if vm.file == n})
        lines.append(f"missing file {n!r}: named by the metadata for {len(names)} entr{'y' if len(names) == 1 else 'ies'}"
                     f" ({summarise([repr(x) for x in names], limit=5)}), not in the directory; copy it or re-save")
    return lines


def _verify_values(r: CheckpointReader, problems: list[str], missing: list[str]) -> int:
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
