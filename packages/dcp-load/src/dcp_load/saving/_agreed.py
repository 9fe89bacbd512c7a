"""Agreeing on a save's layout without gathering, when the ranks hold what they held before.

A training job saves the same state (the same names, boxes, dtypes and shapes on every
rank) every few hundred steps, and each ``save`` gathered every rank's holdings to derive
the layout (one writer per distinct box). The layout depends on nothing else, so a process
remembers what was gathered for its last agreed saves (``_REMEMBERED``, at most
``REMEMBERED`` of them, keyed by this rank's own holdings) and the next save first makes one
fixed-size SUM all-reduce instead (``start``; ``async_save`` copies the boxes it wrote last
time while the reduction runs): each rank adds

* whether anything failed here (rank 0: the lock, the values),
* whether it remembers a gathering whose entry for this rank is what it holds now, and the
  digest of that whole gathering (``plan._digest.equal_lanes``: equal on every rank exactly
  when each chunk's sum of squares times the world equals its sum squared),
* the digest of the directory it resolved, and rank 0 alone its new save id.

When every rank remembers one gathering and names one directory, every rank's holdings are
those of that gathering (each rank checked its own entry), so the layout derived from it is
the one a new gathering would give: it is used with rank 0's save id. Otherwise (a rank
changed what it holds, a first save, a failure) every rank reads the same sums and goes on
to the full exchange, which names the failures. Each rank sends 8 bytes per lane whatever
the world size (17 lanes, 136 bytes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..plan._digest import all_equal, digest, equal_lanes, start_all_reduce

__all__ = ["REMEMBERED", "Pending", "forget", "remember", "start"]

#: Gatherings a process keeps (a model-only and a full save alternating fit, with room).
REMEMBERED = 4
_SAVE_ID_HEX = 12  # ``_save._new_save_id``: 48 random bits
_ID_CHUNK = 16  # the id as three 16-bit lanes (only rank 0 adds them, so the sum is its id)

_LOCK = threading.Lock()
#: (world, rank, this rank's holdings key) -> (digest of the gathering, the gathering, the
#: items this rank wrote in it)
_REMEMBERED: OrderedDict[tuple[int, int, int], tuple[int, list[tuple[Any, Any]], list[Any]]] = OrderedDict()


def _own_key(world: int, rank: int, holdings: list[Any], values: list[str]) -> tuple[int, int, int]:
    return world, rank, digest(holdings, values)


def _gathered_digest(gathered: list[tuple[Any, Any]]) -> int:
    return digest(gathered)


def remember(world: int, rank: int, gathered: list[Any], mine: list[Any]) -> None:
    """Keep the holdings of an agreed save (``gathered``: every rank's exchange payload,
    ``(holdings, value names, save id, directory)``) and what this rank wrote in it
    (``mine``: its ``ReadItem``s) for the next save of this process."""
    kept = [(list(h), list(v)) for h, v, *_ in gathered]
    key = _own_key(world, rank, *kept[rank])
    with _LOCK:
        _REMEMBERED[key] = (_gathered_digest(kept), kept, list(mine))
        _REMEMBERED.move_to_end(key)
        while len(_REMEMBERED) > REMEMBERED:
            _REMEMBERED.popitem(last=False)


def forget() -> None:
    """Drop every remembered gathering (the next save of each kind gathers again)."""
    with _LOCK:
        _REMEMBERED.clear()


class Pending:
    """The all-reduce of ``start`` in flight. ``guess``: the items this rank wrote in the
    gathering it remembers for what it holds now (the others most likely hold what they
    held then too), or None; ``result()``
    waits, then returns the gathering every rank would send now (rank 0's save id and
    ``path`` filled in) when every rank remembers that one, else None (every rank gets the
    same answer, so all go on to the full exchange together). Call ``result()`` exactly
    once, on failure too: the collective is in flight on every rank."""

    def __init__(self, found: tuple[Any, ...] | None, wait: Any, world: int, path: str):
        self._found, self._wait, self._world, self._path = found, wait, world, path
        self.guess: list[Any] | None = None if found is None else found[2]

    def result(self) -> list[Any] | None:
        sums = self._wait()
        if sums[0] or sums[1] != self._world or not all(all_equal(sums[2:14], self._world)):
            return None
        assert self._found is not None  # every rank remembered the gathering, this one too
        new_id = format(sum(v << (_ID_CHUNK * k) for k, v in enumerate(sums[14:17])), f"0{_SAVE_ID_HEX}x")
        return [(list(h), list(v), new_id, self._path) for h, v in self._found[1]]


def start(platform: Any, watch: Any, *, world: int, rank: int, holdings: list[Any], values: list[str], path: str,
          save_id: str | None, failed: bool) -> Pending:
    """Begin the one all-reduce of the module docstring; the caller may stage ``guess``'s
    boxes meanwhile."""
    with _LOCK:
        found = _REMEMBERED.get(_own_key(world, rank, holdings, values))
    hit = found is not None and not failed
    whole = found[0] if hit else digest("none", rank)  # a rank-distinct value: never equal to a hit
    sid = int(save_id, 16) if rank == 0 and save_id else 0
    ids = [(sid >> (_ID_CHUNK * k)) & ((1 << _ID_CHUNK) - 1) for k in range(3)]
    lanes = [int(failed), int(hit), *equal_lanes([whole, digest(path)]), *ids]
    return Pending(found if hit else None, start_all_reduce(platform, lanes, "sum", watch), world, path)
