"""What callers hand to the scheduler (``BroadcastItem``) and what it hands back (``BroadcastStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Items smaller than this are packed into one staging buffer per (group, source).
#: Measured on 4 Ascend cards: a broadcast costs ~145 us whatever its size up to 1 MiB and
#: moves ~33 GiB/s beyond, so packing pays below ~4.6 MiB; 6 MiB leaves a margin.
#: On gloo (4 CPU ranks) 1000 x 4 KiB took 0.78 s one by one and 19 ms packed (dcp-broadcast
#: README, "Why 6 MiB and 8 in flight").
DEFAULT_BATCH_BYTES = 6 * 1024 * 1024

#: Broadcasts in flight per rank; staging memory stays under batch_bytes x this.
#: 8 x 6 MiB = 48 MiB of staging at most, small next to any model, while enough broadcasts
#: are queued for backends that overlap them (NCCL, HCCL; gloo does not).
DEFAULT_MAX_IN_FLIGHT = 8


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BroadcastItem:
    """One buffer to move from global rank ``src`` to every other rank of ``ranks``.

    Every rank passes the same sequence of items (same ``src``, ``ranks`` and ``nbytes``
    in the same order). Members of ``ranks`` pass ``tensor``: the source's holds the data,
    the receivers' are filled in place (any dtype, non-contiguous views allowed).
    Non-members pass ``tensor=None``. ``ranks`` may be given as any sequence of ints; it
    is stored as a tuple and must be sorted and unique, with ``src`` among them.
    """

    src: int
    ranks: tuple[int, ...]
    nbytes: int
    tensor: Any = None

    def __post_init__(self) -> None:
        if not _is_int(self.src) or self.src < 0:
            raise TypeError(f"BroadcastItem.src must be a non-negative int, got {self.src!r}")
        try:
            ranks = tuple(self.ranks)
        except TypeError:
            raise TypeError(
                f"BroadcastItem.ranks must be a sequence of ints, got {type(self.ranks).__name__}"
            ) from None
        bad = [r for r in ranks if not _is_int(r) or r < 0]
        if bad:
            raise TypeError(f"BroadcastItem.ranks must hold non-negative ints; bad entries {bad!r}")
        if not ranks:
            raise ValueError("BroadcastItem.ranks is empty; give at least the source rank")
        if list(ranks) != sorted(set(ranks)):
            raise ValueError(
                f"BroadcastItem.ranks must be sorted and unique, got {ranks}; "
                f"pass tuple(sorted(set(ranks))) = {tuple(sorted(set(ranks)))}"
            )
        if self.src not in ranks:
            raise ValueError(f"BroadcastItem.src {self.src} is not in ranks {ranks}; add it to ranks")
        if not _is_int(self.nbytes) or self.nbytes < 0:
            raise TypeError(f"BroadcastItem.nbytes must be a non-negative int, got {self.nbytes!r}")
        object.__setattr__(self, "ranks", ranks)


@dataclass(frozen=True)
class BroadcastStats:
    """What one rank did in one ``broadcast_items`` call.

    ``broadcasts``: collectives this rank took part in. ``items``: items this rank was the
    source or a receiver of; ``items_batched``: those of them that travelled in a staging
    batch. ``bytes_sent``: item bytes this rank sent as a source; ``bytes_received``: item
    bytes written into this rank's buffers (scratch a non-member discards is not counted).
    ``max_in_flight_seen``: most broadcasts this rank had in flight at once (never more
    than ``max_in_flight``). ``seconds``: wall time of the call on this rank.
    """

    broadcasts: int = 0
    items: int = 0
    items_batched: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    max_in_flight_seen: int = 0
    seconds: float = 0.0
