"""Keeping every access to a checkpoint directory inside it: the POSIX backend's checks
(``PosixStorage`` calls these; names are checked by ``_names``, shared with object stores)."""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable

from .._errors import MissingFileError, TruncatedFileError, UnsafePathError, summarise
from ._names import METADATA_LIMIT, check_name, name_problem

# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (a hang); on a
# regular file it changes nothing. O_NOFOLLOW: the path is already resolved, so a symlink
# in its last component means it was swapped in after the check.
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOFOLLOW", 0))


def resolve(root_real: str, name: str, *, key: str | None = None) -> str:
    """Absolute path of ``name`` inside ``root_real`` (already realpath'd), following
    symlinks only as far as they stay inside it. Called once per file open, not per read."""
    check_name(name, root=root_real, key=key)
    full = os.path.join(root_real, name)
    real = os.path.realpath(full)
    if real != root_real and not real.startswith(root_real + os.sep):
        raise UnsafePathError(f"{name!r} (for {key!r}) resolves to {real!r}, outside the checkpoint "
                              f"directory {root_real!r} (a symlink points out); refusing to read it. "
                              "Copy the file into the checkpoint instead of linking it",
                              path=full, key=key)
    return real


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _not_regular(path: str, mode: int, key: str | None) -> UnsafePathError:
    return UnsafePathError(f"{path!r} (for {key!r}) is {_kind(mode)}, not a regular file; refusing to open "
                           "it (a FIFO would hang the read, a device or directory is no checkpoint data). "
                           "Replace it with the real file", path=path, key=key)


def open_regular(root_real: str, name: str, *, key: str | None = None) -> int:
    """A read-only fd of ``name`` inside ``root_real``, refused (UnsafePathError) unless it is
    a regular file resolving inside the directory; checked with ``stat`` BEFORE opening (a
    FIFO or device is never opened) and again on the fd. MissingFileError when absent."""
    real = resolve(root_real, name, key=key)
    try:
        st = os.stat(real)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingFileError(f"file {name!r} (for {key!r}) does not exist; the checkpoint is incomplete: "
                               "copy the missing file or re-save", path=real, key=key) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(real, st.st_mode, key)
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except FileNotFoundError:
        raise MissingFileError(f"file {name!r} (for {key!r}) vanished while opening it", path=real,
                               key=key) from None
    except OSError as e:  # ELOOP: swapped for a symlink after the check; EACCES; ...
        raise UnsafePathError(f"cannot open {name!r} (for {key!r}): {e}", path=real, key=key) from None
    st2 = os.fstat(fd)
    if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise UnsafePathError(f"{name!r} (for {key!r}) changed while opening it (now {_kind(st2.st_mode)}); "
                              "refusing it", path=real, key=key)
    if hasattr(os, "posix_fadvise"):
        # Every read fetches exactly the bytes it asks for. With the kernel's readahead, the
        # small header read at a file's start left a readahead mark that the next read (of the
        # first tensor, by any descriptor) turned into ~10 MiB fetched ahead: two simulated
        # nodes reading DP2 x TP2 boxes fetched 1.50 x the unique bytes with it, 1.00 x
        # without (tests-integration/load/test_integ_read_once). Each box is one large read, or one
        # read per row where it is sparse, so readahead buys nothing here.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def read_regular(root_real: str, name: str, *, limit: int, key: str | None = None) -> bytes:
    """The whole content of a small file (metadata, index) opened with ``open_regular``;
    refused (UnsafePathError) when larger than ``limit`` bytes, so a
    corrupt or hostile file never makes the reader allocate more than that."""
    fd = open_regular(root_real, name, key=key)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafePathError(f"{name!r} is {size} bytes, more than the {limit} bytes a metadata or "
                                  "index file may have here; the file is corrupt or not a checkpoint "
                                  "file", path=os.path.join(root_real, name), key=key)
        data = os.pread(fd, size, 0) if size else b""
        if len(data) != size:
            raise TruncatedFileError(f"read {len(data)} of {name!r}'s {size} bytes (it shrank while being "
                                     "read); retry once the copy or save is finished",
                                     path=os.path.join(root_real, name), key=key)
        return data
    finally:
        os.close(fd)


def check_files(root_real: str, names: Iterable[tuple[str, str | None]]) -> None:
    """Check many (file name, key) pairs at once, collecting every offender: unsafe names
    (UnsafePathError), then missing files (MissingFileError), then symlinks out. Costs one
    directory listing per directory, not a stat per file."""
    by_name: dict[str, str | None] = {}
    for name, key in names:
        by_name.setdefault(name, key)
    _refuse_unsafe(root_real, by_name)
    missing, links, odd = _scan(root_real, by_name)
    if missing:
        raise MissingFileError(f"{len(missing)} data file(s) named in the metadata do not exist: "
                               f"{summarise(missing)}. The checkpoint is incomplete (copy interrupted, "
                               "or a rank's files lost); copy the missing files or re-save",
                               path=root_real, key=by_name.get(missing[0]), offenders=missing)
    outside = _follow_links(root_real, by_name, links, missing, odd)
    if missing:
        raise MissingFileError(f"{len(missing)} data file(s) named in the metadata do not exist (dangling "
                               f"links): {summarise(missing)}; copy the missing files or re-save",
                               path=root_real, key=by_name.get(missing[0]), offenders=missing)
    if odd:
        raise UnsafePathError(f"{len(odd)} file(s) named in the metadata are not regular files (a directory, "
                              f"FIFO or device): {summarise(odd)}; refusing to open them. Replace them with "
                              "the real data files", path=root_real, key=by_name.get(odd[0]), offenders=odd)
    if outside:
        raise UnsafePathError(f"{len(outside)} file(s) resolve outside the checkpoint directory: "
                              f"{summarise([e.message for e in outside])}", path=root_real,
                              key=outside[0].key, offenders=[e.path or "" for e in outside])


def _refuse_unsafe(root_real: str, by_name: dict[str, str | None]) -> None:
    """UnsafePathError listing every name that would leave the directory."""
    bad = [n for n in by_name if name_problem(n)]
    if bad:
        unsafe = [f"{n!r} (for {by_name[n]!r}): {name_problem(n)}" for n in bad]
        raise UnsafePathError(f"{len(unsafe)} file name(s) would escape the checkpoint directory: "
                              f"{summarise(unsafe)}; refusing to read them. The checkpoint was tampered "
                              "with or written by a broken tool", path=root_real, key=by_name[bad[0]],
                              offenders=[str(n) for n in bad])


def _scan(root_real: str, by_name: dict[str, str | None]) -> tuple[list[str], list[str], list[str]]:
    """(missing, links to follow, not regular) from one listing per directory. A file in a
    subdirectory counts as a link: a directory on the way may itself be one."""
    by_dir: dict[str, list[str]] = {}
    for n in by_name:
        n = posixpath.normpath(n)
        by_dir.setdefault(posixpath.dirname(n), []).append(n)
    missing: list[str] = []
    links: list[str] = []
    odd: list[str] = []
    for d, files in by_dir.items():
        try:
            with os.scandir(os.path.join(root_real, d)) as it:
                entries = {e.name: e for e in it}
        except (FileNotFoundError, NotADirectoryError):
            entries = {}
        for n in files:
            e = entries.get(posixpath.basename(n))
            if e is None:
                missing.append(n)
            elif e.is_symlink() or d:
                links.append(n)
            elif not e.is_file(follow_symlinks=False):
                odd.append(n)
    return missing, links, odd


def _follow_links(root_real: str, by_name: dict[str, str | None], links: list[str], missing: list[str],
                  odd: list[str]) -> list[UnsafePathError]:
    """Resolve each of ``links``: dangling ones go to ``missing``, those to a non-regular file
    to ``odd``; returns the refusals of those resolving outside the directory."""
    outside = []
    for n in links:
        try:
            real = resolve(root_real, n, key=by_name.get(n))
        except UnsafePathError as e:
            outside.append(e)
            continue
        try:
            if not stat.S_ISREG(os.stat(real).st_mode):
                odd.append(n)
        except OSError:
            missing.append(n)
    return outside


__all__ = ["METADATA_LIMIT", "check_files", "check_name", "open_regular", "read_regular", "resolve"]
