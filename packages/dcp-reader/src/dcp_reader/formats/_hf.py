"""Hugging Face safetensors checkpoints (``model.safetensors`` or an index plus shards) and
torch.distributed.checkpoint's HuggingFaceStorageWriter output (``DCP_SHARDING_INFO`` in each
file's safetensors metadata: the offsets of the chunk each key holds)."""

from __future__ import annotations

import os
from collections.abc import Collection

from .._dtypes import from_safetensors
from .._errors import (
    CheckpointError,
    MetadataError,
    MissingFileError,
    MissingKeyError,
    UnknownDtypeError,
    summarise,
)
from .._json import load_json
from .._model import CheckpointMetadata, ChunkMeta, TensorMeta
from ..storage._roots import check_files, in_parallel, lexists, listdir, read_regular
from ._safetensors_file import Header, read_header_at

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
# Real indexes are ~100 bytes per tensor (a 10,000-tensor model: ~1 MB).
INDEX_LIMIT = 64 * 1024 * 1024


def hf_files(root_real: str, skip: Collection[str] = ()) -> tuple[list[str], dict[str, str] | None]:
    """The data files of an HF-style checkpoint, and the index's weight map if any; the
    files of ``skip`` (and their entries) left out (``verify`` checks the rest)."""
    index = os.path.join(root_real, INDEX_FILE)
    if lexists(root_real, INDEX_FILE):  # lexists: a dangling link or a directory is reported, not skipped
        doc = load_json(read_regular(root_real, INDEX_FILE, limit=INDEX_LIMIT, key=INDEX_FILE), index,
                        "the index is corrupt: re-save or re-download it")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise MetadataError("'weight_map' is missing or not a {tensor name: file name} object; the "
                                "index is corrupt: re-save or re-download it", path=index, key="weight_map")
        wm = {k: f for k, f in wm.items() if f not in skip}
        check_files(root_real, [(f, k) for k, f in wm.items()])
        return sorted(set(wm.values())), wm
    if lexists(root_real, SINGLE_FILE):
        return [f for f in [SINGLE_FILE] if f not in skip], None
    files = sorted(n for n in listdir(root_real) if n.endswith(".safetensors") and not n.startswith(".")
                   and n not in skip)
    if not files and not skip:
        raise MissingFileError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file in the directory",
                               path=root_real)
    check_files(root_real, [(f, None) for f in files])
    return files, None


def sharding_info(header: Header, path: str) -> dict[str, list[int]] | None:
    raw = (header.metadata or {}).get(SHARDING_KEY)
    if raw is None:
        return None
    info = load_json(raw, path, f"{SHARDING_KEY} in the safetensors metadata is malformed: re-save it")
    try:
        return {k: list(v["saved_offsets"]) for k, v in info.items()}
    except (TypeError, KeyError, AttributeError) as e:
        raise MetadataError(f"{SHARDING_KEY} in the safetensors metadata is malformed ({e}); the file is "
                            "corrupt: re-save it", path=path, key=SHARDING_KEY) from None


def load_hf(root_real: str, *, sharded: bool, skip: Collection[str] = ()) -> CheckpointMetadata:
    """Build the metadata from the headers (every file's header is read once here), leaving
    out the files of ``skip``."""
    files, weight_map = hf_files(root_real, skip)
    wanted: dict[str, list[str]] | None = None
    if weight_map is not None:
        wanted = {}
        for k, f in weight_map.items():
            wanted.setdefault(f, []).append(k)
    chunks: dict[str, list[ChunkMeta]] = {}
    dtypes: dict[str, tuple[str, str]] = {}
    problems: list[CheckpointError] = []
    headers = in_parallel(root_real, lambda f: read_header_at(root_real, f), files)
    for f, header in zip(files, headers, strict=True):
        real = os.path.join(root_real, f)
        info = sharding_info(header, real) if sharded else None
        keys = wanted[f] if wanted is not None else list(header.entries)
        for key in keys:
            e = header.entries.get(key)
            if e is None:
                problems.append(MissingKeyError(f"{key!r} (from {INDEX_FILE}) is not in {f!r}", path=real, key=key))
                continue
            try:
                dtype = from_safetensors(e.code, path=real, key=key)
            except UnknownDtypeError as err:
                problems.append(err)
                continue
            if info is not None:
                if key not in info or len(info[key]) != len(e.shape):
                    problems.append(MetadataError(f"{SHARDING_KEY} has no valid saved_offsets for {key!r} "
                                                  f"(shape {list(e.shape)})", path=real, key=key))
                    continue
                offsets = tuple(info[key])
            else:
                offsets = (0,) * len(e.shape)
            if key in dtypes and dtypes[key][0] != dtype:
                problems.append(MetadataError(f"{key!r} is {dtype} here but {dtypes[key][0]} in "
                                              f"{dtypes[key][1]!r}", path=real, key=key))
                continue
            if key in chunks and info is None:
                problems.append(MetadataError(f"{key!r} is stored whole in both {chunks[key][0].file!r} and "
                                              f"{f!r}; remove one copy", path=real, key=key))
                continue
            dtypes.setdefault(key, (dtype, f))
            chunks.setdefault(key, []).append(ChunkMeta(offsets=offsets, sizes=e.shape, file=f, key=key))
    if problems:
        first = problems[0]
        raise type(first)(f"{len(problems)} problem(s) reading the checkpoint's headers: "
                          f"{summarise([str(p) for p in problems])}", path=first.path, key=first.key,
                          offenders=[p.key or "" for p in problems])
    tensors = {}
    for key, cs in chunks.items():
        cs.sort(key=lambda c: c.offsets)
        # torch's HF reader infers the global shape the same way: the chunks' farthest extent
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in cs) for d in range(len(cs[0].sizes)))
        tensors[key] = TensorMeta(name=key, shape=shape, dtype=dtypes[key][0], chunks=tuple(cs))
    try:
        return CheckpointMetadata(tensors=tensors, values={}, format="torch-dcp-hf" if sharded else "hf")
    except CheckpointError as e:
        raise e.with_path(root_real) from None
