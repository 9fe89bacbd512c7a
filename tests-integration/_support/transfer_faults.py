"""A fault injected into a running ``transfer`` (for the tests of what a failed transfer leaves).

``failing_sparse_round``: inside it, this rank fails as its sparse round starts, that is after
the call's dense pieces were broadcast (and, on receivers, staged), before the sparse ones
move. ``how``: "raise" (a ``RuntimeError`` saying ``message``) or "exit" (the process ends).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def failing_sparse_round(how: str, message: str) -> Iterator[None]:
    from dcp_load.transferring import _sparse

    def run(*args: Any, **kwargs: Any) -> None:
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"injected: {message}")

    saved, _sparse.SparseRound.run = _sparse.SparseRound.run, run
    try:
        yield
    finally:
        _sparse.SparseRound.run = saved
