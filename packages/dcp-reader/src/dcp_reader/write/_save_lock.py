"""One writer per checkpoint directory: an exclusive ``flock`` on ``.dcp-save.lock``.

The lock is taken by the one process that commits (rank 0 of a save) before anything is
written, and released after the commit. The kernel drops it when its holder dies, so a
killed save never leaves the directory locked; the file itself stays (it is tiny, hidden,
and never read as checkpoint data). While held, it records who holds it (pid, host, start
time and whatever the caller adds), so that a refused writer can name the holder, and the
next writer can see who committed last (``WriterLock.previous``; a refused or failed
save does not count).

The record is one line of JSON, a newline and the CRC-32 of that line in 8 hex digits. It is
written over the previous one and cut to its length (truncating the file to 0 first took
0.2-4 ms of rank 0's ``async_save`` blocked time while the last save's files were written
back); a reader that meets a rewrite half done, the start of the new record over the rest of
the old one, finds the checksum wrong and reads no record, as it would read an empty file.
A record without the checksum line (dcp-reader < 0.6.1) is read as it is.

The lock belongs to the process that took it. ``flock`` locks an open file description, which
a forked child shares: a DataLoader worker started (fork is Linux's default) while an
``async_save`` writes would keep the directory locked for as long as it lives, and every
later save there was refused naming the saver's own pid. So a forked child closes its copies
of every held lock's descriptor at once (``os.register_at_fork``): the parent's ``release``
then drops the lock whatever children it forked meanwhile (a child forked an instant before
``release`` closes its copy when it first runs, microseconds later).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Mapping
from typing import Any

from ..formats._native import LOCK_FILE

__all__ = ["WriterLock", "WriterLockError"]

logger = logging.getLogger(__name__)

# flock errors that mean "no locking here" (some network and FUSE filesystems), not "held"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_RECORD_LIMIT = 64 * 1024  # a record is ~200 bytes; more is not ours and is not read


# The locks this process holds now: a forked child closes their descriptors (module docstring).
_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()
_HELD_LOCK = threading.Lock()


def _drop_in_child() -> None:
    """In a freshly forked child: close its copies of the held locks' descriptors (the
    parent's stay open and locked); the child's lock objects then hold nothing."""
    _HELD_LOCK.release()  # taken by the parent before the fork (``register_at_fork`` below)
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed by the child's own code: nothing of ours left to drop


if hasattr(os, "register_at_fork"):
    # The parent holds _HELD_LOCK across the fork, so that no lock is half taken in the child.
    os.register_at_fork(before=_HELD_LOCK.acquire, after_in_parent=_HELD_LOCK.release,
                        after_in_child=_drop_in_child)


class WriterLockError(RuntimeError):
    """Another process is writing into the checkpoint directory (``holder``: its record)."""

    def __init__(self, message: str, *, path: str, holder: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.path = path
        self.holder = dict(holder or {})


def _encode(record: Mapping[str, Any]) -> bytes:
    """The record's line of JSON, a newline and its CRC-32 (module docstring)."""
    line = json.dumps(record, default=str).encode()
    return line + b"\n" + format(zlib.crc32(line), "08x").encode()


def _decode(raw: bytes) -> Any:
    """The JSON of ``raw``; None when its checksum does not match (a rewrite half done)."""
    line, sep, crc = raw.rstrip().rpartition(b"\n")
    if not sep:  # no checksum line: a record of an earlier version
        return json.loads(raw) if raw.strip() else None
    return json.loads(line) if crc == format(zlib.crc32(line), "08x").encode() else None


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        doc = _decode(os.pread(fd, _RECORD_LIMIT, 0))
    except (OSError, ValueError):
        return None  # unreadable or foreign content: nothing is known about the last writer
    return doc if isinstance(doc, dict) else None


def _describe(record: Mapping[str, Any] | None) -> str:
    if not record:
        return "another process (it left no record)"
    started = record.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, int | float) else "an unknown time")
    return f"pid {record.get('pid')} on host {record.get('host')!r}, since {when}"


class WriterLock:
    """The exclusive write lock of one checkpoint directory; a context manager.

    ``acquire()`` refuses at once (``WriterLockError`` naming the holder) when another
    process holds it: a save never waits for another save into the same directory, since
    the second one would replace the first one's files.
    """

    def __init__(self, path: str, note: Mapping[str, Any] | None = None):
        self.path = os.path.abspath(path)
        self.file = os.path.join(self.path, LOCK_FILE)
        self.note = dict(note or {})
        self.previous: dict[str, Any] | None = None  # the record of the last writer that committed
        self._started = time.time()
        self._fd = -1
        self._readonly = False

    def acquire(self) -> WriterLock:
        import fcntl

        with _HELD_LOCK:  # opened and locked while no fork can copy the descriptor unseen
            fd = self._open()
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno in _NO_LOCKS:  # the filesystem has no locks: saving must still work
                        logger.warning("%s: this filesystem does not support file locks (%s); saving without the "
                                       "single-writer lock: make sure no other process saves here meanwhile",
                                       self.path, e)
                    elif e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                        raise
                    else:
                        self._refuse(fd)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            _HELD.add(self)
        try:
            held = _read_record(fd) or {}
            last = held.get("last_commit")
            self.previous = last if isinstance(last, dict) else None
            self._write({"last_commit": self.previous})
        except BaseException:
            self.release()  # closing drops the lock
            raise
        return self

    def _open(self) -> int:
        flags = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:  # 0o666 less the umask, like the data files: in a directory a group shares, any member saves
            return os.open(self.file, os.O_RDWR | os.O_CREAT | flags, 0o666)
        except PermissionError:
            # another user's lock file: flock needs no write access, only the record is not kept
            self._readonly = True
            return os.open(self.file, os.O_RDONLY | flags)

    def _refuse(self, fd: int) -> None:
        holder = _read_record(fd)
        raise WriterLockError(
            f"{self.path}: another save is writing into this checkpoint directory ({_describe(holder)}; "
            f"lock {LOCK_FILE}). Two writers into one directory would replace each other's files: "
            "wait for it to finish, or save into another directory", path=self.path, holder=holder)

    def _write(self, extra: Mapping[str, Any]) -> None:
        if self._readonly:
            return
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started, **self.note, **extra}
        raw = _encode(record)
        # Written over the old record, then cut to its length (module docstring).
        os.pwrite(self._fd, raw, 0)
        if os.fstat(self._fd).st_size > len(raw):
            os.ftruncate(self._fd, len(raw))

    def committed(self) -> None:
        """Record this writer as the last one that committed (what the next writer's
        ``previous`` shows); call after the commit, while holding the lock."""
        if self._fd >= 0:
            self._write({"last_commit": {"pid": os.getpid(), "host": socket.gethostname(),
                                         "started": self._started, **self.note}})

    def release(self) -> None:
        """Drop the lock (idempotent); the record stays for the next writer to read."""
        with _HELD_LOCK:
            fd, self._fd = self._fd, -1
            _HELD.discard(self)
        if fd >= 0:
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> WriterLock:
        return self if self._fd >= 0 else self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class NoLock:
    """The lock of a store that has none (an object store): takes nothing, records nothing."""

    previous: dict[str, Any] | None = None

    def committed(self) -> None:
        """Nothing to record."""

    def release(self) -> None:
        """Nothing to drop."""
