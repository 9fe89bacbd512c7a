"""verify_checkpoint: check a whole checkpoint without loading it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ._errors import CheckpointError
from ._reader import CheckpointReader, open_checkpoint
from ._value_sums import check_bytes, check_value
from .storage._paths import METADATA_LIMIT, read_regular


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

    Returns a VerifyReport listing one line per problem; raises CheckpointError only when
    the checkpoint cannot be opened at all (no or unreadable metadata)."""
    t0 = time.perf_counter()
    problems: list[str] = []
    chunks = with_sums = verified = 0
    with open_checkpoint(path, format=format) as r:
        meta = r.metadata
        for name, t in meta.tensors.items():
            for c in t.chunks:
                chunks += 1
                if r.format == "torch-dcp":
                    continue  # byte ranges were checked against file sizes when opening
                try:
                    f, sums = r._safetensors(name, t.dtype, c)
                    if sums is not None:
                        with_sums += 1
                        verified += f.verify_entry(c.key, sums, name=name, worker=r._hasher)
                except CheckpointError as e:
                    problems.append(str(e))
        value_sums = _verify_values(r, problems)
        return VerifyReport(path=r.path, format=r.format, tensors=len(meta.tensors), chunks=chunks,
                            chunks_with_checksums=with_sums, bytes_verified=verified,
                            seconds=time.perf_counter() - t0, problems=tuple(problems),
                            values=len(meta.values), values_with_checksums=value_sums)


def _verify_values(r: CheckpointReader, problems: list[str]) -> int:
    """Check every value that has a checksum (each file read once); returns their count."""
    raws: dict[str, bytes | CheckpointError] = {}
    n = 0
    for name, v in r.metadata.values.items():
        if v.checksum is None:
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
