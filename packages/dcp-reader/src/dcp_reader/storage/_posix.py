"""The POSIX backend: a checkpoint directory, every access kept inside it (``_paths``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from ._files import file_size
from ._paths import check_files, check_name, open_regular, read_regular
from ._pread import pread_into
from ._scatter import pread_runs


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

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.realpath(os.fspath(root))

    def __repr__(self) -> str:
        return f"PosixStorage({self.root!r})"

    def list(self) -> dict[str, int]:
        out = {}
        for d, _, files in os.walk(self.root):
            for f in files:
                full = os.path.join(d, f)
                if os.path.isfile(full) and not os.path.islink(full):
                    out[os.path.relpath(full, self.root).replace(os.sep, "/")] = os.path.getsize(full)
        return out

    def exists(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.root, check_name(name, root=self.root)))

    def size(self, name: str, *, key: str | None = None) -> int:
        return file_size(self.root, name, key=key)

    def open(self, name: str, *, key: str | None = None) -> PosixFile:
        return PosixFile(self.root, name, key)

    def read_small(self, name: str, *, limit: int, key: str | None = None) -> bytes:
        return read_regular(self.root, name, limit=limit, key=key)

    def check_files(self, names: Iterable[tuple[str, str | None]]) -> None:
        check_files(self.root, names)

    def put(self, name: str, chunks: Sequence[Any]) -> int:
        """tmp + fsync + rename: the file appears whole or not at all."""
        from ..write._writer import _atomic_write

        final = os.path.join(self.root, check_name(name, root=self.root))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        return _atomic_write(final, list(chunks))

    def delete(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, check_name(name, root=self.root)))
        except FileNotFoundError:
            pass
