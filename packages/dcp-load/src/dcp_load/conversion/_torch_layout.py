"""``to="torch-dcp"``: torch.distributed.checkpoint's own layout, placed before anything is read.

Each output tensor is written whole as one ``torch.save`` blob (``_torch_blob``), blobs in
name order, each starting 64-byte aligned, in data files ``__<i>_<save id>.distcp`` of at
most ``max_shard_bytes`` (a larger tensor gets a file of its own). A ``TorchFile`` is an
``OutFile`` whose tensors' byte ranges are file offsets: ``_fill`` maps it and loads into
those ranges as it does for the other formats, then writes each tensor's CRC-32 into its
blob. The commit is dcp's ``TorchDcpWriter``'s: non-tensor values as blobs of their own
file, ``dcp-checksums.json``, then ``.metadata`` last, with ``planner_data`` (each name's
keys, which ``dcp_to_torch_save`` unflattens with).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._layout import OutFile, OutTensor
from ._torch_blob import BlobTemplate, patch_crc, template

__all__ = ["TorchFile", "commit_torch", "layout_torch_files", "new_save_id", "patch_crcs", "planner_keys"]

logger = logging.getLogger(__name__)

#: Where each blob starts in a data file (its data is 64-byte aligned within the blob).
ALIGN = 64


@dataclass(frozen=True)
class TorchFile(OutFile):
    """One ``.distcp`` data file. ``tensors``: (tensor, data start, data end) as file
    offsets; ``blobs``: each tensor's blob (its offset in the file and its template), in the
    same order; ``end``: the file's size."""

    blobs: tuple[tuple[int, BlobTemplate], ...] = ()
    end: int = 0

    @property
    def data_start(self) -> int:
        return 0

    @property
    def data_bytes(self) -> int:
        return sum(e - b for _, b, e in self.tensors)

    @property
    def size(self) -> int:
        return self.end

    def records(self) -> list[tuple[int, bytes]]:
        """(file offset, bytes) of every blob's zip records around its data."""
        out = []
        for offset, t in self.blobs:
            out.append((offset, t.head))
            out.append((offset + len(t.head) + t.nbytes, t.tail))
        return out


def new_save_id() -> str:
    """12 hex digits, as dcp's saves name their files (dcp's reader then reads the block
    checksums of ``dcp-checksums.json``)."""
    return secrets.token_hex(6)


def layout_torch_files(tensors: Sequence[OutTensor], max_shard_bytes: int, save_id: str) -> list[TorchFile]:
    """Files in order, tensors assigned in name order, each file at most ``max_shard_bytes``
    bytes unless it holds a single larger blob. Templates are made once per (shape, dtype)."""
    cache: dict[tuple[tuple[int, ...], str], BlobTemplate] = {}
    groups: list[list[tuple[OutTensor, BlobTemplate]]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda t: t.name):
        tpl = cache.get((t.shape, t.dtype))
        if tpl is None:
            tpl = cache[(t.shape, t.dtype)] = template(t.shape, t.dtype)
        add = tpl.size + (-size % ALIGN)
        if groups[-1] and size + add > max_shard_bytes:
            groups.append([])
            size, add = 0, tpl.size
        groups[-1].append((t, tpl))
        size += add
    out = []
    for i, group in enumerate(groups):
        placed, blobs, pos = [], [], 0
        for t, tpl in group:
            pos += -pos % ALIGN
            begin = pos + len(tpl.head)
            placed.append((t, begin, begin + tpl.nbytes))
            blobs.append((pos, tpl))
            pos += tpl.size
        out.append(TorchFile(f"__{i}_{save_id}.distcp", b"", tuple(placed), tuple(blobs), pos))
    return out


def patch_crcs(buf: Any, f: TorchFile) -> None:
    """Write each tensor's CRC-32 into its blob, hashed from ``buf`` (the file's mapping)."""
    view = memoryview(buf)
    try:
        for (_, begin, end), (offset, tpl) in zip(f.tensors, f.blobs, strict=True):
            patch_crc(buf, offset, tpl, view[begin:end])
    finally:
        view.release()


def planner_keys(names: Sequence[str], recorded: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Each name's keys from the top of the state dict: what the source recorded for it
    (a torch DCP source's ``planner_data``), else the name split at every dot into string
    keys, as torch flattens nested dicts (``{"a": {"b": t}}`` is ``"a.b"``, keys ``("a", "b")``)."""
    return {n: tuple(recorded[n]) if n in recorded else tuple(n.split(".")) for n in names}


def recorded_keys(src_root: str, metadata: Any) -> dict[str, tuple[Any, ...]]:
    """The ``planner_data`` of a local torch DCP source (its names' keys), else {}."""
    if getattr(metadata, "format", None) != "torch-dcp" or not os.path.isdir(src_root):
        return {}
    from dcp_reader import CheckpointError
    from dcp_reader.formats._torch_dcp import _unpickle_metadata

    try:
        md = _unpickle_metadata(os.path.realpath(src_root), src_root)
        data = md.get("planner_data", 1)
    except (CheckpointError, AttributeError, TypeError, ValueError):
        logger.debug("no planner_data read from %s", src_root, exc_info=True)
        return {}
    if not isinstance(data, Mapping):
        return {}
    return {k: tuple(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (tuple, list))
            and v and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)}


def _writer(root: str, stored: Mapping[tuple[str, str], list[Any]]) -> Any:
    """dcp's torch-format writer, told where each chunk's blob is (its own save learns that
    from the index files each rank leaves)."""
    from dcp_reader.write import TorchDcpWriter

    class Converted(TorchDcpWriter):
        def _stored(self, files: Any) -> dict[tuple[str, str], list[Any]]:
            return {k: v for k, v in stored.items() if k[0] in set(files)}

    return Converted(root)


def commit_torch(root: str, files: Sequence[TorchFile], checksums: Mapping[str, Mapping[str, str]],
                 values: Mapping[str, Any], save_id: str, keys: Mapping[str, tuple[Any, ...]]) -> int:
    """Write the values, ``dcp-checksums.json`` and ``.metadata`` last (``checksums``: {file:
    {chunk key: block checksum}}); the bytes of those files."""
    from dcp_reader import CheckpointMetadata, ChunkMeta, TensorMeta
    from dcp_reader.write._torch_dcp_writer import CHECKSUMS_FILE, METADATA_FILE

    tensors, stored = {}, {}
    for f in files:
        for (t, _, _), (offset, tpl) in zip(f.tensors, f.blobs, strict=True):
            digest = checksums[f.name][t.key]
            stored[(f.name, t.key)] = [offset, tpl.size, digest]
            chunk = ChunkMeta(offsets=(0,) * len(t.shape), sizes=t.shape, file=f.name, key=t.key, checksum=digest)
            tensors[t.name] = TensorMeta(t.name, t.shape, t.dtype, (chunk,))
    writer = _writer(root, stored)
    values_file = writer.values_file_name(save_id)
    value_meta = writer.write_values(values, file_name=values_file)
    writer.planner_data = dict(keys)
    writer.commit(CheckpointMetadata(tensors=tensors, values=value_meta, format="torch-dcp"))
    written = [METADATA_FILE, CHECKSUMS_FILE] + ([values_file] if value_meta else [])
    return sum(os.path.getsize(os.path.join(root, n)) for n in written)
