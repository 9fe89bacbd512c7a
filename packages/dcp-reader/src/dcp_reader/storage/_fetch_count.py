"""Who counts the bytes an object store sent: ``CheckpointReader.bytes_fetched``.

An object's first bytes (``_object.HEAD_BYTES``; a small object whole) are fetched once per
process and shared (``_object._HEADS``), so the GET that fetched them may not belong to the
reader that reads from them: ``open_checkpoint`` parses the headers before its reader
exists, and a later load of an unchanged object finds them cached. Two rules keep
``bytes_fetched`` at what the store sent for a load, and never below ``bytes_read``:

* ``metering(root)``: the GETs made for objects under ``root`` while it is open are counted
  (``FetchMeter``), with the heads they fetched; ``open_checkpoint`` gives its reader what
  the parse fetched.
* ``HeadClaims``: a reader and its siblings share one; an object's head counts once per
  claims, when a file of the reader opens it: nothing more when a GET of this reader (or
  of its parse) fetched it, its whole length when it came from the cache (as if fetched:
  the load took those bytes from storage through an earlier GET).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

__all__ = ["FetchMeter", "HeadClaims", "metered", "metering"]

_LOCK = threading.Lock()
_METERS: list[FetchMeter] = []


class FetchMeter:
    """Bytes that GETs sent for objects under ``root`` (a URI prefix) while metering."""

    def __init__(self, root: str):
        self.root = root.rstrip("/") + "/"
        self.bytes = 0
        self.heads: set[Hashable] = set()  # the heads those GETs fetched (``ObjectFile._head_key``)


@contextlib.contextmanager
def metering(root: str) -> Iterator[FetchMeter]:
    """Count the GETs of every thread for objects under ``root`` within the block (a
    parse fetches headers on several threads); a concurrent load of the same checkpoint in
    this process would be counted too."""
    meter = FetchMeter(root)
    with _LOCK:
        _METERS.append(meter)
    try:
        yield meter
    finally:
        with _LOCK:
            _METERS.remove(meter)


def metered(path: str, sent: int, head: Hashable | None = None) -> None:
    """A GET for the object at ``path`` sent ``sent`` bytes (``head``: it fetched that head)."""
    if not _METERS:  # no parse in progress: the common case costs one list check
        return
    with _LOCK:
        for meter in _METERS:
            if path.startswith(meter.root):
                meter.bytes += sent
                if head is not None:
                    meter.heads.add(head)


class HeadClaims:
    """The heads a reader (with its siblings) has counted in ``bytes_fetched``."""

    def __init__(self, counted: Iterator[Hashable] | set[Hashable] = ()):
        self._counted = set(counted)
        self._lock = threading.Lock()

    def claim(self, head: Hashable) -> bool:
        """Whether ``head`` was not counted yet (it is from now on)."""
        with self._lock:
            if head in self._counted:
                return False
            self._counted.add(head)
            return True
