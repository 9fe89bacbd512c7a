"""What ``load`` returns: where this rank's bytes came from, and how long each phase took."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["LoadReport"]


@dataclass(frozen=True)
class LoadReport:
    """One rank's account of one ``load``.

    ``bytes_needed``: bytes of the boxes this rank's state dict holds (what it loaded).
    ``bytes_read``: bytes this rank took from storage (as counted by the reader; a format
    that cannot narrow a read counts the whole blob). ``bytes_received`` / ``bytes_sent``:
    bytes that reached this rank by broadcast / that it broadcast. ``broadcasts``:
    collectives this rank took part in. ``pieces_read``: boxes it read from storage.
    ``job_bytes_read``: ``bytes_read`` summed over all ranks; ``job_unique_bytes``: bytes of
    the distinct boxes any rank wanted (a read-once load has ``read_amplification`` 1.0).
    ``seconds``: wall time per phase (``prepare``, ``plan``, ``validate``, ``execute``,
    ``finish``) and ``total``. ``missing``: names skipped with ``strict=False``. ``cast``:
    tensors whose destination dtype differs from the checkpoint's, cast while loading.
    ``skipped_not_in_mesh``: DTensor entries whose device mesh does not include this rank
    (it holds no part of them, so nothing is loaded into them). ``tied``: (key, key) pairs
    of tied weights: the first key shares the second's tensor and was loaded through it.
    ``composed``: (key, number of saved tensors) of each destination that ``sources=``
    mapped (renamed or composed), in state dict order. ``bytes_fetched``: ``bytes_read``
    plus the bytes covering reads took around their boxes (a row-parallel half read as
    whole rows, say: the read cost model's choice, README "How a box is read");
    ``job_bytes_fetched``: summed over all ranks (``fetch_amplification`` against the
    unique bytes).
    """

    rank: int
    world_size: int
    format: str
    tensors: int
    values: int
    bytes_needed: int
    bytes_read: int
    bytes_received: int
    bytes_sent: int
    broadcasts: int
    pieces_read: int
    job_bytes_read: int
    job_unique_bytes: int
    seconds: Mapping[str, float] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    cast: tuple[str, ...] = ()
    skipped_not_in_mesh: tuple[str, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    composed: tuple[tuple[str, int], ...] = ()
    bytes_fetched: int = 0
    job_bytes_fetched: int = 0

    def __post_init__(self) -> None:
        for name in ("bytes_needed", "bytes_read", "bytes_received", "bytes_sent", "broadcasts",
                     "pieces_read", "job_bytes_read", "job_unique_bytes", "tensors", "values", "bytes_fetched",
                     "job_bytes_fetched"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoadReport.{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "seconds", dict(self.seconds))
        object.__setattr__(self, "missing", tuple(self.missing))
        object.__setattr__(self, "cast", tuple(self.cast))
        object.__setattr__(self, "skipped_not_in_mesh", tuple(self.skipped_not_in_mesh))
        object.__setattr__(self, "tied", tuple(tuple(p) for p in self.tied))
        object.__setattr__(self, "composed", tuple(tuple(p) for p in self.composed))

    @property
    def read_amplification(self) -> float:
        """``job_bytes_read / job_unique_bytes``: 1.0 when every needed byte was read once."""
        return self.job_bytes_read / self.job_unique_bytes if self.job_unique_bytes else 1.0

    @property
    def fetch_amplification(self) -> float:
        """``job_bytes_fetched / job_unique_bytes``: what the job took from storage against
        the bytes it needed (above ``read_amplification`` by the covering reads' extra)."""
        return self.job_bytes_fetched / self.job_unique_bytes if self.job_unique_bytes else 1.0
