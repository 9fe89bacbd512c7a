"""Typed errors. Every error names the checkpoint file (``path``) and the entry (``key``)
it is about, gives the actual values and says how to fix the problem."""

from __future__ import annotations

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
