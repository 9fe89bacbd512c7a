"""Where checkpoint bytes live: the storage seam (``Storage``), POSIX files and object stores.

``open_storage(path_or_uri)`` gives the backend of a checkpoint root: ``PosixStorage`` for a
directory, ``ObjectStorage`` for ``s3://bucket/prefix`` (and ``gs://``, ``az://``; needs
obstore: ``pip install 'dcp-reader[s3]'``)."""

from __future__ import annotations

import os

from ._object import ObjectFile, ObjectStorage
from ._options import ObjectOptions
from ._posix import PosixFile, PosixStorage
from ._protocol import Storage, StorageFile
from ._roots import storage_type
from ._uri import is_uri, real_root


def open_storage(root: str | os.PathLike[str], *, options: ObjectOptions | None = None) -> Storage:
    """The backend of a checkpoint root (no I/O until used). ``options``: object stores only
    (default: ``ObjectOptions.from_env()``)."""
    root = os.fspath(root)
    kind = storage_type(root)
    return kind(root) if kind is PosixStorage else ObjectStorage(root, options)


__all__ = ["ObjectFile", "ObjectOptions", "ObjectStorage", "PosixFile", "PosixStorage", "Storage",
           "StorageFile", "is_uri", "open_storage", "real_root", "storage_type"]
