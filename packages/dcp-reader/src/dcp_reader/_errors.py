"""Typed errors. Every error names the checkpoint file (``path``) and the entry (``key``)
it is about, gives the actual values and says how to fix the problem."""

from __future__ import annotations

import re
from collections.abc import Sequence


class CheckpointError(Exception):
    """Base of every error raised for a bad or unreadable checkpoint.

    ``path``: the file (or directory) concerned, ``key``: the tensor, value or safetensors
    key concerned (the first one when several offenders are listed), ``offenders``: every
    offending key or file found before raising.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 offenders: Sequence[str] = ()):
        self.message = message
        self.path = path
        self.key = key
        self.offenders = tuple(offenders)
        super().__init__(self._render())

    def _render(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def with_path(self, path: str) -> CheckpointError:
        """A copy of this error that names ``path`` (used where the model, which does not
        know which file it came from, raised it)."""
        if self.path is not None:
            return self
        err = type(self).__new__(type(self))
        CheckpointError.__init__(err, self.message, path=path, key=self.key, offenders=self.offenders)
        return err

    def __reduce__(self):  # picklable across ranks (run_ranks, dcp-load's error exchange)
        return (_rebuild, (type(self), self.message, self.path, self.key, self.offenders))


def _rebuild(cls: type, message: str, path: str | None, key: str | None,
             offenders: tuple[str, ...]) -> CheckpointError:
    err = cls.__new__(cls)
    CheckpointError.__init__(err, message, path=path, key=key, offenders=offenders)
    return err


class MissingMetadataError(CheckpointError):
    """The directory holds no metadata file: not a checkpoint, or an unfinished save."""


class MetadataError(CheckpointError, ValueError):
    """The metadata is invalid: bad JSON, unknown schema version, wrong field types."""


class MissingFileError(CheckpointError):
    """A file the metadata refers to does not exist."""


class MissingKeyError(CheckpointError):
    """A tensor, value or safetensors key the caller or the metadata refers to is absent."""


class TruncatedFileError(CheckpointError):
    """A data file is shorter than its header or its metadata says."""


class UnknownDtypeError(CheckpointError, ValueError):
    """A dtype this package cannot represent."""


class CoverageError(CheckpointError, ValueError):
    """A tensor's saved chunks overlap, leave gaps or lie outside its shape."""


class UnsafePathError(CheckpointError):
    """A file name escapes the checkpoint directory (``..``, absolute, symlink out)."""


class UnsafePickleError(CheckpointError):
    """A pickle would have to be loaded (or holds something not allowed) without opt-in."""


class ChecksumError(CheckpointError):
    """Stored bytes do not match the checksum recorded for their block when they were saved."""


def summarise(items: Sequence[str], limit: int = 10) -> str:
    """``a; b; c`` with at most ``limit`` items and a count of the rest."""
    shown = "; ".join(items[:limit])
    if len(items) > limit:
        shown += f"; ... and {len(items) - limit} more"
    return shown


class StorageError(CheckpointError):
    """The storage did not deliver: an object store kept failing (5xx, resets, stalls, short
    bodies) past the retry bound, or refused a request. ``path`` names the object's URI."""


class StorageAuthError(StorageError):
    """The object store refused the credentials (wrong key, expired token, no access to the
    bucket); the message names the endpoint and the bucket."""


class StorageConfigError(StorageError):
    """The object store cannot be used as configured, so retrying cannot help: a plain-http
    endpoint without ``AWS_ALLOW_HTTP=true``, an endpoint that cannot be reached at all, a
    request the client cannot build. Raised at once; the message says what to set."""


def short_repr(obj: object, limit: int = 80) -> str:
    """``repr(obj)`` cut to ``limit`` characters, built piece by piece: a container is walked
    only as far as the limit reaches and nested at most 8 deep, a long str or bytes is cut
    before its repr is taken, a huge int is given by its size. Formatting a whole object and
    then cutting it (``f"{x!r:.80}"``) took 3.5 s and 589 MiB for a 30 KB pickle of shared
    lists, whose repr is quadratic in its size."""
    out: list[str] = []
    _put(obj, out, [limit + 1], 0)
    text = "".join(out)
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


_OPEN = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("frozenset({", "})"),
         dict: ("{", "}")}


def _put(obj: object, out: list[str], left: list[int], depth: int) -> None:
    """Append pieces of ``obj``'s repr to ``out`` while ``left[0]`` characters remain."""
    if left[0] <= 0:
        return
    kind = type(obj)
    if kind in (str, bytes, bytearray):
        piece = repr(obj[:left[0]])  # type: ignore[index]
    elif kind is int:
        piece = repr(obj) if obj.bit_length() <= 256 else f"<int of {obj.bit_length()} bits>"  # type: ignore[attr-defined]
    elif kind in (float, bool, type(None), complex):
        piece = repr(obj)
    elif kind in (set, frozenset) and not obj:
        piece = f"{kind.__name__}()"
    elif kind in _OPEN:
        opening, closing = _OPEN[kind]
        out.append(opening)
        left[0] -= len(opening)
        items = obj.items() if kind is dict else obj  # type: ignore[attr-defined]
        for i, item in enumerate(items):  # type: ignore[arg-type]
            if left[0] <= 0:
                return
            if i:
                out.append(", ")
                left[0] -= 2
            if depth >= 8:
                out.append("...")
                left[0] -= 3
                break
            if kind is dict:
                _put(item[0], out, left, depth + 1)
                out.append(": ")
                left[0] -= 2
                _put(item[1], out, left, depth + 1)
            else:
                _put(item, out, left, depth + 1)
        if kind is tuple and len(obj) == 1:  # type: ignore[arg-type]
            out.append(",")
        piece = closing
    elif type(obj).__repr__ is object.__repr__ or not type(obj).__module__.startswith("dcp_reader"):
        piece = f"<{kind.__qualname__}>"  # no foreign __repr__ runs
    else:
        piece = repr(obj)[:left[0]]  # this package's own small records
    out.append(piece)
    left[0] -= len(piece)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def clean_text(text: str, limit: int = 200) -> str:
    """Another library's error text made fit to quote inside one line of ours: terminal
    escape codes removed, whitespace collapsed, cut at a sentence end or else a word
    boundary within ``limit`` characters (an ellipsis marks the cut)."""
    text = " ".join(_ANSI.sub("", text).split())
    if len(text) <= limit:
        return text
    head = text[:limit]
    sentence = max(head.rfind(". "), head.rfind("; "))
    if sentence >= min(40, limit // 2):
        return head[:sentence + 1]
    space = head.rfind(" ")
    return (head[:space] if space >= limit // 2 else head[:limit - 1]).rstrip(" ,;:") + "…"
