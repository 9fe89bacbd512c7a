"""The native format: ``dcp-metadata.json`` (written last) plus safetensors data files."""

from __future__ import annotations

import os

from .._errors import CheckpointError, MissingFileError, MissingMetadataError
from .._model import CheckpointMetadata
from ..storage._paths import METADATA_LIMIT, read_regular

METADATA_FILE = "dcp-metadata.json"
# Written into every native data file's safetensors __metadata__, so a directory of data
# files without METADATA_FILE is recognised as an unfinished native save.
MARKER_KEY = "dcp_format"
MARKER_VALUE = "native"
# Also in that __metadata__: {chunk key: block checksum string} (see _checksum), moved into
# the metadata by NativeWriter.commit.
CHECKSUMS_KEY = "dcp_checksums"


def chunk_key(name: str, offsets: tuple[int, ...] | list[int]) -> str:
    """The safetensors key of the chunk of tensor ``name`` starting at ``offsets``:
    ``"w@0,128"``; a 0-dim tensor's is ``"w@"``. Unique: the offsets part holds no '@'."""
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"


def load_native(root_real: str) -> CheckpointMetadata:
    path = os.path.join(root_real, METADATA_FILE)
    try:
        text = read_regular(root_real, METADATA_FILE, limit=METADATA_LIMIT, key=METADATA_FILE)
    except MissingFileError:
        raise MissingMetadataError(
            f"{METADATA_FILE} is missing: this is an incomplete native checkpoint (the save did not "
            "finish: rank 0 writes the metadata last). Re-run the save", path=root_real,
            key=METADATA_FILE) from None
    try:
        meta = CheckpointMetadata.from_json(text)
    except CheckpointError as e:
        raise e.with_path(path) from None
    if meta.format != "native":
        from .._errors import MetadataError

        raise MetadataError(f"format is {meta.format!r}, expected 'native'", path=path, key="format")
    return meta
