"""Where a conversion lands: the source and destination resolved, the destination locked
against a second conversion, and the finished directory put in its place in one rename.

The destination is checked at the start (a non-empty one is refused unless ``overwrite``)
and again by the final placement itself: ``rename(tmp, dst)`` replaces a missing or empty
directory and fails on a non-empty one, atomically, so a file created in DST while the
conversion ran is never deleted. With ``overwrite`` a non-empty DST is swapped with the
finished directory in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so DST is the old
checkpoint or the new one at every instant; where the kernel or filesystem lacks it, the
old DST is moved aside first (for that instant DST is absent; the old one is at
``.DST.dcp-convert-old-XXXXXXXX``).

Two conversions into one DST: each takes an exclusive ``flock`` on ``.DST.dcp-convert.lock``
beside DST for its whole run; the second is refused at once with ``WriterLockError`` naming
the holder. The kernel drops the lock when its holder dies, so a killed run leaves no stale
lock.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from typing import Any

__all__ = ["DestinationLock", "fsync_dir", "new_temporary", "place", "resolve_paths", "write_json"]

logger = logging.getLogger(__name__)

#: renameat2 flag: swap the two paths atomically (linux/fs.h).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def resolve_paths(src: Any, dst: Any, overwrite: bool) -> tuple[str, str]:
    """(the source's root as ``dcp_reader.storage`` normalises it, DST as an absolute local
    path), refusing at once a DST in object storage, inside or holding the source, not a
    directory, non-empty without ``overwrite``, or whose parent does not exist."""
    from dcp_reader.storage import PosixStorage, open_storage

    src_storage = open_storage(os.fspath(src))
    try:
        dst_local = isinstance(open_storage(os.fspath(dst)), PosixStorage)
    except Exception:  # noqa: BLE001 - an object store's URI that cannot even be opened: refused alike
        dst_local = False
    if not dst_local:
        raise ValueError(f"dst {os.fspath(dst)!r} is not a local directory: convert writes its output files "
                         "preallocated and mapped in place, which object storage cannot do. Convert into a "
                         "local directory, then upload it (for example aws s3 cp --recursive); the source may "
                         "be s3://")
    src_real = src_storage.root if isinstance(src_storage, PosixStorage) else None
    return src_storage.root, _check_dst(src_real, os.fspath(dst), overwrite)


def _check_dst(src_real: str | None, dst: str, overwrite: bool) -> str:
    dst_abs = os.path.abspath(dst)
    real = os.path.realpath(dst_abs)
    if src_real is not None and (real == src_real or real.startswith(src_real + os.sep)
                                 or src_real.startswith(real + os.sep)):
        raise ValueError(f"dst {dst!r} is the source {src_real!r}, inside it or holds it; convert into "
                         "another directory")
    if os.path.lexists(dst_abs) and not os.path.isdir(dst_abs):
        raise FileExistsError(f"dst {dst!r} exists and is not a directory; remove it or choose another path")
    if os.path.isdir(dst_abs) and os.listdir(dst_abs) and not overwrite:
        raise FileExistsError(f"dst {dst!r} exists and is not empty ({len(os.listdir(dst_abs))} entries); it is "
                              "left untouched. Choose another path, or pass overwrite=True (--overwrite) to "
                              "replace it once the conversion has finished")
    parent = os.path.dirname(dst_abs) or "."
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of dst {dst!r} does not exist: create {parent!r} first")
    return dst_abs


#: Longest name a file system takes for one path component (ext4, xfs, btrfs: 255 bytes).
_NAME_MAX = 255


def _beside(dst: str, what: str) -> str:
    """``.<dst's name>.<what>`` in dst's parent; a name too long for that (a valid DST of
    up to 255 bytes gains the prefix and suffix) keeps its start and a hash of the whole."""
    base = os.path.basename(dst)
    name = f".{base}.{what}"
    if len(os.fsencode(name)) > _NAME_MAX:
        digest = hashlib.sha1(os.fsencode(base)).hexdigest()[:16]
        name = f".{base[:80]}-{digest}.{what}"
    return os.path.join(os.path.dirname(dst), name)


def new_temporary(dst: str) -> str:
    """A new directory beside ``dst`` that becomes it (same filesystem: renames are atomic)."""
    tmp = _beside(dst, f"dcp-convert-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    return tmp


class DestinationLock:
    """The exclusive lock of one destination for a whole conversion (module docstring)."""

    def __init__(self, dst: str):
        self.dst, self.path, self.fd = dst, _beside(dst, "dcp-convert.lock"), -1

    def __enter__(self) -> DestinationLock:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._refuse(fd)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                logger.warning("%s: this filesystem has no file locks; a second conversion into %s would not be "
                               "refused", self.path, self.dst)
                return self
            if _same_file(fd, self.path):  # not a file the last holder unlinked as it left
                break
            os.close(fd)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self.fd = fd
        return self

    def _refuse(self, fd: int) -> None:
        from dcp_reader import WriterLockError

        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            holder = {}
        finally:
            os.close(fd)
        who = f"pid {holder.get('pid')} on host {holder.get('host')!r}" if holder else "another process"
        raise WriterLockError(f"dst {self.dst!r} is being written by another conversion ({who}, lock "
                              f"{self.path}); wait for it to finish, or convert into another directory",
                              path=self.dst, holder=holder if isinstance(holder, dict) else {})

    def __exit__(self, *exc: Any) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)  # while held: a process that opened it before retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def place(tmp: str, dst: str, overwrite: bool) -> None:
    """Make the finished directory ``tmp`` be ``dst`` (module docstring); FileExistsError
    when DST became non-empty (or not a directory) without ``overwrite``."""
    try:
        os.rename(tmp, dst)  # replaces a missing or empty directory only, atomically
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        if not overwrite or not os.path.isdir(dst) or os.path.islink(dst):
            entries = os.listdir(dst) if os.path.isdir(dst) else []
            raise FileExistsError(
                f"dst {dst!r} " + (f"became non-empty during the conversion ({len(entries)} entries, e.g. "
                                   f"{', '.join(repr(e) for e in sorted(entries)[:3])})" if entries else
                                   "is no longer a directory") +
                "; it is left untouched and this conversion is discarded. Convert into another path, or pass "
                "overwrite=True (--overwrite) to replace it") from None
        _replace(tmp, dst)
    fsync_dir(os.path.dirname(dst) or ".")


def _replace(tmp: str, dst: str) -> None:
    """Swap ``tmp`` and ``dst`` in one step where the kernel can, then remove the old one."""
    if _exchange(tmp, dst):
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint, now under the temporary name
        return
    old = _beside(dst, f"dcp-convert-old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False where it is not available."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a no-op where directories cannot be
    opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory: nothing more can be done
    finally:
        os.close(fd)


def write_json(path: str, doc: Any) -> int:
    """``doc`` as indented JSON at ``path``, whole or not at all (a temporary name, fsync,
    rename). Returns the bytes written."""
    raw = json.dumps(doc, indent=2).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
    return len(raw)
