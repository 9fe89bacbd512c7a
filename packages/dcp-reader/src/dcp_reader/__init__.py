"""dcp-reader: safe readers for distributed checkpoints (native, Hugging Face safetensors,
torch.distributed.checkpoint, hyper-parallel) with narrowed reads of saved chunks.

The public names are imported on first use (PEP 562 ``__getattr__``), so that a program
that needs one reader, or only the errors, does not import every format and the writer
(``import dcp_reader`` took 0.1-0.3 s; now a few milliseconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time ``__getattr__`` imports these
    from ._errors import (
        CheckpointError,
        ChecksumError,
        CoverageError,
        MetadataError,
        MissingFileError,
        MissingKeyError,
        MissingMetadataError,
        StorageAuthError,
        StorageConfigError,
        StorageError,
        TruncatedFileError,
        UnknownDtypeError,
        UnsafePathError,
        UnsafePickleError,
    )
    from ._model import SCHEMA_VERSION, CheckpointMetadata, ChunkMeta, TensorMeta, ValueMeta
    from ._reader import CheckpointReader, open_checkpoint
    from .formats._detect import detect_format
    from .formats._hyper import is_rank_local
    from .formats._native import METADATA_FILE, chunk_key, data_file_name, stray_files, values_file_name
    from .integrity._verify import VerifyReport, verify_checkpoint
    from .write._save_lock import WriterLock, WriterLockError
    from .write._writer import EncodedValues, NativeWriter

_ERRORS = ("CheckpointError", "ChecksumError", "CoverageError", "MetadataError", "MissingFileError",
           "MissingKeyError", "MissingMetadataError", "StorageAuthError", "StorageConfigError", "StorageError",
           "TruncatedFileError", "UnknownDtypeError", "UnsafePathError", "UnsafePickleError")
#: Public name -> the module (relative to this package) that defines it.
_WHERE = {
    **dict.fromkeys(_ERRORS, "._errors"),
    **dict.fromkeys(("SCHEMA_VERSION", "CheckpointMetadata", "ChunkMeta", "TensorMeta", "ValueMeta"), "._model"),
    "CheckpointReader": "._reader", "open_checkpoint": "._reader",
    "detect_format": ".formats._detect",
    "is_rank_local": ".formats._hyper",
    **dict.fromkeys(("METADATA_FILE", "chunk_key", "data_file_name", "stray_files", "values_file_name"),
                    ".formats._native"),
    "VerifyReport": ".integrity._verify", "verify_checkpoint": ".integrity._verify",
    "WriterLock": ".write._save_lock", "WriterLockError": ".write._save_lock",
    "EncodedValues": ".write._writer", "NativeWriter": ".write._writer",
}

__all__ = [
    "SCHEMA_VERSION",
    "METADATA_FILE",
    "ChunkMeta",
    "TensorMeta",
    "ValueMeta",
    "CheckpointMetadata",
    "CheckpointReader",
    "open_checkpoint",
    "verify_checkpoint",
    "VerifyReport",
    "detect_format",
    "is_rank_local",
    "NativeWriter",
    "EncodedValues",
    "WriterLock",
    "WriterLockError",
    "chunk_key",
    "data_file_name",
    "values_file_name",
    "stray_files",
    "CheckpointError",
    "ChecksumError",
    "MissingMetadataError",
    "MetadataError",
    "MissingFileError",
    "MissingKeyError",
    "TruncatedFileError",
    "UnknownDtypeError",
    "CoverageError",
    "UnsafePathError",
    "UnsafePickleError",
    "StorageError",
    "StorageAuthError",
    "StorageConfigError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept here after."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
