"""A checkpoint root named by a string, as the format readers hold it: each call finds the
root's ``Storage`` and asks it (nothing here touches a file or an object itself).

``storage_type(path)`` is the one place that tells the backends apart; it reads no file and
makes no request, so callers may ask its capabilities (``local``) before anything is opened.
``storage_at(root)`` takes a root already normalised by ``real_root``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._object import ObjectStorage
from ._posix import PosixStorage, atomic_write
from ._protocol import Storage
from ._uri import is_uri


def storage_type(path: Any) -> type[PosixStorage] | type[ObjectStorage]:
    """The backend class that serves ``path`` (a str, a PathLike, or None: a directory)."""
    return ObjectStorage if is_uri(path) else PosixStorage


def storage_at(root: str) -> Storage:
    """The storage of a normalised root (``real_root``): no system call for a directory; an
    object store's client is shared (``_object._client``)."""
    return ObjectStorage(root) if is_uri(root) else PosixStorage.resolved(root)


def open_regular(root: str, name: str, *, key: str | None = None) -> int | Any:
    """A file to read with ``pread_into`` / ``pread_runs`` (``Storage.handle``)."""
    return storage_at(root).handle(name, key=key)


def read_regular(root: str, name: str, *, limit: int, key: str | None = None) -> bytes:
    return storage_at(root).read_small(name, limit=limit, key=key)


def check_files(root: str, names: Iterable[tuple[str, str | None]]) -> None:
    storage_at(root).check_files(names)


def listdir(root: str) -> set[str]:
    """The names at the top level of a checkpoint root (one listing)."""
    return storage_at(root).names()


def lexists(root: str, name: str) -> bool:
    return storage_at(root).exists(name)


def file_size(root: str, name: str, *, key: str | None = None) -> int:
    return storage_at(root).size(name, key=key)


def in_parallel(root: str, fn: Callable[[str], Any], names: Sequence[str]) -> list[Any]:
    """``[fn(n) for n in names]``, on threads where the root's calls are requests
    (``Storage.map``); the first failure in ``names`` order is raised, as the loop would."""
    return storage_at(root).map(fn, names)


def write_atomic(path: str | os.PathLike[str], chunks: Sequence[Any]) -> int:
    """Write the buffers ``chunks`` as the file or object at ``path`` (its parent must exist
    for a file), whole or not at all. Returns the bytes written."""
    path = os.fspath(path)
    if storage_type(path) is ObjectStorage:
        root, _, name = path.rpartition("/")
        return ObjectStorage(root).put(name, chunks)
    return atomic_write(path, chunks)
