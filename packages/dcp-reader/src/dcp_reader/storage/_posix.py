"""The POSIX backend: a checkpoint directory, every access kept inside it (``_paths``)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import MissingFileError
from ._names import check_name
from ._paths import check_files, open_regular, read_regular, resolve
from ._pread import pread_into
from ._scatter import pread_runs

_COPY_BLOCK = 64 * 1024 * 1024  # bytes per write() call: bounds the transient copy, not a tuning knob


class PosixFile:
    """An open regular file inside the checkpoint directory (see ``_protocol.StorageFile``)."""

    def __init__(self, root: str, name: str, key: str | None):
        self.path = os.path.join(root, name)
        self.fd = open_regular(root, name, key=key)
        self.size = os.fstat(self.fd).st_size

    def read_into(self, buf: Any, offset: int, *, key: str | None) -> None:
        pread_into(self.fd, buf, offset, path=self.path, key=key)

    def read_runs(self, out: Any, base: int, offsets: Iterable[int], run: int, *, key: str | None) -> None:
        pread_runs(self.fd, out, base, offsets, run, path=self.path, key=key)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PosixStorage:
    """A checkpoint directory (see ``_protocol.Storage``)."""

    #: a directory of this host: its page cache is shared, renames are atomic, flock works
    local = True

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(os.fspath(root))

    @classmethod
    def resolved(cls, root_real: str) -> PosixStorage:
        """The storage of a root already resolved by ``real_root`` (no system call)."""
        self = cls.__new__(cls)
        self.root = root_real
        return self

    def __repr__(self) -> str:
        return f"PosixStorage({self.root!r})"

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def list(self) -> dict[str, int]:
        out = {}
        for d, _, files in os.walk(self.root):
            for f in files:
                full = os.path.join(d, f)
                if os.path.isfile(full) and not os.path.islink(full):
                    out[os.path.relpath(full, self.root).replace(os.sep, "/")] = os.path.getsize(full)
        return out

    def names(self) -> set[str]:
        """The entries at the top of the directory (FileNotFoundError / NotADirectoryError
        when it is none)."""
        return set(os.listdir(self.root))

    def exists(self, name: str) -> bool:
        """A dangling link counts: opening it reports it."""
        return os.path.lexists(os.path.join(self.root, check_name(name, root=self.root)))

    def size(self, name: str, *, key: str | None = None) -> int:
        try:
            return os.stat(resolve(self.root, name, key=key)).st_size
        except FileNotFoundError:
            raise MissingFileError(f"file {name!r} (for {key!r}) does not exist", path=self.path(name),
                                   key=key) from None

    def open(self, name: str, *, key: str | None = None) -> PosixFile:
        return PosixFile(self.root, name, key)

    def handle(self, name: str, *, key: str | None = None) -> int:
        """A read-only descriptor (``_paths.open_regular``): the readers' ``preadv`` fast path."""
        return open_regular(self.root, name, key=key)

    def read_small(self, name: str, *, limit: int, key: str | None = None) -> bytes:
        return read_regular(self.root, name, limit=limit, key=key)

    def check_files(self, names: Iterable[tuple[str, str | None]]) -> None:
        check_files(self.root, names)

    def map(self, fn: Callable[[str], Any], names: Sequence[str]) -> list[Any]:
        """``[fn(n) for n in names]``: local calls cost microseconds, threads would cost more."""
        return [fn(n) for n in names]

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> PosixStorage:
        """The storage of a directory to write, made (with its parents) when missing:
        NotADirectoryError saying what is there when something else has its name (a dangling
        link is refused, not followed)."""
        path = os.path.abspath(os.fspath(path))
        try:
            os.makedirs(path, exist_ok=True)
        except FileExistsError:  # "File exists" alone reads like a refusal to overwrite
            st = os.lstat(path)
            kind = ("dangling symlink" if stat.S_ISLNK(st.st_mode) else "fifo" if stat.S_ISFIFO(st.st_mode)
                    else "file" if stat.S_ISREG(st.st_mode) else "special file")
            raise NotADirectoryError(f"{path} is a {kind}, not a directory: the checkpoint_id of a save "
                                     "names the directory to write; pass another path, or move that one "
                                     "away") from None
        return cls(path)

    def put(self, name: str, chunks: Sequence[Any]) -> int:
        """tmp + fsync + rename + fsync of the directory: the file appears whole or not at all."""
        final = os.path.join(self.root, check_name(name, root=self.root))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        return atomic_write(final, list(chunks))

    def delete(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, check_name(name, root=self.root)))
        except FileNotFoundError:
            pass

    def sync(self, *, parent: bool = False) -> None:
        """Make the directory's entries (renames, removals) durable; ``parent``: its own entry
        too (a directory a save created is durable only once its parent is synced)."""
        fsync_dir(os.path.dirname(self.root) if parent else self.root)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported on this filesystem; nothing more can be done
    finally:
        os.close(fd)


def atomic_write(final: str, chunks: Sequence[Any]) -> int:
    """Write the buffers ``chunks`` as the file ``final``: tmp + fsync + rename, then the
    directory synced. Returns the bytes written."""
    tmp = f"{final}.tmp-{os.getpid()}"
    n = 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                mv = memoryview(c).cast("B")
                for i in range(0, len(mv), _COPY_BLOCK):
                    n += f.write(mv[i:i + _COPY_BLOCK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(final))
    return n


def write_unsynced(final: str, data: bytes) -> None:
    """Write ``data`` as the file ``final`` whole or not at all (tmp + rename), without
    syncing: for a file only this save reads back and removes before its commit completes."""
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
