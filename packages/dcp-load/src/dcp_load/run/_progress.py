"""What a person watching a load sees: INFO lines on rank 0 and a progress bar on a terminal.

Rank 0 logs, at INFO, one line summarising the plan, one line per phase (its time and the
bytes it moved) and one line at the end. Other ranks log nothing here (they still log at
DEBUG elsewhere), and when the ``dcp_load`` logger does not pass INFO (the default: Python's
last-resort handler shows WARNING and above) nothing is logged and no bar is drawn.

The bar: rank 0's bytes read from storage against its total, with the rate, redrawn in
place on stderr at most ten times a second, only when stderr is a terminal and only once
the load has run ``delay_s`` seconds (short loads show nothing). It is built in rather
than taken from tqdm: the packages must work with their declared dependencies alone, and
the bar is forty lines; ``advance`` is called from the read-ahead thread once per piece,
so it takes a lock and does no formatting until the next redraw is due.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from ._plan_summary import plan_numbers, summary_text
from ._units import human_bytes

__all__ = ["Progress"]

logger = logging.getLogger(__name__)

#: Seconds a load runs before the bar appears; below it the bar would only flicker.
DELAY_S = 3.0
_REDRAW_S = 0.1
_WIDTH = 24


class Progress:
    """INFO lines and a terminal bar for one load; everything is a no-op off rank 0.

    Call order: ``plan(...)`` once, ``phase(...)`` as each phase ends, ``advance(n)`` from
    any one thread as bytes arrive, ``close()`` once (also after a failure; idempotent).
    ``enabled``: ``None`` follows the logger (INFO enabled for ``dcp_load.run._progress``);
    ``stream``: where the bar goes (default ``sys.stderr``), drawn only if it is a TTY;
    ``label``: the bar's first word(s).
    """

    def __init__(self, rank: int, enabled: bool | None = None, *, stream: TextIO | None = None,
                 delay_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 label: str = "dcp load"):
        wanted = logger.isEnabledFor(logging.INFO) if enabled is None else enabled
        self.on = rank == 0 and wanted
        self._stream = stream if stream is not None else sys.stderr
        self._bar = self.on and _isatty(self._stream)
        self._clock, self._delay = clock, DELAY_S if delay_s is None else delay_s
        self._start, self._last_draw = clock(), float("-inf")
        self._lock = threading.Lock()
        self.total = 0
        self.done = 0
        self.drawn = False
        self.label = label

    def plan(self, plan: Any, rank: int, tensors: int) -> None:
        """Log a one-line summary of ``plan`` (a ``GlobalPlan``) as seen from ``rank``, its
        index in the plan, with the numbers ``dcp plan`` prints (``_plan_summary``: the
        job's for a gathered plan, this rank's replica groups' for a derived one; no
        collective); the bar counts up to the bytes that rank reads."""
        if not self.on:
            return
        reads = plan.reads_for(rank)
        self.total = sum(item.nbytes for item in reads)
        numbers = plan_numbers(plan)
        logger.info("load plan: %d tensor(s) on %d rank(s); rank %d reads %d piece(s), %s; %s: %s", tensors,
                    plan.world_size, rank, len(reads), human_bytes(self.total), numbers["scope"],
                    summary_text(numbers))

    def phase(self, name: str, seconds: float, nbytes: int = 0) -> None:
        """Log one finished phase with its time and the bytes it moved (if any)."""
        if not self.on:
            return
        if nbytes:
            logger.info("load phase %s: %.3f s, %s (%s/s)", name, seconds, human_bytes(nbytes),
                        human_bytes(nbytes / seconds if seconds > 0 else 0.0))
        else:
            logger.info("load phase %s: %.3f s", name, seconds)

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more done; redraws the bar when one is due."""
        if not self._bar:
            return
        with self._lock:
            self.done += nbytes
            now = self._clock()
            if now - self._start < self._delay or now - self._last_draw < _REDRAW_S:
                return
            self._last_draw = now
            try:
                self._draw(now)
            except (OSError, ValueError):  # stderr closed or gone: the load matters, not the bar
                self._bar = False

    def close(self) -> None:
        """Finish the bar's line (when one was drawn); later calls do nothing."""
        with self._lock:
            if self.drawn and self._bar:
                try:
                    self._draw(self._clock())
                    self._stream.write("\n")
                    self._stream.flush()
                except (OSError, ValueError):  # as in advance: never fail a load for the bar
                    pass
            self._bar = self.drawn = False

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        frac = min(self.done / self.total, 1.0) if self.total else 0.0
        filled = int(frac * _WIDTH)
        self._stream.write(f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {frac:4.0%} "
                           f"{human_bytes(self.done)} / {human_bytes(self.total)} "
                           f"{human_bytes(self.done / elapsed)}/s ")
        self._stream.flush()
        self.drawn = True


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
