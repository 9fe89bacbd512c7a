"""verify_checkpoint: check a whole checkpoint without loading it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ._errors import CheckpointError
from ._reader import open_checkpoint


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

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike[str], *, format: str | None = None) -> VerifyReport:
    """Check a checkpoint: its metadata and structure (file names, regular files inside the
    directory, coverage of every tensor by its chunks: what ``open_checkpoint`` checks),
    every data file's header against its size and against the metadata (shape, dtype,
    key), torch DCP byte ranges against file sizes, and every block of every chunk that
    has checksums (native format), reading each file once in 64 MiB windows.

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
        return VerifyReport(path=r.path, format=r.format, tensors=len(meta.tensors), chunks=chunks,
                            chunks_with_checksums=with_sums, bytes_verified=verified,
                            seconds=time.perf_counter() - t0, problems=tuple(problems))
