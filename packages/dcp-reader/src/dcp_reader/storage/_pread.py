"""Reading file bytes into memory the reader owns, with ``preadv``: a file truncated while it
is being read gives a short read, reported as TruncatedFileError, where a memory map of it
would kill the process with SIGBUS."""

from __future__ import annotations

import os
from typing import Any

from .._errors import CheckpointError, TruncatedFileError

_MAX_CALL = 1 << 30  # bytes per preadv call: Linux transfers at most ~2 GiB per call anyway


def pread_into(fd: int | Any, buf: Any, offset: int, *, path: str, key: str | None) -> None:
    """Fill the writable buffer ``buf`` with the file's bytes from ``offset``; TruncatedFileError
    naming ``path`` and ``key`` when the file ends first. ``fd``: a descriptor, or an open
    object (``ObjectFile``), which reads through its store."""
    if not isinstance(fd, int):
        fd.read_into(buf, offset, key=key)
        return
    view = memoryview(buf).cast("B")
    done, total = 0, len(view)
    while done < total:
        part = view[done:done + _MAX_CALL]
        try:
            if hasattr(os, "preadv"):
                n = os.preadv(fd, [part], offset + done)
            else:  # no preadv (macOS < 11): one extra copy
                data = os.pread(fd, len(part), offset + done)
                n = len(data)
                part[:n] = data
        except OSError as e:  # EIO from failing storage, EBADF after close, ...
            raise CheckpointError(f"reading bytes [{offset}, {offset + total}) of {key!r} failed: {e}",
                                  path=path, key=key) from None
        if n == 0:
            raise TruncatedFileError(
                f"the file ended after byte {offset + done} while reading bytes [{offset}, {offset + total}) "
                f"of {key!r}; it is truncated (or was truncated during the load): re-copy or re-save it",
                path=path, key=key)
        done += n


# An open file as the format readers hold it: a descriptor (a directory's file, read with
# ``preadv``) or a ``StorageFile`` (an object), as ``Storage.handle`` returns it.

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
