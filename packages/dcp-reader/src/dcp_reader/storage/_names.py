"""File names inside a checkpoint root, checked the same way by every backend (no I/O)."""

from __future__ import annotations

import posixpath

from .._errors import UnsafePathError

# A larger metadata or index file is refused before it is read: ~200 bytes per chunk in
# either metadata format, so this holds ~2.5 million chunks (10,000 tensors saved by 250 ranks).
METADATA_LIMIT = 512 * 1024 * 1024


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a relative posix name that stays inside the root; None when it is."""
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
    problem = name_problem(name)
    if problem:
        raise UnsafePathError(f"file name {name!r} (for {key!r}) {problem}: it would escape the "
                              "checkpoint directory; refusing to read it. The checkpoint was "
                              "tampered with or written by a broken tool", path=root, key=key)
    return posixpath.normpath(name)
