"""dcp-reader: safe readers for distributed checkpoints (native, Hugging Face safetensors,
torch.distributed.checkpoint, hyper-parallel) with narrowed reads of saved chunks."""

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
from ._version import __version__
from .formats._detect import detect_format
from .formats._hyper import is_rank_local
from .formats._native import METADATA_FILE, chunk_key, data_file_name, stray_files, values_file_name
from .integrity._verify import VerifyReport, verify_checkpoint
from .write._save_lock import WriterLock, WriterLockError
from .write._writer import EncodedValues, NativeWriter

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
