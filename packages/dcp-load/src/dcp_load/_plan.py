"""Planning a load: wanted boxes x saved chunks -> read pieces -> one global plan.

Every function here is pure: each rank calls ``build_global_plan`` with the same gathered
wants and the same checkpoint metadata and gets the same plan, which is what keeps the
collectives that follow in step (ARCHITECTURE "Rules"). Cost is linear in the number of
(rank, piece) wants plus O(g log g) for the g replica groups: no loop over ranks inside a
loop over ranks, so a 4096-rank job can be planned (and simulated) in one process.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BROADCASTABLE",
    "VIEWS",
    "GlobalPlan",
    "GreedyPlanner",
    "Planner",
    "ReadItem",
    "Want",
    "build_global_plan",
    "intersect",
]

#: ``Want`` flag: this rank's destination can take part in a broadcast (device supported).
BROADCASTABLE = 1
#: ``Want`` flag: this rank's framework can write a broadcast into a sub-box view in place
#: (informational: destinations without views receive through a staging tensor).
VIEWS = 2

#: Replicated pieces of at least twice this size are split into row slabs (at least this
#: big, at most one per member) read by different members, so that one huge tensor (an
#: embedding, an lm_head) does not make its reader the slowest rank. 16 MiB keeps the fixed
#: costs per slab small: ~10 us per narrowed read (dcp-reader), ~145 us per broadcast on
#: Ascend against ~0.5 ms to move 16 MiB at 33 GiB/s (FACTS.md).
SPLIT_BYTES = 16 * 1024 * 1024

#: What a rank sends to the others, per tensor entry: (name, offsets, sizes, flags). Plain
#: tuples pickle small: the all-gather carries a few dozen bytes per entry, never tensors.
Want = tuple[str, tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True, slots=True)
class ReadItem:
    """One box of one saved chunk that some ranks want, and who reads it.

    ``chunk`` indexes the tensor's saved chunks in the checkpoint metadata; the box
    ``[offsets, offsets+sizes)`` (global coordinates) lies inside it. ``ranks``: the ranks
    that want this box (sorted). ``reader``: the rank that reads it and broadcasts it to the
    others of ``ranks``; ``None`` when every rank of ``ranks`` reads it from storage itself.
    """

    name: str
    chunk: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    ranks: tuple[int, ...]
    reader: int | None = None

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"ReadItem {self.name!r}: offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if self.reader is not None and self.reader not in self.ranks:
            raise ValueError(f"ReadItem {self.name!r}: reader {self.reader} is not one of ranks {self.ranks}")

    @property
    def replicated(self) -> bool:
        """True when one reader broadcasts this box to the other ranks that want it."""
        return self.reader is not None


class Planner(Protocol):
    """The seam for choosing who reads each replicated box.

    ``assign`` is called once per load on every rank, with identical arguments built from
    gathered data only: ``groups`` (replicated items with ``reader=None``, heaviest first,
    ties by name and offsets) and ``loads`` (bytes each rank already reads for itself).
    It returns one reader per group, a member of that group's ``ranks``, and may update
    ``loads``. It must be deterministic: any difference between ranks hangs the job.
    """

    def assign(self, groups: Sequence[ReadItem], loads: MutableSequence[int]) -> list[int]: ...


class GreedyPlanner:
    """Heaviest box first, to the member with the fewest bytes so far; ties to the lower rank.

    One lazy min-heap per distinct rank set: an entry whose recorded load is stale (the rank
    read more through another set since) is refreshed when it reaches the top. Loads only
    grow, so the first fresh top is the true minimum.
    """

    def assign(self, groups: Sequence[ReadItem], loads: MutableSequence[int]) -> list[int]:
        heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        readers: list[int] = []
        for item in groups:
            heap = heaps.get(item.ranks)
            if heap is None:
                heap = [(loads[r], r) for r in item.ranks]
                heapq.heapify(heap)
                heaps[item.ranks] = heap
            while True:
                load, rank = heap[0]
                if load == loads[rank]:
                    break
                heapq.heapreplace(heap, (loads[rank], rank))
            loads[rank] += item.nbytes
            heapq.heapreplace(heap, (loads[rank], rank))
            readers.append(rank)
        return readers


def intersect(chunks: Sequence[Any], offsets: tuple[int, ...], sizes: tuple[int, ...]
              ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(chunk index, offsets, sizes) of every non-empty overlap of the box with a chunk.

    A 0-dim box overlaps every 0-dim chunk (volume 1); a box with a zero size is empty.
    """
    out = []
    if any(s == 0 for s in sizes):
        return out
    for index, chunk in enumerate(chunks):
        lo = tuple(max(a, b) for a, b in zip(offsets, chunk.offsets, strict=True))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True))
        if all(h > low for low, h in zip(lo, hi, strict=True)):
            out.append((index, lo, tuple(h - low for low, h in zip(lo, hi, strict=True))))
    return out


@dataclass(frozen=True)
class GlobalPlan:
    """Every rank's reads and the broadcasts between them, in the agreed order.

    ``broadcasts``: replicated items in the order every rank walks them. ``local``: items
    that each rank of their ``ranks`` reads itself. ``loads``: bytes each rank reads.
    """

    world_size: int
    broadcasts: tuple[ReadItem, ...]
    local: tuple[ReadItem, ...]
    loads: tuple[int, ...]

    @property
    def unique_bytes(self) -> int:
        """Bytes of the distinct boxes wanted by any rank (what read-once reads in total)."""
        return sum(i.nbytes for i in self.broadcasts) + sum(i.nbytes for i in self.local)

    def reads_for(self, rank: int) -> list[ReadItem]:
        """What ``rank`` reads from storage, in order: its broadcast sources first."""
        own = [i for i in self.broadcasts if i.reader == rank]
        own.extend(i for i in self.local if rank in i.ranks)
        return own


def _split(item: ReadItem, split_bytes: int) -> list[ReadItem]:
    """``item`` cut along dim 0 into slabs of at least ``split_bytes``, one per member at most."""
    if split_bytes <= 0 or not item.sizes or item.sizes[0] < 2:
        return [item]
    parts = min(len(item.ranks), item.sizes[0], item.nbytes // split_bytes)
    if parts < 2:
        return [item]
    row_bytes = item.nbytes // item.sizes[0]
    base, extra = divmod(item.sizes[0], parts)
    out, start = [], item.offsets[0]
    for k in range(parts):
        rows = base + (1 if k < extra else 0)
        out.append(ReadItem(item.name, item.chunk, (start, *item.offsets[1:]), (rows, *item.sizes[1:]),
                            rows * row_bytes, item.ranks))
        start += rows
    return out


def build_global_plan(
    tensors: Mapping[str, Any],
    wants: Sequence[Sequence[Want]],
    *,
    broadcast: bool = True,
    planner: Planner | None = None,
    split_bytes: int = SPLIT_BYTES,
    hosts: Sequence[str] | None = None,
) -> GlobalPlan:
    """The plan every rank derives from the gathered ``wants`` (index = rank).

    ``tensors`` maps names to checkpoint tensor metadata (``.chunks`` with ``.offsets``,
    ``.sizes``, ``.file``; ``.itemsize``). Boxes several ranks want identically (same name,
    offsets and sizes after intersecting with the saved chunks) form a replica group when
    ``broadcast`` is set and every member flagged its destination ``BROADCASTABLE``; such
    boxes of at least ``2 * split_bytes`` are split into row slabs (0: never). Names
    missing from ``tensors`` are skipped (validation reports them).

    ``hosts`` (index = rank): when given, a box wanted only by ranks of one host is read
    by each of them from storage instead of broadcast, since they share one page cache
    (the ``"auto"`` mode of ``load``). Boxes whose ranks span hosts are broadcast.
    """
    world = len(wants)
    if hosts is not None and len(hosts) != world:
        raise ValueError(f"build_global_plan: {len(hosts)} hosts for {world} ranks")
    boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    pieces: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    for rank, rank_wants in enumerate(wants):
        for name, offsets, sizes, flags in rank_wants:
            meta = tensors.get(name)
            if meta is None:
                continue
            key = (name, offsets, sizes)
            overlaps = boxes.get(key)
            if overlaps is None:
                overlaps = boxes[key] = intersect(meta.chunks, offsets, sizes)
            for chunk, poff, psz in overlaps:
                pkey = (name, poff, psz)
                entry = pieces.get(pkey)
                if entry is None:
                    entry = pieces[pkey] = [chunk, math.prod(psz) * meta.itemsize, [], True]
                entry[2].append(rank)
                if not flags & BROADCASTABLE:
                    entry[3] = False
    loads = [0] * world
    local: list[ReadItem] = []
    groups: list[ReadItem] = []
    for (name, poff, psz), (chunk, nbytes, ranks, ok) in pieces.items():
        item = ReadItem(name, chunk, poff, psz, nbytes, tuple(ranks))
        one_host = hosts is not None and len({hosts[r] for r in ranks}) == 1
        if broadcast and ok and len(ranks) > 1 and not one_host:
            groups.extend(_split(item, split_bytes))
        else:
            local.append(item)
            for r in ranks:
                loads[r] += nbytes
    groups.sort(key=lambda i: (-i.nbytes, i.name, i.offsets))
    readers = (planner or GreedyPlanner()).assign(groups, loads)
    if len(readers) != len(groups):
        raise ValueError(f"planner returned {len(readers)} readers for {len(groups)} replica groups")
    assigned = []
    for item, reader in zip(groups, readers, strict=True):
        if reader not in item.ranks:
            raise ValueError(f"planner chose reader {reader} for {item.name!r} outside its ranks {item.ranks}")
        assigned.append(ReadItem(item.name, item.chunk, item.offsets, item.sizes, item.nbytes, item.ranks, reader))

    # The agreed order: by data file, then name and offsets, so readers walk files in turn.
    def order(i: ReadItem) -> tuple[Any, ...]:
        return (str(tensors[i.name].chunks[i.chunk].file), i.name, i.offsets)

    assigned.sort(key=order)
    local.sort(key=order)
    return GlobalPlan(world, tuple(assigned), tuple(local), tuple(loads))
