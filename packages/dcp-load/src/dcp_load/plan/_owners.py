"""Who reads what: one owner per shared row interval, and the reader of each box in it.

The rule, computed by every rank alike from the ranks holding one tensor (never from other
tensors, so that a rank can plan only the tensors it holds):

* A row interval of a saved chunk (``_segments.intervals``) that several ranks need, and
  that is broadcastable, is given an owner *unit*: a host when ranks that share a page
  cache re-read from it (``"auto"``), else a rank. All intervals needed by the same set of
  ranks (the holder set: a data-parallel group, say) are given owners together. Every
  member of a holder set holds the same boxes, so each of them computes the same owners
  without knowing anything about other sets.
* When each unit's share of the set's bytes is at least half the smallest slab
  (``split_bytes`` x min(boxes per interval, ``BOXES_PER_SLAB``) / ``BOXES_PER_SLAB``),
  the set's intervals, in (name, chunk, row) order, form one byte stream cut at row
  boundaries into ``STRIPES_PER_UNIT`` equal stripes per unit (fewer when stripes would
  be smaller than the smallest slab, one at least), dealt round robin: every unit reads
  the same bytes to a row.
  Otherwise (little data per unit) each interval is cut into row slabs of at least
  ``split_bytes`` and the slabs go heaviest first to the unit with the fewest bytes of
  that set so far, which spreads small tensors over the units.
* Inside a slab, each box some ranks want is read by the wanting rank nearest (in rank
  order, ties to the lower) to the slab's anchor rank, preferring ranks on the anchor's
  host. So the two column halves of one row slab are read on one host (where both halves
  have a holder), which fetches the slab's pages once; the other holders receive it.
* With ``same_host_reads`` the holders on the reader's host read the box themselves from
  the page cache the reader filled, and only holders on other hosts receive the broadcast.
* With ``relay`` (the checkpoint is in an object store) a slab whose boxes are several
  column boxes of one dtype is read whole by one rank: a holder of any of its boxes on the
  anchor's host (``RELAYS_PER_HOST``). It broadcasts each box to its holders, relaying those
  it does not hold (``ReadItem.relay``). A column box's rows are interleaved with the other columns in
  the file, so read by its own holders each slab costs a GET per row or fetches the other
  columns too; read whole by one rank it is one range of a few GETs, fetched once.

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

from ..layouts._boxes import intersect
from ._items import GlobalPlan, Planner, ReadItem
from ._segments import Piece, intervals, row_bytes, split_rows, stripe_rows

__all__ = ["BOXES_PER_SLAB", "SLABS_PER_UNIT", "STRIPES_PER_UNIT", "PlanBuilder"]

#: In a holder set with little data per owner (``_heaviest_first``), slabs are at most its
#: bytes / (this x owners) (and at least ``split_bytes``): with several slabs per owner,
#: heaviest-first assignment balances the owners. Measured before sets with more data were
#: dealt in stripes, 70B-like plan (benchmarks/load/bench_load_plan.py), max / mean bytes read per rank at
#: DP16 / DP64 with 8 MiB slabs: 2 per owner 1.19 / 1.22, 4: 1.17 / 1.16, 8: 1.10 / 1.16.
SLABS_PER_UNIT = 8

#: The smallest slab of a shared interval is ``split_bytes`` x min(its boxes, this) / this:
#: each rank's box of a slab is at least ``split_bytes`` / 8 (1 MiB by default), the size
#: the boxes of an 8 MiB row-parallel slab at TP8 already have. A holder set of one box per
#: interval (a column-parallel weight's data-parallel replicas) is then cut finer when its
#: members are many: 70B-like plan at 16,384 ranks (benchmarks/load/bench_derive_plan.py), such
#: sets hold ~6 MiB per member, under one 8 MiB slab.
BOXES_PER_SLAB = 8

#: Equal stripes per unit when a holder set's bytes are dealt (``_deal``): one stripe each
#: already balances to a row, but then each unit's reads are one block of the broadcast
#: walk, and the walk waits for the first block's whole read; with 4, for a quarter of it.
#: 70B-like plan (benchmarks/load/bench_derive_plan.py), 1,024 / 4,096 / 16,384 ranks: max/mean
#: bytes read per rank 1.089 / 1.090 / 1.092 with 1 stripe, 1.090 / 1.091 / 1.096 with 4
#: (the stages' own imbalance is 1.089); broadcasts per rank 122 / 218 / 601 with 1,
#: 218 / 601 / 1,625 with 4 (heaviest-first 8 MiB slabs: 312 / 752 / 952, balance
#: 1.125 / 1.128 / 1.351).
STRIPES_PER_UNIT = 4

#: Ranks of one host that read and relay the column-sharded slabs of a holder set on object
#: storage (``_relayed``): each relayed box's group is its holders and its relaying rank,
#: so the groups a load creates grow with this number, and the slabs' reads and sends
#: spread over it. Llama-8B on 8-rank hosts, most groups per rank (plan only): TP8 x DP8 10
#: with 1, 18 with 2, 65 with every holder relaying. 4 ranks on one host loading 294 MiB
#: from moto (benchmarks/storage/bench_s3.py --gib 0.25 --runs dcp:tp, alternating): 5.36 / 4.08 s
#: with 1, 6.08 / 4.27 s with 2: no difference above the noise (one rank's 8 readers keep
#: 40 GETs in flight), so the fewest groups.
RELAYS_PER_HOST = 1


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
                 same_host_reads: bool, split_bytes: int, custom: bool, only: int | None = None,
                 relay: bool = False):
        self.world, self.broadcast, self.auto = world, broadcast, same_host_reads
        # whole rows by one rank, the others' columns relayed (object storage: ``_relayed``)
        self.relay = relay and broadcast and not same_host_reads and not custom
        self.only, self._lead = only, True
        self.split_bytes, self.custom = split_bytes, custom
        # Any sequence (``HostBlocks`` computes a host arithmetically): never copied, since
        # a rank-local plan must not cost O(world).
        self.host: Sequence[Any] = hosts if hosts is not None else range(world)
        self.loads = [0] * world
        self.unique = 0
        self.fetched = 0
        self.broadcasts: list[ReadItem] = []
        self.local: list[ReadItem] = []
        self.candidates: list[ReadItem] = []  # replica groups left to a custom planner
        # holder set -> (owner units, intervals): settled per holder set at the end
        self.groups: dict[tuple[int, ...], tuple[list[list[int]], list[Any]]] = {}
        # Rank sets are interned (one tuple object per distinct set, kept alive here) and
        # their per-host split cached by id: hashing a 2,048-rank tuple costs ~10 us, and a
        # rank of a 16k-rank job looks a stage-wide set up once per box it plans.
        self._sets: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._seen: dict[int, tuple[Sequence[int], tuple[int, ...]]] = {}
        self._by_host: dict[int, dict[Any, list[int]]] = {}
        self._unions: dict[tuple[int, ...], tuple[int, ...]] = {}

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
        """``ranks`` (an interned set) by host (each list sorted, hosts in rank order)."""
        out = self._by_host.get(id(ranks))
        if out is None:
            out = self._by_host[id(ranks)] = {}
            host = self.host
            for r in ranks:
                out.setdefault(host[r], []).append(r)
        return out

    def intern(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The one tuple object standing for this rank set (``on_host`` keys on its id).
        Looked up by the id of the caller's object first: derived boxes share their holder
        tuples across tensors of one layout, so most lookups hash nothing."""
        seen = self._seen.get(id(ranks))
        if seen is not None and seen[0] is ranks:
            return seen[1]
        key = tuple(ranks)
        out = self._sets.setdefault(key, key)
        self._seen[id(ranks)] = (ranks, out)  # holds ``ranks``: its id stays its own
        return out

    def _union(self, members: Sequence[Piece]) -> tuple[int, ...]:
        """The interned union of the pieces' (interned) rank sets."""
        return self._union_of([m[3] for m in members])

    def _mine(self, ranks: Sequence[int]) -> bool:
        """Whether this builder's rank (``only``) is in the sorted ``ranks`` (or no ``only``)."""
        return self.only is None or self._mine_of(ranks, self.only)

    # -- one tensor --------------------------------------------------------------------
    def add_tensor(self, name: str, meta: Any, held: Mapping[tuple[Any, ...], list[Any]]) -> None:
        """Collect the intervals of every box of ``name`` that some rank holds
        (``collect_boxes`` output); boxes only one rank (or no broadcast) needs are planned
        at once, shared ones per holder set in ``settle``."""
        by_chunk: dict[int, list[Piece]] = {}
        for (offsets, sizes, dtype), (ranks, ok) in self._relevant(held):
            rank_tuple = self.intern(ranks)
            for index, lo, sz in intersect(meta.chunks, offsets, sizes):
                by_chunk.setdefault(index, []).append((lo, sz, dtype, rank_tuple, ok))
        itemsize = meta.itemsize
        for index in sorted(by_chunk):
            chunk = meta.chunks[index]
            rb = row_bytes(chunk, itemsize)
            for lo, hi, members in intervals(chunk, by_chunk[index]):
                wanters = members[0][3] if len(members) == 1 else self._union(members)
                if self.only is not None:
                    if not self._mine(wanters):
                        continue
                    self._lead = wanters[0] == self.only
                boxes = self._boxes(members, itemsize)
                if not (self.broadcast and len(wanters) > 1 and all(m[4] for m in members)):
                    self._rows(name, index, boxes, lo, hi, None)
                    continue
                group = self.groups.get(wanters)
                if group is None:
                    group = self.groups[wanters] = (self.units(wanters), [])
                group[1].append(((hi - lo) * rb if chunk.sizes else itemsize, name, index, lo, hi, boxes,
                                 rb if chunk.sizes else 0))

    def _relevant(self, held: Mapping[tuple[Any, ...], Any]) -> Any:
        """``held``'s items that can share a row interval with a box ``only`` holds: the
        others' intervals are not this rank's, and their cuts fall outside its boxes' rows
        (a piece that cuts inside a row range overlaps it), so they are skipped before any
        intersecting. A rank of a TP8 job so skips 7 of 8 column-parallel boxes."""
        if self.only is None:
            return held.items()
        rows = [(o[0], o[0] + s[0]) if s else None for (o, s, _), (ranks, _) in held.items() if self._mine(ranks)]
        if None in rows:  # a 0-dim box: every box of the tensor is one interval
            return held.items()
        return [(key, value) for key, value in held.items()
                if any(lo < key[0][0] + key[1][0] and key[0][0] < hi for lo, hi in rows)]

    def _boxes(self, members: Sequence[Piece], itemsize: int) -> list[tuple[Any, ...]]:
        """The distinct boxes of an interval's pieces, each as it is cut into any of its row
        slabs: (offsets and sizes past dim 0, dtype, ranks, broadcastable, stored and
        destination bytes per row, whether ``only`` is one of the ranks). Pieces that cover
        the interval with the same columns and dtype (two boxes cut to one chunk) merge."""
        merged: dict[tuple[Any, ...], list[Any]] = {}
        for offsets, sizes, dtype, ranks, ok in members:
            entry = merged.setdefault((offsets[1:], sizes[1:], dtype, not sizes), [[], True])
            entry[0].append(ranks)
            entry[1] = entry[1] and ok
        out = []
        for (tail_o, tail_s, dtype, scalar), (rank_sets, ok) in merged.items():
            # Piece ranks are sorted tuples: one piece needs no merge (the common case).
            ranks = rank_sets[0] if len(rank_sets) == 1 else self.intern(tuple(sorted(set().union(*rank_sets))))
            per_row = math.prod(tail_s)
            out.append((tail_o, tail_s, dtype, ranks, ok, per_row * itemsize,
                        per_row * (dtype_itemsize(dtype) if dtype else itemsize), self._mine(ranks), scalar))
        return out

    def _cut(self, n_units: int, intervals: list[Any]) -> list[Any]:
        """A holder set's intervals cut into row slabs of about ``target`` bytes: at least
        ``split_bytes`` and at least the set's bytes / (SLABS_PER_UNIT x units), so the
        owners get several slabs each (balance) without slabs smaller than the fixed costs
        justify. Heaviest first (ties by name, chunk, row)."""
        total = sum(i[0] for i in intervals)
        target = max(self.split_bytes, -(-total // (SLABS_PER_UNIT * n_units)))
        out = []
        for nbytes, name, index, lo, hi, boxes, rb in intervals:
            parts = max(1, min(-(-nbytes // target), nbytes // self.split_bytes)) if self.split_bytes > 0 and rb else 1
            for a, b in split_rows(lo, hi, parts):
                out.append(((b - a) * rb if rb else nbytes, name, index, a, b, boxes))
        out.sort(key=lambda s: (-s[0], s[1], s[2], s[3]))
        return out

    def _settle(self, units: list[list[int]], intervals: list[Any]) -> None:
        """Owners of one holder set's intervals: equal stripes dealt to the units when each
        unit's share is at least half the smallest slab (``_deal``; a stripe is never
        smaller), else heaviest slab first to the least loaded unit (``_heaviest_first``)."""
        total = sum(i[0] for i in intervals)
        widest = max(len(i[5]) for i in intervals)
        smallest = self.split_bytes * min(widest, BOXES_PER_SLAB) // BOXES_PER_SLAB
        share = total // len(units)
        if self.split_bytes > 0 and smallest > 0 and 2 * share >= smallest:
            self._deal(units, intervals, total, max(1, min(STRIPES_PER_UNIT, share // smallest)) * len(units))
        else:
            self._heaviest_first(units, intervals)

    def _deal(self, units: list[list[int]], intervals: list[Any], total: int, stripes: int) -> None:
        """The set's intervals, in (name, chunk, row) order, as one byte stream cut into
        ``stripes`` equal stripes at row boundaries; stripe j goes to unit j mod units. So
        every unit reads the same bytes (to a row) and its stripes are spread over the
        stream, as the broadcasts are walked. A stripe crossing intervals is one slab in
        each; the anchor rotates over the unit's ranks."""
        taken = [0] * len(units)
        start = 0
        for nbytes, name, index, lo, hi, boxes, rb in sorted(intervals, key=lambda i: (i[1], i[2], i[3])):
            for a, b, stripe in stripe_rows(start, nbytes, lo, hi, rb, total, stripes):
                u = stripe % len(units)
                unit = units[u]
                self._rows(name, index, boxes, a, b, unit[taken[u] % len(unit)])
                taken[u] += 1
            start += nbytes

    def _heaviest_first(self, units: list[list[int]], intervals: list[Any]) -> None:
        """Owners of a holder set with little data per unit: slabs (``_cut``) heaviest
        first to the unit whose ranks read the fewest bytes of this set so far (ties to the
        lower unit); the anchor rotates over the unit's ranks. A slab's boxes may be read
        by ranks of other units (the nearest holders), and those ranks' units are charged,
        so a lazy heap refreshes stale loads."""
        slabs = self._cut(len(units), intervals)
        unit_of = {r: u for u, unit in enumerate(units) for r in unit}
        loads = [0] * len(units)
        heap = [(0, u) for u in range(len(units))]
        taken = [0] * len(units)
        for _, name, index, a, b, boxes in slabs:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
            u = heap[0][1]
            unit = units[u]
            anchor = unit[taken[u] % len(unit)]
            taken[u] += 1
            for src, stored in self._rows(name, index, boxes, a, b, anchor):
                loads[unit_of[src]] += stored
            heapq.heapreplace(heap, (loads[u], u))

    def _rows(self, name: str, index: int, boxes: Sequence[tuple[Any, ...]], a: int, b: int,
              anchor: int | None) -> list[tuple[int, int]]:
        """Emit the boxes of rows [a, b) (see module docstring); returns (source rank,
        stored bytes) per broadcast. The hot loop of planning: a stage-wide holder set of a
        16k-rank job passes here ~6,000 times per rank, so it avoids per-box allocations
        for boxes this rank (``only``) has no part in."""
        charged: list[tuple[int, int]] = []
        if self.relay and anchor is not None and self._relayable(boxes):
            return self._relayed(name, index, boxes, a, b, anchor)
        anchor_host = self.host[anchor] if anchor is not None else None
        rows = b - a
        fast = anchor is not None and self.broadcast and not self.custom
        lead, loads = self._lead, self.loads
        for tail_o, tail_s, dtype, ranks, ok, row_stored, row_nbytes, mine, scalar in boxes:
            stored, nbytes = (row_stored, row_nbytes) if scalar else (rows * row_stored, rows * row_nbytes)
            if lead:
                self.unique += stored
            if fast and ok and len(ranks) > 1:
                by_host = self.on_host(ranks)
                near = by_host.get(anchor_host)
                if near is not None and len(near) == 1:  # the common case, in short
                    src = near[0]  # the one holder on the anchor's host: it sends to all others
                    if lead:
                        self.fetched += stored
                    loads[src] += stored
                    charged.append((src, stored))
                    if mine:
                        offsets, sizes = (tail_o, tail_s) if scalar else ((a, *tail_o), (rows, *tail_s))
                        self.broadcasts.append(ReadItem(name, index, offsets, sizes, nbytes, ranks, src, dtype))
                    continue
                src = self._nearest(near or ranks, anchor)
                home = anchor_host if near else self.host[src]
                if not self.auto:
                    near = [src]
                elif not near:
                    near = by_host[home]
                box = None if not mine else (tail_o, tail_s) if scalar else ((a, *tail_o), (rows, *tail_s))
                if len(near) < len(ranks):
                    self._broadcast(name, index, box, nbytes, dtype, ranks, src, home, near, stored)
                    charged.append((src, stored))
                else:  # every holder is on src's host: each reads it, src fetches (and verifies)
                    self._local(name, index, box, nbytes, dtype, ranks, stored, 1, fetcher=src)
                continue
            box = (tail_o, tail_s) if scalar else ((a, *tail_o), (rows, *tail_s))
            shared = anchor is not None and self.broadcast and ok and len(ranks) > 1
            if shared and self.custom and not (self.auto and len(self.on_host(ranks)) == 1):
                self.fetched += stored  # read once by the reader the planner chooses
                self.candidates.append(ReadItem(name, index, box[0], box[1], nbytes, ranks, None, dtype))
                continue
            self._local(name, index, box, nbytes, dtype, ranks, stored, len(self.on_host(ranks)))
        return charged

    @staticmethod
    def _relayable(boxes: Sequence[tuple[Any, ...]]) -> bool:
        """Whether a slab's boxes are column boxes one rank can read as whole rows: several,
        every one broadcastable, of rows (not 0-dim), in one destination dtype."""
        return len(boxes) > 1 and all(bx[4] and not bx[8] and bx[2] == boxes[0][2] for bx in boxes)

    def _relayed(self, name: str, index: int, boxes: Sequence[tuple[Any, ...]], a: int, b: int,
                 anchor: int) -> list[tuple[int, int]]:
        """Rows [a, b) of a column-sharded chunk on object storage: one holder of the slab's
        boxes on ``anchor``'s host, the lowest, reads every box (its reads of one slab are
        one range of whole rows, a few GETs with no byte fetched twice) and broadcasts each
        to its holders; a box it does not hold it relays (``ReadItem.relay``). One relaying
        rank per host (``RELAYS_PER_HOST``) keeps the groups few: each relayed box's group
        is its holders and that rank."""
        union = self._union_of([bx[3] for bx in boxes])
        near = self.on_host(union).get(self.host[anchor])
        if near:  # anchor is one of them: the anchors rotate, so do the relaying ranks
            src = near[bisect.bisect_left(near, anchor) % min(len(near), RELAYS_PER_HOST)]
        else:
            src = self._nearest(union, anchor)
        charged = []
        rows = b - a
        for tail_o, tail_s, dtype, ranks, _, row_stored, row_nbytes, mine, _ in boxes:
            stored = rows * row_stored
            if self._lead:
                self.unique += stored
                self.fetched += stored
            self.loads[src] += stored
            charged.append((src, stored))
            relay = not self._mine_of(ranks, src)
            if mine or self.only == src:
                group = self.intern(tuple(sorted((*ranks, src)))) if relay else ranks
                self.broadcasts.append(ReadItem(name, index, (a, *tail_o), (rows, *tail_s), rows * row_nbytes, group,
                                                src, dtype, relay=relay))
        return charged

    def _union_of(self, rank_sets: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """The interned union of interned rank sets (cached by their ids)."""
        key = tuple(sorted({id(r) for r in rank_sets}))
        out = self._unions.get(key)
        if out is None:
            out = self._unions[key] = self.intern(tuple(sorted({r for ranks in rank_sets for r in ranks})))
        return out

    @staticmethod
    def _mine_of(ranks: Sequence[int], rank: int) -> bool:
        """Whether ``rank`` is in the sorted ``ranks``."""
        i = bisect.bisect_left(ranks, rank)
        return i < len(ranks) and ranks[i] == rank

    @staticmethod
    def _nearest(near: Sequence[int], anchor: int) -> int:
        """The rank of sorted ``near`` nearest to ``anchor`` (ties to the lower)."""
        if len(near) == 1:
            return near[0]
        i = bisect.bisect_left(near, anchor)
        if i == len(near) or (i > 0 and anchor - near[i - 1] <= near[i] - anchor):
            return near[i - 1]
        return near[i]

    def _broadcast(self, name: str, index: int, box: tuple[Any, ...] | None, nbytes: int, dtype: str,
                   ranks: tuple[int, ...], src: int, home: Any, near: Sequence[int], stored: int) -> None:
        """``src`` reads ``box`` and broadcasts it to the holders on other hosts; the others
        on ``home`` (``near``) read the page cache src filled. ``box``: None when ``only``
        is not among ``ranks``."""
        if self._lead:
            self.fetched += stored
        loads = self.loads
        loads[src] += stored
        rest = tuple(r for r in near if r != src) if len(near) > 1 else ()
        for r in rest:
            loads[r] += stored
        if box is None:
            return
        only = self.only
        sent = only is None or only == src or not rest or self.host[only] != home
        if sent:
            self.broadcasts.append(ReadItem(name, index, box[0], box[1], nbytes, self._group(ranks, src, near),
                                            src, dtype))
        if rest and (only is None or not sent):  # then ``only`` is one of ``rest``
            self.local.append(ReadItem(name, index, box[0], box[1], nbytes, rest, None, dtype, cached=True))

    @staticmethod
    def _group(ranks: tuple[int, ...], src: int, near: Sequence[int]) -> tuple[int, ...]:
        """``src`` and every holder on another host (``ranks`` is sorted: so is the group)."""
        if len(near) == 1:
            return ranks
        i, j = bisect.bisect_left(ranks, near[0]), bisect.bisect_right(ranks, near[-1])
        if j - i == len(near):  # src's host is one run of ranks (contiguous hosts): slice
            return (*ranks[:i], src, *ranks[j:])
        skip = set(near) - {src}
        return tuple(r for r in ranks if r not in skip)

    def _local(self, name: str, index: int, box: tuple[Any, ...] | None, nbytes: int, dtype: str,
               ranks: tuple[int, ...], stored: int, hosts: int, fetcher: int | None = None) -> None:
        """Every rank of ``ranks`` reads ``box`` itself; ``hosts``: how many of them fetch it
        from storage (the others read a page cache). ``fetcher``: the one rank that fetches
        it for a host all of ``ranks`` share: its item is its own, the others' is ``cached``."""
        loads = self.loads
        for r in ranks:
            loads[r] += stored
        if self._lead:
            self.fetched += stored * hosts
        if box is None or not self._mine(ranks):
            return
        if fetcher is None:
            self.local.append(ReadItem(name, index, box[0], box[1], nbytes, ranks, None, dtype))
            return
        rest = tuple(r for r in ranks if r != fetcher)
        if self.only is None or self.only == fetcher:
            self.local.append(ReadItem(name, index, box[0], box[1], nbytes, (fetcher,), None, dtype))
        if self.only is None or self.only != fetcher:
            self.local.append(ReadItem(name, index, box[0], box[1], nbytes, rest, None, dtype, cached=True))

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
                          self.unique, self.fetched, self.only)
