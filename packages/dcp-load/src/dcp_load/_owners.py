"""Who reads what: one owner per shared row interval, and the reader of each box in it.

The rule, computed by every rank alike from the ranks holding one tensor (never from other
tensors, so that a rank can plan only the tensors it holds):

* A row interval of a saved chunk (``_segments.intervals``) that several ranks need, and
  that is broadcastable, is cut into ``min(units, bytes // split_bytes)`` row slabs (at
  least one). A *unit* is a host when ranks that share a page cache re-read from it
  (``"auto"``), else a rank. All slabs needed by the same set of ranks (the holder set:
  a data-parallel group, say) are given owners together: heaviest first, to the unit with
  the fewest bytes of that set so far. Every member of a holder set holds the same boxes,
  so each of them computes the same owners without knowing anything about other sets.
* Inside a slab, each box some ranks want is read by the wanting rank nearest (in rank
  order, ties to the lower) to the slab's anchor rank, preferring ranks on the anchor's
  host. So the two column halves of one row slab are read on one host (where both halves
  have a holder), which fetches the slab's pages once; the other holders receive it.
* With ``same_host_reads`` the holders on the reader's host read the box themselves from
  the page cache the reader filled, and only holders on other hosts receive the broadcast.

A box wanted by one rank only is read by that rank. When the owner's host holds none of a
slab's boxes' ranks, the nearest holder elsewhere reads it: the slab's pages are then
fetched by two hosts (no rank reads a box it does not hold, so no staging memory is
needed).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._plan import GlobalPlan, Planner, ReadItem, intersect
from ._segments import Piece, intervals, row_bytes, split_rows, sub_box

__all__ = ["SLABS_PER_UNIT", "PlanBuilder"]

#: A holder set's slabs are at most its bytes / (this x owners) (and at least
#: ``SPLIT_BYTES``): with several slabs per owner, heaviest-first assignment balances the
#: owners. 70B-like plan (benchmarks/bench_load_plan.py), max / mean bytes read per rank at
#: DP16 / DP64 with 8 MiB slabs: 2 per owner 1.19 / 1.22, 4: 1.17 / 1.16, 8: 1.10 / 1.16.
SLABS_PER_UNIT = 8


@functools.lru_cache(maxsize=64)
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a neutral dtype name (the checkpoint model's table)."""
    from dcp_reader import TensorMeta

    return TensorMeta("_", (), dtype, ()).itemsize


class PlanBuilder:
    """Accumulates the plan tensor by tensor; ``finish`` orders it (see module docstring).

    ``only``: plan for this rank alone (``_local_plan``): intervals it does not want are
    skipped, items it neither reads, sends nor receives are dropped (their owners and the
    loads they charge are still computed, so every member settles a holder set alike), and
    ``unique`` counts only the intervals it leads (it is their lowest wanting rank).
    """

    def __init__(self, world: int, *, broadcast: bool, hosts: Sequence[str] | None,
                 same_host_reads: bool, split_bytes: int, custom: bool, only: int | None = None):
        self.world, self.broadcast, self.auto = world, broadcast, same_host_reads
        self.only, self._lead = only, True
        self.split_bytes, self.custom = split_bytes, custom
        self.host = list(hosts) if hosts is not None else list(range(world))
        self.loads = [0] * world
        self.unique = 0
        self.broadcasts: list[ReadItem] = []
        self.local: list[ReadItem] = []
        self.candidates: list[ReadItem] = []  # replica groups left to a custom planner
        # holder set -> (owner units, intervals): settled per holder set at the end
        self.groups: dict[tuple[int, ...], tuple[list[list[int]], list[Any]]] = {}
        self._by_host: dict[tuple[int, ...], dict[Any, list[int]]] = {}

    # -- units and sources -------------------------------------------------------------
    def units(self, wanters: Sequence[int]) -> list[list[int]]:
        """The owner units of an interval: per host (auto) or per rank, in rank order."""
        if not self.auto:
            return [[r] for r in wanters]
        return list(self.on_host(tuple(wanters)).values())

    def source(self, ranks: tuple[int, ...], anchor: int) -> int:
        """The holder of ``ranks`` nearest to ``anchor``, preferring ``anchor``'s host."""
        near = self.on_host(ranks).get(self.host[anchor]) or ranks
        i = bisect.bisect_left(near, anchor)
        if i == len(near) or (i > 0 and anchor - near[i - 1] <= near[i] - anchor):
            return near[i - 1]
        return near[i]

    def on_host(self, ranks: tuple[int, ...]) -> dict[Any, list[int]]:
        """``ranks`` by host (each list sorted, hosts in rank order), once per rank set."""
        out = self._by_host.get(ranks)
        if out is None:
            out = self._by_host[ranks] = {}
            for r in ranks:
                out.setdefault(self.host[r], []).append(r)
        return out

    # -- one tensor --------------------------------------------------------------------
    def add_tensor(self, name: str, meta: Any, held: Mapping[tuple[Any, ...], list[Any]]) -> None:
        """Collect the intervals of every box of ``name`` that some rank holds
        (``collect_boxes`` output); boxes only one rank (or no broadcast) needs are planned
        at once, shared ones per holder set in ``settle``."""
        by_chunk: dict[int, list[Piece]] = {}
        for (offsets, sizes, dtype), (ranks, ok) in held.items():
            rank_tuple = tuple(ranks)
            for index, lo, sz in intersect(meta.chunks, offsets, sizes):
                by_chunk.setdefault(index, []).append((lo, sz, dtype, rank_tuple, ok))
        for index in sorted(by_chunk):
            chunk = meta.chunks[index]
            rb = row_bytes(chunk, meta.itemsize)
            for lo, hi, members in intervals(chunk, by_chunk[index]):
                wanters = members[0][3] if len(members) == 1 else tuple(sorted({r for m in members for r in m[3]}))
                if self.only is not None:
                    if self.only not in wanters:
                        continue
                    self._lead = wanters[0] == self.only
                if not (self.broadcast and len(wanters) > 1 and all(m[4] for m in members)):
                    self._slab(name, index, meta, members, lo, hi, None)
                    continue
                group = self.groups.get(wanters)
                if group is None:
                    group = self.groups[wanters] = (self.units(wanters), [])
                group[1].append(((hi - lo) * rb if chunk.sizes else meta.itemsize, name, index, lo, hi,
                                 meta, members, rb if chunk.sizes else 0))

    def _cut(self, n_units: int, intervals: list[Any]) -> list[Any]:
        """A holder set's intervals cut into row slabs of about ``target`` bytes: at least
        ``split_bytes`` and at least the set's bytes / (SLABS_PER_UNIT x units), so the
        owners get several slabs each (balance) without slabs smaller than the fixed costs
        justify. Heaviest first (ties by name, chunk, row)."""
        total = sum(i[0] for i in intervals)
        target = max(self.split_bytes, -(-total // (SLABS_PER_UNIT * n_units)))
        out = []
        for nbytes, name, index, lo, hi, meta, members, rb in intervals:
            parts = max(1, min(-(-nbytes // target), nbytes // self.split_bytes)) if self.split_bytes > 0 and rb else 1
            for a, b in split_rows(lo, hi, parts):
                out.append(((b - a) * rb if rb else nbytes, name, index, a, b, meta, members))
        out.sort(key=lambda s: (-s[0], s[1], s[2], s[3]))
        return out

    def _settle(self, units: list[list[int]], slabs: list[Any]) -> None:
        """Owners of one holder set's slabs: heaviest first to the unit whose ranks read the
        fewest bytes of this set so far (ties to the lower unit); the anchor rotates over
        the unit's ranks. A slab's boxes may be read by ranks of other units (the nearest
        holders), and those ranks' units are charged, so a lazy heap refreshes stale loads."""
        slabs = self._cut(len(units), slabs)
        unit_of = {r: u for u, unit in enumerate(units) for r in unit}
        loads = [0] * len(units)
        heap = [(0, u) for u in range(len(units))]
        taken = [0] * len(units)
        for _, name, index, a, b, meta, members in slabs:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
            u = heap[0][1]
            unit = units[u]
            anchor = unit[taken[u] % len(unit)]
            taken[u] += 1
            for src, stored in self._slab(name, index, meta, members, a, b, anchor):
                loads[unit_of[src]] += stored
            heapq.heapreplace(heap, (loads[u], u))

    def _slab(self, name: str, index: int, meta: Any, members: Sequence[Piece], a: int, b: int,
              anchor: int | None) -> list[tuple[int, int]]:
        """Emit the boxes of rows [a, b); returns (source rank, stored bytes) per broadcast."""
        subs: dict[tuple[Any, ...], list[Any]] = {}
        for piece in members:
            offsets, sizes = sub_box(piece, a, b)
            entry = subs.setdefault((offsets, sizes, piece[2]), [[], True])
            entry[0].append(piece[3])
            entry[1] = entry[1] and piece[4]
        charged = []
        for (offsets, sizes, dtype), (rank_sets, ok) in subs.items():
            # Piece ranks are sorted tuples: one piece needs no merge (the common case).
            ranks = rank_sets[0] if len(rank_sets) == 1 else tuple(sorted(set().union(*rank_sets)))
            got = self._emit(name, index, meta, offsets, sizes, dtype, ranks, ok, anchor)
            if got is not None:
                charged.append(got)
        return charged

    def _emit(self, name: str, index: int, meta: Any, offsets: tuple[int, ...], sizes: tuple[int, ...],
              dtype: str, ranks: tuple[int, ...], ok: bool, anchor: int | None) -> tuple[int, int] | None:
        numel = math.prod(sizes)
        stored = numel * meta.itemsize
        nbytes = numel * (dtype_itemsize(dtype) if dtype else meta.itemsize)
        if self._lead:
            self.unique += stored
        item = ReadItem(name, index, offsets, sizes, nbytes, ranks, None, dtype)
        if anchor is None or not (self.broadcast and ok and len(ranks) > 1):
            self._local(item, ranks, stored)
            return None
        if self.custom:
            if self.auto and len(self.on_host(ranks)) == 1:
                self._local(item, ranks, stored)
            else:
                self.candidates.append(item)
            return None
        src = self.source(ranks, anchor)
        near = self.on_host(ranks)[self.host[src]] if self.auto else [src]
        if len(near) == len(ranks):
            self._local(item, ranks, stored)
            return None
        # src and every holder on another host (``ranks`` is sorted: so is the group)
        group = ranks if len(near) == 1 else tuple(r for r in ranks if r == src or self.host[r] != self.host[src])
        if self.only is None or self.only in group:
            self.broadcasts.append(ReadItem(name, index, offsets, sizes, nbytes, group, src, dtype))
        self.loads[src] += stored
        rest = tuple(r for r in near if r != src)
        if rest:
            self._local(item, rest, stored)
        return src, stored

    def _local(self, item: ReadItem, ranks: tuple[int, ...], stored: int) -> None:
        for r in ranks:
            self.loads[r] += stored
        if self.only is not None and self.only not in ranks:
            return
        self.local.append(ReadItem(item.name, item.chunk, item.offsets, item.sizes, item.nbytes,
                                   ranks, None, item.dtype))

    # -- the end -----------------------------------------------------------------------
    def settle(self) -> None:
        """Choose the owners of every holder set's slabs (in holder-set order)."""
        for key in sorted(self.groups):
            units, slabs = self.groups[key]
            self._lead = self.only is None or key[0] == self.only
            self._settle(units, slabs)
        self.groups.clear()

    def assign_with(self, planner: Planner) -> None:
        """Let ``planner`` choose the reader of every replica group (heaviest first)."""
        groups = sorted(self.candidates, key=lambda i: (-i.nbytes, i.name, i.offsets, i.dtype))
        readers = planner.assign(groups, self.loads)
        if len(readers) != len(groups):
            raise ValueError(f"planner returned {len(readers)} readers for {len(groups)} replica groups")
        for item, reader in zip(groups, readers, strict=True):
            if reader not in item.ranks:
                raise ValueError(f"planner chose reader {reader} for {item.name!r} outside its ranks {item.ranks}")
            self.broadcasts.append(ReadItem(item.name, item.chunk, item.offsets, item.sizes, item.nbytes,
                                            item.ranks, reader, item.dtype))

    def finish(self, tensors: Mapping[str, Any]) -> GlobalPlan:
        """Settle every holder set's owners; the plan in the agreed order: by data file,
        then name, chunk and offsets."""
        self.settle()

        def order(i: ReadItem) -> tuple[Any, ...]:
            return (str(tensors[i.name].chunks[i.chunk].file), i.name, i.chunk, i.offsets, i.dtype)

        self.broadcasts.sort(key=order)
        self.local.sort(key=order)
        return GlobalPlan(self.world, tuple(self.broadcasts), tuple(self.local), tuple(self.loads),
                          self.unique)
