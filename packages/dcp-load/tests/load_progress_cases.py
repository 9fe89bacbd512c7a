"""Runs inside each gloo rank of test_load_progress.py: a load with INFO logging on and a
fake terminal as stderr; returns what the progress logger and the bar produced there."""

from __future__ import annotations

import io
import logging
import sys

import torch


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal and keeps what was written."""

    def isatty(self) -> bool:
        return True


def load_with_progress(rank: int, world_size: int, checkpoint: str) -> tuple[list[str], str, bool]:
    import dcp_load
    from dcp_load.run import _progress

    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("dcp_load")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    tty, real = FakeTTY(), sys.stderr
    sys.stderr = tty
    _progress.DELAY_S, delay = 0.0, _progress.DELAY_S  # draw from the first piece on
    try:
        target = {"w": torch.full((64, 32), float("nan")), "b": torch.full((32,), float("nan"))}
        dcp_load.load(target, checkpoint_id=checkpoint, broadcast_replicated_tensors=True)
        ok = torch.equal(target["w"], torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32))
    finally:
        sys.stderr, _progress.DELAY_S = real, delay
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    return records, tty.getvalue(), ok
