"""Which format a checkpoint directory holds, from its contents."""

from __future__ import annotations

import os

from .._errors import MissingMetadataError
from ..storage._roots import listdir
from ..storage._uri import real_root
from ._hf import INDEX_FILE, SHARDING_KEY, SINGLE_FILE
from ._hyper import FORMAT as HYPER_FORMAT
from ._hyper import detect_hyper
from ._native import _OWN_FILE_RE, LOCK_FILE, MARKER_KEY, MARKER_VALUE
from ._native import METADATA_FILE as NATIVE_METADATA
from ._safetensors_file import read_header_at
from ._torch_dcp import METADATA_FILE as DCP_METADATA


def detect_format(path: str | os.PathLike[str]) -> str:
    """"native", "hf", "torch-dcp-hf", "torch-dcp" or "hyper-parallel"; MissingMetadataError saying what was
    found when the directory holds no complete checkpoint. Reads at most one file header."""
    root = real_root(path)
    try:
        names = listdir(root)
    except FileNotFoundError:
        raise MissingMetadataError("the checkpoint directory does not exist", path=root) from None
    except NotADirectoryError:
        raise MissingMetadataError("not a directory; pass the checkpoint directory", path=root) from None
    if NATIVE_METADATA in names:
        return "native"
    if detect_hyper(root, names):  # before torch-dcp: both name their pickle .metadata
        return HYPER_FORMAT
    if DCP_METADATA in names:
        return "torch-dcp"
    st = sorted(n for n in names if n.endswith(".safetensors") and not n.startswith("."))
    if INDEX_FILE in names or st:
        first = SINGLE_FILE if SINGLE_FILE in names else (st[0] if st else None)
        if first is None:  # only an index: let the hf reader report the missing shards
            return "hf"
        meta = read_header_at(root, first).metadata or {}
        if meta.get(MARKER_KEY) == MARKER_VALUE:
            raise MissingMetadataError(
                f"{NATIVE_METADATA} is missing next to native data files ({first!r}, ...): an incomplete "
                "native checkpoint (the save did not finish; rank 0 writes the metadata last). Re-run "
                "the save", path=root, key=NATIVE_METADATA)
        return "torch-dcp-hf" if SHARDING_KEY in meta else "hf"
    if any(n.endswith(".distcp") for n in names):
        raise MissingMetadataError(
            f"{DCP_METADATA} is missing next to *.distcp files: an incomplete torch.distributed.checkpoint "
            "save (it writes .metadata last). Re-run the save", path=root, key=DCP_METADATA)
    left = sorted(n for n in names if n == LOCK_FILE or _OWN_FILE_RE.fullmatch(n))
    if left:  # the lock and temporary files a native save writes before its first commit
        raise MissingMetadataError(
            f"{NATIVE_METADATA} is missing and the directory holds only what a native save writes before it "
            f"commits ({', '.join(map(repr, left[:3]))}{', ...' if len(left) > 3 else ''}): an incomplete native "
            "checkpoint (the save was killed, or is still running; rank 0 writes the metadata last). Re-run the "
            "save into this directory (it removes these files once it commits)", path=root, key=NATIVE_METADATA)
    raise MissingMetadataError(
        f"no checkpoint found: none of {NATIVE_METADATA}, {DCP_METADATA}, {INDEX_FILE}, {SINGLE_FILE} "
        f"or *.safetensors in the directory ({len(names)} entries). Check the path", path=root)
