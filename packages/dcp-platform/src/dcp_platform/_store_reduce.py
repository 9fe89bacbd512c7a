"""A small reduction through the key-value store instead of the process group.

A gloo all-reduce of a few int64 lanes is a ring of ``2 (world - 1)`` steps, each a wake-up
of another process's gloo threads. On the 2-core development machine (4 gloo ranks, medians
of 60, slowest rank, ``benchmarks/bench_control.py``) an all-reduce of 40 lanes took 7.6 ms,
of 4 lanes 3.9 ms, of 1 lane 1.0 ms; on 2 ranks 0.5-0.7 ms. Through the store each rank makes a few
requests to one server instead: it writes its lanes under its own key and counts itself in;
the last to count in reads every rank's lanes (one ``multi_get``), reduces them and writes
the result; the others poll for it. What each rank sends stays a few bytes; the last rank
reads ``world`` values, so ``Watch`` uses this for small worlds only (``STORE_REDUCE_MAX``).

Keys, under the watch's name: ``r/<n>/<rank>`` (each rank's lanes; removed by their rank once
the result is out), ``r/<n>/in`` (the count in), ``r/<n>/out`` (the result) and ``r/<n>/read``
(the count of ranks that read it: the last removes ``in``, ``out`` and ``read``). ``n`` counts
the reductions of one operation: every rank makes them in the same order, as it would make
collectives.

Polls: the first after ``first_pause(world)``, each pause twice the last up to
``world * POLL_CAP_PER_RANK_S`` (0.5 ms on 2 ranks, 8 ms on 32): the ranks of one reduction
poll the store at most ~4,000 times a second together. Past that, the cap grows with the
wait, to ``LATE_SHARE`` of the time waited so far (at most ``PAUSE_MAX_S``): a rank that
waits long for a slow one (a load's closing check behind the rank with the most to read)
learns of the result at most ~5 % late and polls ~20 times per doubling of its wait, where
a fixed 1 ms cap cost 0.05 s of CPU per 1.4 s waited (4 ranks).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from .codec import PREFIX, ControlMessageError

__all__ = ["POLL_CAP_PER_RANK_S", "STORE_LANES_MAX", "STORE_REDUCE_MAX", "StoreReduction"]

#: Worlds up to this size reduce through the store (``Watch.start_reduce``). The last rank's
#: ``multi_get`` and the ``6 * world`` requests of a reduction grow with the world, the gloo
#: ring's steps too; measured on the 2-core machine (``benchmarks/bench_control.py``, 40
#: lanes, slowest rank): the store took 0.50 / 1.3 / 3.0 / 6.4 ms on 2 / 4 / 8 / 16 ranks
#: where gloo took 0.71 / 7.6 / 20 / 48 ms: the gain grew with the world. 32 ranks were not
#: measured here; at 32 the last rank reads 32 short values and the polls stay ~4,000 a second.
STORE_REDUCE_MAX = 32
#: Reductions of more lanes all-reduce on the process group: the lanes travel as text and
#: the last rank folds them in Python, so the store's cost grows with them where gloo's
#: hardly does (2-core machine, medians of 15: 4 ranks, 2,000 lanes, store 4.9-5.8 ms
#: against gloo 5.2-6.0; 20,000 lanes 39-45 against 11-13 ms; 2 ranks, 5,000 lanes 4.0-5.1
#: against 1.7-2.4 ms). A load's reductions have 5 to 40 lanes, a delta transfer's 2 per piece.
STORE_LANES_MAX = 1024
#: The longest pause between two polls, per rank of the reduction, early in a wait, and
#: later the share of the time waited so far, up to PAUSE_MAX_S (module docstring).
POLL_CAP_PER_RANK_S = 0.00025
LATE_SHARE = 0.05
PAUSE_MAX_S = 0.5
_INT64 = 1 << 64


#: A reduction's lanes on the store: the codec's version, ``lanes:``, then decimal int64s
#: separated by commas (text, not JSON: the fold reads them as fast as before, and a value
#: that is not exactly this shape is refused before any number is parsed).
_LANES = PREFIX + b"lanes:"
_LANES_RE = re.compile(rb"(?:-?[0-9]{1,19}(?:,-?[0-9]{1,19})*)?")


def _encode(lanes: Sequence[int]) -> bytes:
    return _LANES + ",".join(str(int(v)) for v in lanes).encode()


def _checked(lanes: Sequence[int]) -> list[int]:
    """``lanes`` as ints, each an int64 (ValueError naming the first that is not)."""
    out = [int(v) for v in lanes]
    for i, v in enumerate(out):
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"lane {i} is {v}, outside int64: a reduction's lanes are int64, as an all-reduce's")
    return out


def _wrapped(v: int) -> int:
    """A sum as an int64 all-reduce leaves it: wrapped around modulo 2**64."""
    v %= _INT64
    return v - _INT64 if v >= 1 << 63 else v


def _decode(blob: Any, key: str) -> list[int]:
    """The lanes under ``key``; ``ControlMessageError`` for anything ``_encode`` does not write."""
    if not isinstance(blob, bytes) or not blob.startswith(_LANES):
        writer = ("a dcp-platform before 0.7 (lanes without the codec's prefix)"
                  if isinstance(blob, bytes) and _LANES_RE.fullmatch(blob) else None)
        raise ControlMessageError(key, f"not a reduction's lanes (it starts {bytes(blob)[:12]!r})", writer=writer)
    body = blob[len(_LANES):]
    if len(body) > STORE_LANES_MAX * 21 or not _LANES_RE.fullmatch(body):
        raise ControlMessageError(key, f"a reduction's lanes must be at most {STORE_LANES_MAX} decimal integers "
                                       "separated by commas")
    out = [int(v) for v in body.split(b",")] if body else []
    if any(not -(1 << 63) <= v < (1 << 63) for v in out):
        raise ControlMessageError(key, "a reduction's lane is outside int64")
    return out


class StoreReduction:
    """One reduction in flight (module docstring). ``result(check, stall)`` waits for it:
    ``check()`` raises once the operation failed elsewhere, ``stall(start)`` once this wait
    lasted too long; both are called between polls."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, lanes: Sequence[int], op: str,
                 first_pause: float):
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        self._store, self._prefix, self._rank, self._world = store, prefix, rank, world
        self._first_pause = first_pause
        self._cap = max(first_pause, world * POLL_CAP_PER_RANK_S)
        self._asked = float("-inf")  # when ``ready`` last asked the store
        self._done: list[int] | None = None
        self._mine = self._key(rank)
        checked = _checked(lanes)
        self._width = len(checked)
        store.set(self._mine, _encode(checked))
        if store.add(self._key("in"), 1) == world:  # the last one in reduces
            keys = [self._key(r) for r in range(world)]
            parts = [_decode(b, k) for b, k in zip(store.multi_get(keys), keys, strict=True)]
            width = {len(p) for p in parts}
            if len(width) != 1:
                raise ControlMessageError(prefix, f"ranks reduced different numbers of lanes: {sorted(width)}")
            cols = zip(*parts, strict=True)
            self._done = [max(c) for c in cols] if op == "max" else [_wrapped(sum(c)) for c in cols]
            store.set(self._key("out"), _encode(self._done))

    def _key(self, part: object) -> str:
        return f"{self._prefix}/{part}"

    def ready(self) -> bool:
        """Whether the result is out, asking the store at most once per capped pause: a caller
        that asks between many small steps (``async_save`` between the boxes it copies) would
        otherwise make a store round trip per step."""
        if self._done is not None:
            return True
        now = time.monotonic()
        if now - self._asked < self._cap:
            return False
        self._asked = now
        return bool(self._store.check([self._key("out")]))

    def result(self, check: Any, stall: Any) -> list[int]:
        if self._done is None:
            start, pause, cap = time.monotonic(), self._first_pause, self._cap
            while not self._store.check([self._key("out")]):
                check()
                stall(start)
                time.sleep(pause)
                late = min(PAUSE_MAX_S, LATE_SHARE * (time.monotonic() - start))
                pause = min(2 * pause, max(cap, late))
            out = self._key("out")
            done = _decode(self._store.get(out), out)
            if len(done) != self._width:
                raise ControlMessageError(out, f"{len(done)} lanes in the result, {self._width} sent")
            self._done = done
        self._forget()
        return self._done

    def _forget(self) -> None:
        if self._mine is None:
            return
        store, self._mine, mine = self._store, None, self._mine
        store.delete_key(mine)
        if store.add(self._key("read"), 1) == self._world:  # every rank has its result
            for part in ("in", "out", "read"):
                store.delete_key(self._key(part))
