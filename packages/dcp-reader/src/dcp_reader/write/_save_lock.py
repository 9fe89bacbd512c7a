"""One writer per checkpoint directory: an exclusive ``flock`` on ``.dcp-save.lock``.

The lock is taken by the one process that commits (rank 0 of a save) before anything is
written, and released after the commit. The kernel drops it when its holder dies, so a
killed save never leaves the directory locked (its file stays, unlocked, until the next
save). While held, it records who holds it (pid, host, start time and whatever the caller
adds), so that a refused writer can name the holder. ``release`` removes the file while still
holding the lock, so a finished checkpoint holds nothing that reads as a held lock; a writer
that locked the file just as it was removed finds its path gone or another file there, and
opens again. A writer with a note (``WriterLock(path, note)``) that committed leaves its
record in ``.dcp-last-save.json`` instead, for the next writer to see who committed last
(``WriterLock.previous``; a refused or failed save does not count).

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

import contextlib
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

#: The last committed writer's record (``WriterLock.previous``), kept when its note is not empty.
LAST_SAVE_FILE = ".dcp-last-save.json"

__all__ = ["WriterLock", "WriterLockError"]

logger = logging.getLogger(__name__)

# flock errors that mean "no locking here" (some network and FUSE filesystems), not "held"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_RECORD_LIMIT = 64 * 1024  # a record is ~200 bytes; more is not ours and is not read
_REOPENS = 100  # opens of a lock file removed under this writer before it gives up


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
        self._locked = False  # flock held (False on a filesystem without locks)

    def acquire(self) -> WriterLock:
        import fcntl

        for _ in range(_REOPENS):
            with _HELD_LOCK:  # opened and locked while no fork can copy the descriptor unseen
                fd = self._open()
                try:
                    self._locked = self._flock(fcntl, fd)
                    if self._locked and not self._still_named(fd):
                        os.close(fd)  # locked a file its last holder removed on release: open again
                        continue
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
                _HELD.add(self)
            break
        else:
            raise WriterLockError(f"{self.path}: the lock file {LOCK_FILE} was replaced {_REOPENS} times while "
                                  "this save took it: other saves keep starting here", path=self.path)
        try:
            self.previous = self._last_commit(fd)
            self._write({})
        except BaseException:
            self.release()  # closing drops the lock
            raise
        return self

    def _flock(self, fcntl: Any, fd: int) -> bool:
        """Lock ``fd`` without waiting: True when locked, False on a filesystem without locks;
        ``WriterLockError`` naming the holder when another process holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in _NO_LOCKS:  # the filesystem has no locks: saving must still work
                logger.warning("%s: this filesystem does not support file locks (%s); saving without the "
                               "single-writer lock: make sure no other process saves here meanwhile", self.path, e)
                return False
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise
            self._refuse(fd)
            raise  # not reached: _refuse raises

    def _still_named(self, fd: int) -> bool:
        """Whether the lock file's path still names the file ``fd`` locked."""
        try:
            st, mine = os.stat(self.file, follow_symlinks=False), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _last_commit(self, fd: int) -> dict[str, Any] | None:
        """The last committed writer's record: from ``LAST_SAVE_FILE``, or from a lock file
        an earlier version left (it kept the record there)."""
        try:
            with open(os.path.join(self.path, LAST_SAVE_FILE), "rb") as f:
                doc = _decode(f.read(_RECORD_LIMIT))
        except (OSError, ValueError):
            doc = (_read_record(fd) or {}).get("last_commit")
        return doc if isinstance(doc, dict) else None

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
        ``previous`` shows), when it has a note; call after the commit, holding the lock."""
        if self._fd < 0 or self._readonly:
            return
        target = os.path.join(self.path, LAST_SAVE_FILE)
        if not self.note:  # an earlier writer's record would now name the wrong one
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            return
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started, **self.note}
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(_encode(record))
        os.replace(tmp, target)

    def release(self) -> None:
        """Drop the lock (idempotent), removing its file first (module docstring)."""
        with _HELD_LOCK:
            fd, self._fd = self._fd, -1
            _HELD.discard(self)
        if fd < 0:
            return
        if self._locked and not self._readonly and self._still_named(fd):
            try:
                os.unlink(self.file)
            except OSError as e:  # the save is done; a lock file left only looks stale
                logger.debug("%s: could not remove %s: %s", self.path, LOCK_FILE, e)
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
