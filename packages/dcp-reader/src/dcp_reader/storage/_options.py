"""Settings of the object-store backend, from ``DCP_STORAGE_*`` environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

MiB = 1024 * 1024


@dataclass(frozen=True)
class ObjectOptions:
    """How reads and writes are cut and bounded (environment variable in brackets).

    - ``part_bytes`` (``DCP_STORAGE_PART_BYTES``): a range is fetched as GETs of at most
      this many bytes (8 MiB: large enough that a GET's 20-50 ms of latency costs little
      against its ~84 ms transfer at 100 MB/s, small enough that a 64 MiB range keeps 8
      connections busy). Multipart uploads use parts of this size too.
    - ``concurrency`` (``DCP_STORAGE_CONCURRENCY``): GETs in flight at once per read, and
      parts in flight per upload (see the dcp-reader README, "Object storage", for the
      measurement behind the default).
    - ``readers`` (``DCP_STORAGE_READERS``): pieces of a load that one process reads at once
      (dcp-load: each on its own thread and reader).
    - ``coalesce_gap`` (``DCP_STORAGE_COALESCE_GAP``): two ranges at most this far apart are
      fetched by one GET (the gap is read and dropped: cheaper than another round trip).
    - ``max_overread`` (``DCP_STORAGE_MAX_OVERREAD``): the gap bytes one read fetches stay
      within this fraction of the bytes it wants; the smallest gaps are read through first.
      The default, 1.0, keeps a column shard in one GET per part: at 0.05 a 12 MiB DP2 x TP2
      load from moto fetched 1.04 x its unique bytes but in 3928 GETs (25.2 s against 8.9 s
      in 40 GETs at 1.33 x), since a column shard's gaps are the other ranks' columns.
    - ``stall_timeout`` (``DCP_STORAGE_STALL_TIMEOUT``, seconds): a response that sends no
      byte for this long is abandoned and retried.
    - ``total_timeout`` (``DCP_STORAGE_TOTAL_TIMEOUT``, seconds): one read or write, with
      all its retries, fails with StorageError after this long.
    """

    part_bytes: int = 8 * MiB
    concurrency: int = 16
    readers: int = 8
    coalesce_gap: int = 1 * MiB
    max_overread: float = 1.0
    stall_timeout: float = 30.0
    total_timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.part_bytes < 5 * MiB:
            # S3 refuses multipart parts below 5 MiB (all but the last)
            raise ValueError(f"part_bytes must be >= {5 * MiB} (5 MiB), got {self.part_bytes}")
        for f in ("concurrency", "readers", "coalesce_gap"):
            v, least = getattr(self, f), 0 if f == "coalesce_gap" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{f} must be an int >= {least}, got {v!r}")
        m = self.max_overread
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < float("inf"):
            raise ValueError(f"max_overread must be a number >= 0 (a fraction of the wanted bytes), got {m!r}")
        for f in ("stall_timeout", "total_timeout"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0 seconds, got {getattr(self, f)!r}")

    @classmethod
    def from_env(cls) -> ObjectOptions:
        """The defaults, overridden by the ``DCP_STORAGE_*`` variables that are set."""
        values = {}
        for f in fields(cls):
            var = f"DCP_STORAGE_{f.name.upper()}"
            raw = os.environ.get(var)
            if raw is None or not raw.strip():
                continue
            try:
                values[f.name] = (int if f.type in ("int", int) else float)(raw)
            except ValueError:
                raise ValueError(f"${var}={raw!r} is not a number; unset it or give a number") from None
        return cls(**values)
