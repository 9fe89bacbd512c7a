"""The native format: ``dcp-metadata.json`` (written last) plus safetensors data files."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable

from .._errors import CheckpointError, MissingFileError, MissingMetadataError
from .._model import CheckpointMetadata
from ..storage._names import METADATA_LIMIT
from ..storage._roots import read_regular

METADATA_FILE = "dcp-metadata.json"
# Written into every native data file's safetensors __metadata__, so a directory of data
# files without METADATA_FILE is recognised as an unfinished native save.
MARKER_KEY = "dcp_format"
MARKER_VALUE = "native"
# Also in that __metadata__: {chunk key: block checksum string} (see _checksum), moved into
# the metadata by NativeWriter.commit.
CHECKSUMS_KEY = "dcp_checksums"


# Data files of a save: ``rank-00003.<save id>.safetensors`` and ``values.<save id>.pkl``. A
# save id (12 hex digits) is new for every save, so an overwrite writes beside the committed
# checkpoint and only the metadata, replaced last, switches readers from the old files to the
# new ones. Names without an id are what dcp-reader 0.3 and earlier wrote.
SAVE_ID_RE = re.compile(r"[0-9a-f]{12}")
# What the native writer itself names files at the top of a checkpoint directory: data and
# values files (with or without a save id) and the temporary files of any of them or of the
# metadata (``<name>.tmp-<pid>``, left behind by a killed save). Only such files are ever
# removed as leftovers or reported as stray; anything else in the directory is the user's.
_OWN_FILE_RE = re.compile(rf"(?:rank-\d{{5}}(?:\.{SAVE_ID_RE.pattern})?\.safetensors|values(?:\.{SAVE_ID_RE.pattern})?\.pkl"
                          r"|dcp-metadata\.json)(?:\.tmp-\d+)?")
_LEGACY_DATA_RE = re.compile(r"rank-\d{5}\.safetensors")
_LEGACY_VALUES = "values.pkl"
# The single-writer lock (see _save_lock): never stray, never removed.
LOCK_FILE = ".dcp-save.lock"


def data_file_name(rank: int, save_id: str) -> str:
    """The data file rank ``rank`` writes in the save ``save_id``."""
    return f"rank-{int(rank):05d}.{save_id}.safetensors"


def values_file_name(save_id: str) -> str:
    """The file pickled values are written to in the save ``save_id``."""
    return f"values.{save_id}.pkl"


def stray_files(root: str, metadata: CheckpointMetadata, replaced: Collection[str] = ()) -> list[str]:
    """Top-level files of ``root`` that the native writer names (data, values and temporary
    files) but ``metadata`` does not refer to: left by an earlier, larger save, by a killed
    save, or being written by a save in progress. A name without a save id counts only when
    the file is the writer's (see ``_writers``); ``replaced``: the files named by the
    metadata that ``metadata`` replaced. Sorted; [] when the directory cannot be listed."""
    try:
        with os.scandir(root) as it:
            names = [e.name for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []
    return [n for n in stray_among(names, metadata) if _writers(root, n, replaced)]


def stray_among(names: Iterable[str], metadata: CheckpointMetadata, *, legacy: bool = True) -> list[str]:
    """Of the top-level file (or object) ``names``, those named like the writer's files and
    not referred to by ``metadata``; ``legacy=False`` leaves out the names of dcp-reader 0.3
    and earlier (without a save id), which a listing alone cannot tell from a user's. Sorted."""
    named = files_named(metadata)
    return sorted(n for n in names if n not in named and n != METADATA_FILE and _OWN_FILE_RE.fullmatch(n)
                  and (legacy or not (n == _LEGACY_VALUES or _LEGACY_DATA_RE.fullmatch(n))))


def files_named(metadata: CheckpointMetadata) -> set[str]:
    """The data and values files ``metadata`` refers to."""
    named = {c.file for t in metadata.tensors.values() for c in t.chunks}
    return named | {v.file for v in metadata.values.values() if v.file is not None}


def _writers(root: str, name: str, replaced: Collection[str]) -> bool:
    """Whether a file named like the writer's is the writer's. Names with a save id and
    temporary files are; the names of dcp-reader 0.3 and earlier are common enough to be a
    user's or another tool's: ``rank-NNNNN.safetensors`` counts only when its header carries
    the native marker, ``values.pkl`` (no header) only when the replaced metadata named it."""
    if name == _LEGACY_VALUES:
        return name in replaced
    if not _LEGACY_DATA_RE.fullmatch(name):
        return True
    from ._safetensors_file import read_header_at

    try:
        meta = read_header_at(root, name).metadata or {}
    except Exception:  # noqa: BLE001 - not a readable safetensors file: not one the writer wrote
        return False
    return meta.get(MARKER_KEY) == MARKER_VALUE


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
