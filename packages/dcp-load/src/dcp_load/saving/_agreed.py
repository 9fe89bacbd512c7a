"""Agreeing on a save's layout without gathering, when the ranks hold what they held before.

A training job saves the same state (the same names, boxes, dtypes and shapes on every
rank) every few hundred steps, and each ``save`` gathered every rank's holdings to derive
the layout (one writer per distinct box). The layout depends on nothing else, so every rank
keeps the same list of the job's last ``REMEMBERED`` agreed layouts (``_REMEMBERED``, one
list per process group the saves run within, oldest first; every rank appends, reuses and drops entries alike, so positions match across
ranks), and the next save first makes one fixed-size SUM all-reduce (``start``;
``async_save`` copies the boxes it wrote last time while the reduction runs). Each rank adds

* whether anything failed here (rank 0: the lock, the values),
* per remembered layout k: whether what this rank holds now is what it held in k, and the
  digest of k's whole gathering (``plan._digest.equal_lanes``: equal on every rank exactly
  when each chunk's sum of squares times the world equals its sum squared),
* the digest of the directory it resolved, and rank 0 alone its new save id.

The newest k that every rank holds as it did, with one digest on every rank, is the layout
a new gathering would give (each rank checked its own part), so it is used with rank 0's
save id. Otherwise (a first save, a change, a failure, directories that differ) every rank
reads the same sums and goes on to the full exchange, which names the failures. Each rank
sends 8 bytes per lane, ``10 + 7 * REMEMBERED`` lanes (38) whatever the world size.

What an entry keeps: digests, the items this rank wrote and, on rank 0 only, the tensor
metadata it committed; never the other ranks' holdings.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from ..plan._digest import all_equal, digest, equal_lanes, start_all_reduce

__all__ = ["REMEMBERED", "Agreed", "Pending", "remember", "renamed", "start"]

#: Layouts every rank keeps (a model-only and a full save alternating fit, with room).
REMEMBERED = 4
_SAVE_ID_HEX = 12  # ``_save._new_save_id``: 48 random bits
_ID_CHUNK = 16  # the id as three 16-bit lanes (only rank 0 adds them, so the sum is its id)

_LOCK = threading.Lock()


@dataclass(frozen=True)
class Agreed:
    """One agreed layout as this rank keeps it."""

    world: int
    rank: int
    own: int  # digest of what this rank held (holdings, value names)
    whole: int  # digest of every rank's holdings
    mine: tuple[Any, ...]  # the ReadItems this rank wrote
    n_tensors: int
    job_bytes: int
    save_id: str  # the save that agreed it (its id names the files in ``tensors``)
    tensors: dict[str, Any] | None  # rank 0: the tensor metadata it committed; else None


_REMEMBERED: dict[str, list[Agreed]] = {}  # per process group (``Platform.group_key``)


def _kept(scope: str) -> list[Agreed]:
    return _REMEMBERED.setdefault(scope, [])


def own_digest(holdings: list[Any], values: list[str]) -> int:
    return digest([tuple(h) for h in holdings], list(values))


def remember(world: int, rank: int, gathered: list[Any], tensors: dict[str, Any], mine: list[Any],
             save_id: str, scope: str = "world") -> None:
    """Keep the layout of a save every rank agreed by a full exchange (``gathered``: every
    rank's payload ``(holdings, value names, save id, directory, format)``); every rank calls it."""
    whole = digest([([tuple(h) for h in hs], list(v)) for hs, v, *_ in gathered])
    entry = Agreed(world, rank, own_digest(*gathered[rank][:2]), whole, tuple(mine), len(tensors),
                   sum(t.nbytes for t in tensors.values()), save_id, tensors if rank == 0 else None)
    with _LOCK:
        kept = _kept(scope)
        kept[:] = [e for e in kept if e.whole != whole][-(REMEMBERED - 1):] + [entry]


class Pending:
    """The all-reduce of ``start`` in flight. ``guess``: the items this rank wrote in the
    newest layout it holds as it did (the others most likely do too), or None. Call
    ``result()`` exactly once, on failure too: the collective is in flight on every rank."""

    def __init__(self, kept: list[Agreed], hits: list[bool], reduction: Any, world: int, scope: str = "world"):
        self._kept, self._reduction, self._world, self._scope = kept, reduction, world, scope
        self._missed: bool | None = None
        newest = max((k for k, hit in enumerate(hits) if hit), default=None)
        self.guess: list[Any] | None = None if newest is None else list(kept[newest].mine)

    def missed(self) -> bool:
        """Without waiting: the reduction completed and ``guess`` is not what it agreed."""
        if self._missed is None and self._reduction.ready():
            chosen = self._choose(self._reduction.result())
            self._missed = chosen is None or list(chosen.mine) != self.guess
        return bool(self._missed)

    def _choose(self, sums: list[int]) -> Agreed | None:
        n, world = REMEMBERED, self._world
        equal = all_equal(sums[1 + n:1 + n + 6 * (n + 1)], world)
        if sums[0] or not equal[n]:  # a failure, or directories that differ
            return None
        for k in range(len(self._kept) - 1, -1, -1):
            if sums[1 + k] == world and equal[k]:
                return self._kept[k]
        return None

    def result(self) -> tuple[Agreed, str] | None:
        """(the layout every rank agreed, rank 0's new save id), or None: gather."""
        sums = self._reduction.result()
        chosen = self._choose(sums)
        if chosen is None:
            return None
        at = 1 + REMEMBERED + 6 * (REMEMBERED + 1)
        new_id = format(sum(v << (_ID_CHUNK * k) for k, v in enumerate(sums[at:at + 3])), f"0{_SAVE_ID_HEX}x")
        with _LOCK:  # every rank moves the same entry to the newest place
            kept = _kept(self._scope)
            if chosen in kept:
                kept.remove(chosen)
                kept.append(chosen)
        return chosen, new_id


def start(platform: Any, watch: Any, *, world: int, rank: int, holdings: list[Any], values: list[str], path: str,
          save_id: str | None, failed: bool, scope: str = "world") -> Pending:
    """Begin the one all-reduce of the module docstring; the caller may copy ``guess``'s
    boxes meanwhile. ``scope``: whose layouts to look in (a group and a format: a layout
    remembered for one format names files of that format)."""
    own = own_digest(holdings, values)
    with _LOCK:
        kept = list(_kept(scope))
    hits = [not failed and e.world == world and e.rank == rank and e.own == own for e in kept]
    hits += [False] * (REMEMBERED - len(kept))
    wholes = [e.whole for e in kept] + [digest("none", rank, k) for k in range(len(kept), REMEMBERED)]
    sid = int(save_id, 16) if rank == 0 and save_id else 0
    ids = [(sid >> (_ID_CHUNK * k)) & ((1 << _ID_CHUNK) - 1) for k in range(3)]
    lanes = [int(failed), *map(int, hits), *equal_lanes([*wholes, digest(path)]), *ids]
    return Pending(kept, hits, start_all_reduce(platform, lanes, "sum", watch), world, scope)


def renamed(tensors: dict[str, Any], old_id: str, new_id: str) -> dict[str, Any]:
    """``tensors`` with each chunk's file named for the save ``new_id`` instead of ``old_id``."""
    return {n: dataclasses.replace(t, chunks=tuple(dataclasses.replace(c, file=c.file.replace(old_id, new_id))
                                                   for c in t.chunks))
            for n, t in tensors.items()}
