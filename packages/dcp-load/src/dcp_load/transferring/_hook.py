"""``transfer(..., on_synced=)``: the caller's hook, once a transfer succeeded on every rank.

An engine that post-processes its weights after they land (vLLM's
``process_weights_after_loading``: repacking, scales) passes it. It runs on this rank after
the call's final check passed on every rank and this rank's writes were made (a staged call's
included), outside the call's coordination: it never runs after a failed call, and what it
does (or raises) involves no other rank, so no rank waits for it. An exception it raises is
raised from ``transfer`` on this rank as it is, with a note saying that the transfer itself
succeeded and what this rank's destinations hold.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["call_hook", "check_hook"]

logger = logging.getLogger(__name__)


def check_hook(on_synced: Any) -> None:
    if on_synced is not None and not callable(on_synced):
        raise TypeError(f"transfer: on_synced must be a callable taking the names of the destinations written, "
                        f"or None, got {type(on_synced).__name__}")


def _note(exc: BaseException, text: str) -> None:
    if sys.version_info >= (3, 11):
        exc.add_note(text)
    else:  # Python 3.10 prints no notes: say it in the log too
        exc.__notes__ = [*getattr(exc, "__notes__", []), text]  # type: ignore[attr-defined]
        logger.error("%s", text)


def call_hook(on_synced: Any, report: Any) -> None:
    """``on_synced(report.changed)``; an exception it raises goes on with a note."""
    if on_synced is None:
        return
    try:
        on_synced(report.changed)
    except Exception as exc:
        _note(exc, f"transfer: on_synced raised on rank {report.rank} after the transfer of version "
                   f"{report.version} succeeded on every rank: this rank's destinations hold version "
                   f"{report.version} ({len(report.changed)} written by it); the other ranks returned from the "
                   "transfer, and the process group stays usable")
        raise
