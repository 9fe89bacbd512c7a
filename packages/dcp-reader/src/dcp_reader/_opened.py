"""The metadata of the checkpoints opened last, reused while their files are unchanged.

A job that loads a small checkpoint again and again (evaluation, tests, a few tensors at a
time) parsed its metadata on every ``open_checkpoint``: in each benchmarks/load/bench_tp.py case
on 2 gloo ranks, opening took 0.30-0.49 ms per rank and load for one safetensors file and
0.50-0.79 ms for torch DCP's pickle, 0.12-0.15 ms with the metadata reused (medians of 30
loads, measured alternately; 0.13 and 0.26 ms against 0.03 and 0.04 ms on an idle core).

An entry holds the metadata with a signature of the directory as it was when parsed: the
names at its top, and for the directory itself, each entry at its top and each file the
metadata names, ``(device, inode, mode, size, mtime_ns, ctime_ns)``. A regular file is
opened to take them (``fstat``): NFS revalidates a file's attributes when it is opened, as
the parse itself opened the files it read. The entry is reused only while the signature
taken again is equal: a file rewritten, replaced, truncated, renamed, added or removed
makes it parse again. An entry is kept only when every time in its signature is at least
``SETTLED_S`` old: a file changed within the file system's timestamp granularity of the
parse could change again without any of them moving (git's rule for "racy" index entries);
a change during the parse moves its change time to about now, so that entry is never kept.
Object stores are not cached (their listing is a request).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from ._model import CheckpointMetadata
from .storage._roots import storage_type

__all__ = ["SETTLED_S", "forget", "opened"]

#: How old every time in a signature must be for the entry to be kept: above the timestamp
#: granularity of common file systems (ext4 and XFS: a clock tick; FAT: 2 s).
SETTLED_S = 2.0
#: Entries kept (least recently used dropped first).
ENTRIES = 4
#: Metadata with more chunks and values than this is not kept (about 500 bytes each): a
#: large checkpoint's load lasts seconds, where parsing again is a small part.
MAX_ITEMS = 16384

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)

_lock = threading.Lock()
_entries: OrderedDict[Hashable, tuple[tuple[Any, ...], list[str], str, CheckpointMetadata]] = OrderedDict()


def opened(root: str, key: Hashable, parse: Callable[[], tuple[str, CheckpointMetadata]]
           ) -> tuple[str, CheckpointMetadata]:
    """``parse()``'s (format, metadata) of the checkpoint at ``root`` (a ``real_root``), or
    those of an earlier call with the same ``root`` and ``key`` while its files are unchanged."""
    if not storage_type(root).local:
        return parse()
    with _lock:
        entry = _entries.get((root, key))
    if entry is not None and _signature(root, entry[1])[0] == entry[0]:
        with _lock:
            if (root, key) in _entries:
                _entries.move_to_end((root, key))
        return entry[2], entry[3]
    fmt, meta = parse()
    _keep(root, key, fmt, meta)
    return fmt, meta


def forget() -> None:
    """Drop every entry."""
    with _lock:
        _entries.clear()


def _keep(root: str, key: Hashable, fmt: str, meta: CheckpointMetadata) -> None:
    chunks = sum(len(t.chunks) for t in meta.tensors.values()) + len(meta.values)
    if chunks > MAX_ITEMS:
        return
    named = {c.file for t in meta.tensors.values() for c in t.chunks} | {v.file for v in meta.values.values() if v.file}
    try:
        files = sorted(set(os.listdir(root)) | named)
    except OSError:
        return
    signature, newest = _signature(root, files)
    if newest > time.time() - SETTLED_S:
        return
    with _lock:
        _entries[(root, key)] = (signature, files, fmt, meta)
        _entries.move_to_end((root, key))
        while len(_entries) > ENTRIES:
            _entries.popitem(last=False)


def _signature(root: str, files: list[str]) -> tuple[tuple[Any, ...], float]:
    """(the directory's names, its identity and each file's), and the newest time among them."""
    try:
        names = frozenset(os.listdir(root))
    except OSError as exc:
        return (type(exc).__name__,), 0.0
    ids = [_identity(root)] + [_identity(os.path.join(root, f)) for f in files]
    newest = max((max(i[4], i[5]) for i in ids if len(i) == 6), default=0) / 1e9
    return (names, *ids), newest


def _identity(path: str) -> tuple[Any, ...]:
    """What changes when the file or directory at ``path`` does: an error's name when it
    cannot be taken (a missing file stays missing)."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):  # only a regular file is opened: a FIFO or a device never is
            fd = os.open(path, _OPEN_FLAGS)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        return (type(exc).__name__,)
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
