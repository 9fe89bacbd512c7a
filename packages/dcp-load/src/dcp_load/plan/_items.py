"""The plan's items: what a rank wants (``Want``), one box read (``ReadItem``), the whole
plan (``GlobalPlan``), the reader-choice seam (``Planner``) and hosts in blocks.

Types only: the planners (``_plan``, ``_owners``, ``_derived``, ``_local``) build these.
"""

from __future__ import annotations

import heapq
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "BROADCASTABLE",
    "SPLIT_BYTES",
    "VIEWS",
    "GlobalPlan",
    "GreedyPlanner",
    "HostBlocks",
    "Planner",
    "ReadItem",
    "Want",
]

#: ``Want`` flag: this rank's destination can take part in a broadcast (device supported).
BROADCASTABLE = 1
#: ``Want`` flag: this rank's framework can write a broadcast into a sub-box view in place
#: (informational: destinations without views receive through a staging tensor).
VIEWS = 2

#: Smallest row slab a shared interval of 8 or more boxes is cut into (fewer boxes: see
#: ``_owners.BOXES_PER_SLAB``; how many: ``_owners``): huge tensors (an embedding, an
#: lm_head) are read by several owners, and each holder set's owners get several slabs to
#: balance. Measured on the 70B-like plan of
#: benchmarks/load/bench_load_plan.py (TP8 x PP8 x DP16 / DP64), max / mean bytes read per rank:
#: 16 MiB slabs 1.15 / 1.44, 8 MiB slabs 1.10 / 1.16 (the earlier whole-job greedy planner:
#: 1.10 / 1.14). 8 MiB keeps the fixed costs per slab moderate: ~10 us per narrowed read
#: (dcp-reader README), ~145 us per broadcast on Ascend against ~240 us to move 8 MiB at
#: 33 GiB/s (dcp-broadcast README).
SPLIT_BYTES = 8 * 1024 * 1024

#: What a rank holds, per box of a tensor entry: (name, offsets, sizes, flags, dtype).
#: ``dtype`` is the destination's neutral dtype name (it may differ from the checkpoint's:
#: the load casts); a 4-tuple means the checkpoint's dtype. A rank may hold several boxes
#: of one name. Plain tuples pickle small: the all-gather carries a few dozen bytes each.
Want = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class ReadItem:
    """One box of one saved chunk that some ranks want, and who reads it.

    ``chunk`` indexes the tensor's saved chunks in the checkpoint metadata; the box
    ``[offsets, offsets+sizes)`` (global coordinates) lies inside it. ``ranks``: the ranks
    that want this box (sorted). ``reader``: the rank that reads it and broadcasts it to the
    others of ``ranks``; ``None`` when every rank of ``ranks`` reads it from storage itself.
    ``nbytes``: bytes of the box in the destination dtype ``dtype`` ("" = the checkpoint's).
    ``cached``: the ranks re-read the box from the page cache of their host, which a
    broadcast item's reader on that host fetched and checked (block checksums are verified
    by that reader, once per host, not again by each of these ranks).
    ``relay``: ``reader`` holds no destination of this box: it reads the box into a staging
    tensor only to send it (on object storage, one rank fetches whole rows of a
    column-sharded chunk in few GETs and relays the other ranks' columns, ``_owners``);
    ``ranks`` then holds ``reader`` too, as the broadcast group does.
    """

    name: str
    chunk: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    ranks: tuple[int, ...]
    reader: int | None = None
    dtype: str = ""
    cached: bool = False
    relay: bool = False

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"ReadItem {self.name!r}: offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if self.reader is not None and self.reader not in self.ranks:
            raise ValueError(f"ReadItem {self.name!r}: reader {self.reader} is not one of ranks {self.ranks}")
        if self.relay and self.reader is None:
            raise ValueError(f"ReadItem {self.name!r}: a relayed box needs its reader")

    @property
    def replicated(self) -> bool:
        """True when one reader broadcasts this box to the other ranks that want it."""
        return self.reader is not None

    @property
    def wanting(self) -> tuple[int, ...]:
        """The ranks whose destinations take this box (``ranks`` without a relay's reader)."""
        return tuple(r for r in self.ranks if r != self.reader) if self.relay else self.ranks


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


class HostBlocks(Sequence[int]):
    """Hosts of ranks placed in contiguous blocks: ``hosts[r] == r // per_host``.

    What ``$LOCAL_WORLD_SIZE`` says (torchrun), given to the planner in place of a list of
    ``world`` host ids: a rank of a 64k-rank job then plans without building one.
    """

    def __init__(self, world: int, per_host: int):
        if per_host < 1 or world < 0:
            raise ValueError(f"HostBlocks: per_host must be >= 1 and world >= 0, got {per_host} and {world}")
        self.world, self.per_host = world, per_host

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, rank: Any) -> Any:
        if isinstance(rank, slice):
            return [r // self.per_host for r in range(self.world)[rank]]
        if not -self.world <= rank < self.world:
            raise IndexError(f"rank {rank} outside a world of {self.world}")
        return (rank % self.world) // self.per_host

    def __repr__(self) -> str:
        return f"HostBlocks(world={self.world}, per_host={self.per_host})"


@dataclass(frozen=True)
class GlobalPlan:
    """Every rank's reads and the broadcasts between them, in the agreed order.

    ``broadcasts``: replicated items in the order every rank walks them. ``local``: items
    that each rank of their ``ranks`` reads itself. ``loads``: bytes each rank reads from
    storage. ``unique_bytes``: stored bytes of the distinct boxes any rank wants (what a
    read-once load fetches in total). ``fetched_bytes``: stored bytes the plan fetches from
    storage, counting a box that several ranks of one host read once (they share the page
    cache, as ``hosts`` says). ``rank``: None for the whole job's plan; for one rank's part
    of it (``plan_for_rank``), that rank: then ``broadcasts`` and ``local`` hold only items
    it takes part in, ``loads`` only what the ranks of its holder sets read of them, and
    the two byte counts only the row intervals it leads (summed over ranks, the job's).
    """

    world_size: int
    broadcasts: tuple[ReadItem, ...]
    local: tuple[ReadItem, ...]
    loads: tuple[int, ...]
    unique_bytes: int
    fetched_bytes: int = 0
    rank: int | None = None

    def reads_for(self, rank: int) -> list[ReadItem]:
        """What ``rank`` reads from storage, in order: its broadcast sources first."""
        own = [i for i in self.broadcasts if i.reader == rank]
        own.extend(i for i in self.local if rank in i.ranks)
        return own
