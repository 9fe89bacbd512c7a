"""Operations on a checkpoint root or an open file, for either backend: what the format
readers call where they once called ``os`` directly. An open file is a descriptor (POSIX,
read with ``preadv``) or an ``ObjectFile``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import MissingFileError
from ._paths import object_storage, resolve
from ._pread import pread_into
from ._uri import is_uri


def fd_size(fd: int | Any) -> int:
    return os.fstat(fd).st_size if isinstance(fd, int) else fd.size


def close_fd(fd: int | Any) -> None:
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


def pread_bytes(fd: int | Any, n: int, offset: int, *, path: str, key: str | None = None) -> bytes:
    """``n`` bytes at ``offset`` (fewer when the file ends first, as ``os.pread``)."""
    if isinstance(fd, int):
        return os.pread(fd, n, offset)
    n = max(0, min(n, fd.size - offset))
    buf = bytearray(n)
    pread_into(fd, buf, offset, path=path, key=key)
    return bytes(buf)


def in_parallel(root: str, fn: Callable[[str], Any], names: Sequence[str]) -> list[Any]:
    """``[fn(n) for n in names]``; for an object store on up to 16 threads (each call waits on
    round trips of 20-50 ms, which a loop would pay one after the other). The first failure
    in ``names`` order is raised, as the loop would."""
    if not is_uri(root) or len(names) < 2:
        return [fn(n) for n in names]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(16, len(names)), thread_name_prefix="dcp-open") as pool:
        futures = [pool.submit(fn, n) for n in names]
        return [f.result() for f in futures]


def listdir(root: str) -> set[str]:
    """The names at the top level of a checkpoint root (one listing)."""
    if is_uri(root):
        return object_storage(root).names()
    return set(os.listdir(root))


def lexists(root: str, name: str) -> bool:
    """Whether ``name`` exists under the root (a dangling link counts: it is reported later)."""
    if is_uri(root):
        return object_storage(root).exists(name)
    return os.path.lexists(os.path.join(root, name))


def file_size(root: str, name: str, *, key: str | None = None) -> int:
    if is_uri(root):
        return object_storage(root).size(name, key=key)
    try:
        return os.stat(resolve(root, name, key=key)).st_size
    except FileNotFoundError:
        raise MissingFileError(f"file {name!r} (for {key!r}) does not exist", path=os.path.join(root, name),
                               key=key) from None


__all__ = ["close_fd", "fd_size", "file_size", "lexists", "listdir", "pread_bytes"]
