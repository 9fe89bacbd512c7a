"""Checkpoint locations: a local path or an object-store URI (``s3://``, ``gs://``, ``az://``)."""

from __future__ import annotations

import os
import posixpath
from typing import Any

#: The URI schemes sent to the object-store backend (obstore's names; ``s3a`` and ``gcs``
#: are spellings other tools use for the same stores).
SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure")


def is_uri(path: Any) -> bool:
    """Whether ``path`` names an object store (``s3://bucket/prefix`` and the like)."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix without slashes at either end); ValueError when malformed."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket; write {scheme}://<bucket>/<prefix>")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{uri!r}: '.' and '..' have no meaning in an object key; write the prefix plainly")
    return scheme.lower(), bucket, "/".join(parts)


def real_root(path: str | os.PathLike[str]) -> str:
    """The checkpoint root, normalised once: a URI without trailing slashes, else the real
    path of the directory (symlinks resolved)."""
    path = os.fspath(path)
    if is_uri(path):
        scheme, bucket, prefix = split_uri(path)
        return f"{scheme}://{bucket}/{prefix}" if prefix else f"{scheme}://{bucket}"
    return os.path.realpath(path)


def parent(path: str) -> str:
    return posixpath.dirname(path) if is_uri(path) else os.path.dirname(path)
