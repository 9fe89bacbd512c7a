"""The storage seam: what a checkpoint needs of the place its bytes live.

Two backends implement it: ``PosixStorage`` (a directory; today's checks: regular files
only, no symlink out of the directory) and ``ObjectStorage`` (a bucket prefix such as
``s3://bucket/ckpt`` through obstore). The format readers see only these calls; the
planner's reads are already byte ranges, so nothing above the seam changes per backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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

    Nothing outside ``dcp_reader.storage`` asks whether a location is a path or a URI: it
    takes the storage (``open_storage``; ``_roots.storage_type`` for the class alone, which
    reads nothing) and asks it. What differs between backends is one capability, ``local``,
    and the cost of each call: on a directory every call is a system call (microseconds);
    on an object store every call but ``path`` is one or more requests (20-50 ms each,
    retried up to ``DCP_STORAGE_TOTAL_TIMEOUT``), and ``list`` pages through the prefix.

    Call order, reading: ``names`` (or ``exists``) to find the format, ``read_small`` for the
    metadata or index, ``check_files`` once for every file the metadata names, then any
    number of ``open`` (or ``handle``) and reads of the returned files, from one thread per
    file; ``map`` runs many opens at once where they are requests. Only one rank of a
    multi-rank load runs the first three steps when the storage is not ``local``; the others
    receive the metadata (dcp-load's plan exchange) and only open and read.

    Call order, writing: ``create`` (the class method) once, ``delete`` of an old metadata
    file first when files are rewritten under their names, then ``put`` of every data file
    (one per writing rank, in parallel; large ones go up as multipart uploads, which either
    complete whole or leave no object), then, after every rank finished, ``put`` of the
    metadata file last: an interrupted save leaves no metadata. ``sync`` makes removals
    durable. A single-writer lock exists only where ``local`` (``flock``).
    """

    root: str  #: the normalised root: a real directory path or ``scheme://bucket/prefix``
    #: True: a directory of this host (its page cache is shared by the host's processes,
    #: renames are atomic, ``flock`` works, listing is cheap). False: an object store.
    local: bool

    def path(self, name: str) -> str:
        """What errors name for ``name``: its path or its URI (no I/O)."""

    def list(self) -> dict[str, int]:
        """{relative name: size} of every file under the root (recursively)."""

    def names(self) -> set[str]:
        """The names at the top level of the root (one listing)."""

    def exists(self, name: str) -> bool: ...

    def size(self, name: str, *, key: str | None = None) -> int:
        """MissingFileError naming the file when it does not exist."""

    def open(self, name: str, *, key: str | None = None) -> StorageFile: ...

    def handle(self, name: str, *, key: str | None = None) -> int | StorageFile:
        """The file opened for the format readers' ``pread_into`` / ``pread_runs``: a
        descriptor for a directory's file (read with ``preadv``, no wrapper per read), else
        the ``StorageFile``; closed with ``_pread.close_fd``."""

    def read_small(self, name: str, *, limit: int, key: str | None = None) -> bytes:
        """The whole content of a metadata or index file, refused when over ``limit`` bytes."""

    def check_files(self, names: Iterable[tuple[str, str | None]]) -> None:
        """Every (name, key) exists and is a plain file, collecting every offender."""

    def map(self, fn: Callable[[str], Any], names: Sequence[str]) -> list[Any]:
        """``[fn(n) for n in names]``, on threads where calls are requests; the first failure
        in ``names`` order is raised."""

    def put(self, name: str, chunks: Sequence[Any]) -> int:
        """Write the concatenation of the buffers ``chunks`` as ``name``, atomically
        (whole or not at all). Returns the bytes written."""

    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""

    def sync(self, *, parent: bool = False) -> None:
        """Make earlier removals durable (a directory: fsync; an object store: nothing);
        ``parent``: the root's own entry instead (a directory: its parent synced)."""
