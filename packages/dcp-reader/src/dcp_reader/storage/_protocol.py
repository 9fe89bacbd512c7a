"""The storage seam: what a checkpoint needs of the place its bytes live.

Two backends implement it: ``PosixStorage`` (a directory; today's checks: regular files
only, no symlink out of the directory) and ``ObjectStorage`` (a bucket prefix such as
``s3://bucket/ckpt`` through obstore). The format readers see only these calls; the
planner's reads are already byte ranges, so nothing above the seam changes per backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StorageFile(Protocol):
    """One open file or object: its size, taken once at open, and ranged reads into the
    caller's buffers. Used by one thread at a time; ``close`` ends it."""

    path: str  #: what errors name: the file's path or the object's URI
    size: int

    def read_into(self, buf: Any, offset: int, *, key: str | None) -> None:
        """Fill the writable buffer ``buf`` with the bytes from ``offset``; TruncatedFileError
        naming ``path`` and ``key`` when the file ends first."""

    def read_runs(self, out: Any, base: int, offsets: Iterable[int], run: int, *, key: str | None) -> None:
        """Fill ``out`` with the ``run`` bytes at ``base + o`` for each ``o`` of ``offsets``
        (ascending), one after the other."""

    def close(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """A checkpoint's root (a directory or an object prefix) and the files under it, named
    by relative posix names that never leave the root (``check_name``).

    Call order, reading: ``list`` (or ``exists``) to find the format, ``read_small`` for the
    metadata or index, ``check_files`` once for every file the metadata names, then any
    number of ``open`` and reads of the returned files, from one thread per file. Only one
    rank of a multi-rank load runs the first three steps; the others receive the metadata
    (dcp-load's plan exchange) and only ``open`` and read.

    Call order, writing: ``delete`` of an old metadata file first, then ``put`` of every
    data file (one per writing rank, in parallel; large ones go up as multipart uploads,
    which either complete whole or leave no object), then, after every rank finished,
    ``put`` of the metadata file last: an interrupted save leaves no metadata.
    """

    root: str  #: the normalised root: a real directory path or ``scheme://bucket/prefix``

    def list(self) -> dict[str, int]:
        """{relative name: size} of every file under the root (recursively)."""

    def exists(self, name: str) -> bool: ...

    def size(self, name: str, *, key: str | None = None) -> int:
        """MissingFileError naming the file when it does not exist."""

    def open(self, name: str, *, key: str | None = None) -> StorageFile: ...

    def read_small(self, name: str, *, limit: int, key: str | None = None) -> bytes:
        """The whole content of a metadata or index file, refused when over ``limit`` bytes."""

    def check_files(self, names: Iterable[tuple[str, str | None]]) -> None:
        """Every (name, key) exists and is a plain file, collecting every offender."""

    def put(self, name: str, chunks: Sequence[Any]) -> int:
        """Write the concatenation of the buffers ``chunks`` as ``name``, atomically
        (whole or not at all). Returns the bytes written."""

    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""
