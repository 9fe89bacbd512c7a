"""Keeping every file access inside the checkpoint directory."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable

from ._errors import MissingFileError, UnsafePathError, summarise


def _lexical_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "not a non-empty str"
    if "\x00" in name or "\\" in name:
        return "contains a NUL or a backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is absolute"
    if ".." in name.split("/"):
        return "contains '..'"
    return None


def check_name(name: str, *, root: str, key: str | None = None) -> str:
    """Validate one relative posix file name from a checkpoint (no I/O)."""
    problem = _lexical_problem(name)
    if problem:
        raise UnsafePathError(f"file name {name!r} (for {key!r}) {problem}: it would escape the "
                              "checkpoint directory; refusing to read it. The checkpoint was "
                              "tampered with or written by a broken tool", path=root, key=key)
    return posixpath.normpath(name)


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


def check_files(root_real: str, names: Iterable[tuple[str, str | None]]) -> None:
    """Check many (file name, key) pairs at once, collecting every offender: unsafe names
    (UnsafePathError), then missing files (MissingFileError), then symlinks out. Costs one
    directory listing per directory, not a stat per file."""
    by_name: dict[str, str | None] = {}
    for name, key in names:
        by_name.setdefault(name, key)
    unsafe = [f"{n!r} (for {k!r}): {p}" for n, k in by_name.items() if (p := _lexical_problem(n))]
    if unsafe:
        first = next(n for n in by_name if _lexical_problem(n))
        raise UnsafePathError(f"{len(unsafe)} file name(s) would escape the checkpoint directory: "
                              f"{summarise(unsafe)}; refusing to read them. The checkpoint was tampered "
                              "with or written by a broken tool", path=root_real, key=by_name[first],
                              offenders=[str(n) for n in by_name if _lexical_problem(n)])
    by_dir: dict[str, list[str]] = {}
    for n in by_name:
        n = posixpath.normpath(n)
        by_dir.setdefault(posixpath.dirname(n), []).append(n)
    missing: list[str] = []
    links: list[str] = []
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
            elif e.is_symlink() or d:  # a directory on the way may itself be a link
                links.append(n)
    if missing:
        raise MissingFileError(f"{len(missing)} data file(s) named in the metadata do not exist: "
                               f"{summarise(missing)}. The checkpoint is incomplete (copy interrupted, "
                               "or a rank's files lost); copy the missing files or re-save",
                               path=root_real, key=by_name.get(missing[0]), offenders=missing)
    outside = []
    for n in links:
        try:
            resolve(root_real, n, key=by_name.get(n))
        except UnsafePathError as e:
            outside.append(e)
    if outside:
        raise UnsafePathError(f"{len(outside)} file(s) resolve outside the checkpoint directory: "
                              f"{summarise([e.message for e in outside])}", path=root_real,
                              key=outside[0].key, offenders=[e.path or "" for e in outside])
