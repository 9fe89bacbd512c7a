"""``save``: write a state dict in the native format, each replicated box once.

Call order (every rank): rank 0 removes any committed metadata at the path; all ranks
all-gather what they hold (names, boxes, dtypes, global shapes: small tuples); every rank
derives the same layout (one writer per distinct box, balanced by bytes with the load
planner's greedy rule) and checks it tiles every tensor; each writer writes one data file;
after an exchange that shows every rank finished, rank 0 writes the metadata last and
atomically, and a final exchange returns its outcome to everyone. A save interrupted at
any point leaves no metadata, which readers report as an unfinished save. Every wait is
bounded by a ``Coordinator`` (``dcp-save/<n>``): arrival within ``timeout``, and each
exchange aborted once a rank published a failure or stopped beating.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._coordinate import DEFAULT_TIMEOUT, Coordinator, timeout_seconds
from ._errors import LoadError
from ._load import resolve_platform
from ._plan import GreedyPlanner, ReadItem
from ._shared_open import is_uri
from ._state import flatten_state_dict, is_tensor
from ._targets import in_mesh, target_for
from ._validate import check_launch, exchange, summarise

__all__ = ["SaveReport", "save"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveReport:
    """One rank's account of a ``save``: what it wrote and how long it took."""

    rank: int
    world_size: int
    path: str
    tensors: int
    chunks_written: int
    bytes_written: int
    job_bytes: int
    seconds: float

    def __post_init__(self) -> None:
        if self.bytes_written < 0 or self.chunks_written < 0:
            raise ValueError("SaveReport counts must be >= 0")


def _file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _layout(gathered: list[Any]) -> tuple[dict[str, Any], dict[int, list[ReadItem]], dict[int, list[str]]]:
    """(tensor metadata by name, items each rank writes, errors by offending rank) from
    every rank's holdings (the same on every rank)."""
    from dcp_reader import ChunkMeta, TensorMeta, chunk_key

    errors: dict[int, list[str]] = {}
    info: dict[str, tuple[tuple[int, ...], str]] = {}
    boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for rank, (holdings, _) in enumerate(gathered):
        for name, offsets, sizes, dtype, shape in holdings:
            seen = info.setdefault(name, (shape, dtype))
            if seen != (shape, dtype):
                errors.setdefault(rank, []).append(
                    f"{name!r}: this rank holds global shape {shape} {dtype}, a lower rank {seen[0]} {seen[1]}; "
                    "every rank must agree on a tensor's global shape and dtype")
                continue
            boxes.setdefault((name, offsets, sizes), []).append(rank)
    itemsize = {n: TensorMeta(n, shape, dtype, ()).itemsize for n, (shape, dtype) in info.items()}
    items = [ReadItem(n, 0, o, s, _numel(s) * itemsize[n], tuple(r)) for (n, o, s), r in boxes.items()]
    items.sort(key=lambda i: (-i.nbytes, i.name, i.offsets))
    writers = GreedyPlanner().assign(items, [0] * len(gathered))
    per_rank: dict[int, list[ReadItem]] = {}
    chunks: dict[str, list[Any]] = {}
    for item, w in zip(items, writers, strict=True):
        per_rank.setdefault(w, []).append(item)
        chunks.setdefault(item.name, []).append(
            ChunkMeta(item.offsets, item.sizes, _file_name(w), chunk_key(item.name, item.offsets)))
    tensors = {}
    for name, cs in chunks.items():
        shape, dtype = info[name]
        tensors[name] = TensorMeta(name, shape, dtype, tuple(sorted(cs, key=lambda c: c.offsets)))
    return tensors, per_rank, errors


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def save(
    state_dict: Mapping[Any, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    no_dist: bool = False,
    allow_pickle: bool = False,
    platform: Any = None,
    timeout: Any = DEFAULT_TIMEOUT,
) -> SaveReport:
    """Write ``state_dict`` to the directory ``checkpoint_id`` in the native format.

    Call on every rank. Holds the same entries ``load`` takes (DTensors, plain tensors,
    ``Chunk``, nested dicts and lists, non-tensor values). Boxes held identically by
    several ranks are written once, by the holder with the fewest bytes so far. Non-tensor
    values are taken from rank 0; values that are not JSON need ``allow_pickle=True``.
    A failure on any rank raises ``LoadError`` (phase ``"save"``) on every rank.

    ``timeout`` (a ``timedelta`` or seconds, default 10 minutes): how long ranks that
    entered ``save`` wait for the others. Every exchange of the save is bounded as in
    ``load``: a rank that fails, dies or never arrives makes the others raise ``LoadError``
    naming it (within about 15 s for a dead rank) instead of waiting in the next exchange.
    """
    if checkpoint_id is None:
        raise ValueError("save: checkpoint_id= (the directory to write) is required")
    wait_s = timeout_seconds(timeout, "save")
    start = time.perf_counter()
    path = os.fspath(checkpoint_id)
    path = path if is_uri(path) else os.path.abspath(path)  # s3://bucket/prefix: an object store
    leaves = flatten_state_dict(state_dict)
    platform = resolve_platform(platform, leaves)
    check_launch(platform, no_dist, "save")
    collective = not no_dist and platform.is_distributed()
    with Coordinator(platform, collective=collective, timeout=wait_s, operation="save") as coord:
        coord.arrive()
        return _save(coord, platform, collective, leaves, path, allow_pickle, start)


def _hold(leaves: list[Any], writer: Any, me: int, errors: list[str]) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """(this rank's holdings, targets by name, non-tensor values); errors are recorded."""
    holdings: list[tuple[Any, ...]] = []
    targets: dict[str, Any] = {}
    values: dict[str, Any] = {}
    try:
        if me == 0:
            writer.invalidate()  # before any rank writes: old metadata must not describe new files
        for leaf in leaves:
            if is_tensor(leaf.value):
                if not in_mesh(leaf.value):
                    continue  # this rank holds no part of it; the mesh's ranks write it
                t = target_for(leaf)
                targets[t.name] = t
                holdings.extend((t.name, b.offsets, b.sizes, t.dtype, t.global_shape) for b in t.boxes)
            else:
                values[leaf.name] = leaf.value
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
    return holdings, targets, values


def _save(coord: Coordinator, platform: Any, collective: bool, leaves: list[Any], path: str,
          allow_pickle: bool, start: float) -> SaveReport:
    """``save`` once every rank arrived; every exchange is bounded by ``coord``."""
    from dcp_reader import CheckpointMetadata, NativeWriter

    rank = platform.rank()
    world = platform.world_size() if collective else 1
    me = rank if collective else 0
    errors: list[str] = []
    writer = None
    try:
        writer = NativeWriter(path, allow_pickle=allow_pickle)
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
    holdings, targets, values = _hold(leaves, writer, me, errors) if writer is not None else ([], {}, {})
    gathered = coord.exchange(exchange, errors, "save", collective=collective, payload=(holdings, sorted(values)))
    gathered = [(h, v) for h, v in gathered]

    tensors, per_rank, failures = _layout(gathered)
    missing_values = sorted(set().union(*(set(v) for _, v in gathered)) - set(gathered[0][1]))
    if missing_values:
        failures.setdefault(0, []).append(
            f"non-tensor values held by other ranks but not by rank 0: {summarise(missing_values)}; "
            "rank 0 writes the values, so it must hold all of them")
    try:
        CheckpointMetadata(tensors=tensors, values={}, format="native")
    except Exception as exc:  # noqa: BLE001 - same data on every rank, so every rank raises alike
        failures.setdefault(0, []).append(f"the boxes all ranks hold do not tile the tensors: "
                                          f"{type(exc).__name__}: {exc}")
    if failures:
        raise LoadError(failures, "save")

    written = nbytes = 0
    value_meta: dict[str, Any] = {}
    try:
        mine = per_rank.get(me, [])
        if mine:
            from dcp_reader import chunk_key

            data = {chunk_key(i.name, i.offsets): targets[i.name].view(i.offsets, i.sizes) for i in mine}
            writer.write_file(_file_name(me), data)
            written, nbytes = len(mine), sum(i.nbytes for i in mine)
        if me == 0:
            value_meta = writer.write_values(values)
    except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
        errors.append(f"{type(exc).__name__}: {exc}")
    coord.check(errors, "save", collective=collective)

    if me == 0:
        try:
            writer.commit(CheckpointMetadata(tensors=tensors, values=value_meta, format="native"))
        except Exception as exc:  # noqa: BLE001 - reach the exchange so that every rank raises
            errors.append(f"commit: {type(exc).__name__}: {exc}")
    coord.check(errors, "save", collective=collective)
    seconds = time.perf_counter() - start
    logger.debug("rank %d: saved %d chunk(s), %d bytes to %s in %.4f s", rank, written, nbytes, path, seconds)
    return SaveReport(rank=rank, world_size=world, path=path, tensors=len(tensors), chunks_written=written,
                      bytes_written=nbytes, job_bytes=sum(t.nbytes for t in tensors.values()), seconds=seconds)
