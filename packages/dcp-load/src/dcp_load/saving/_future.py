"""The future ``async_save`` returns: a ``concurrent.futures.Future`` of the ``SaveReport``
that also answers as torch DCP's ``AsyncSaveResponse`` does, and is loud when it failed
and nobody looked.

* ``staging_completion``: a future already done when ``async_save`` returns (dcp stages on
  the caller's thread); ``upload_completion``: the future itself (set once committed).
* A failed save whose outcome is never observed (no ``result()``, ``exception()`` or
  ``add_done_callback``) is logged at ERROR when the future is collected, or at the
  latest when the interpreter exits: a script that forgets ``result()`` learns that its
  checkpoint was not written (the old one stays committed).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any

__all__ = ["SaveFuture"]

logger = logging.getLogger(__name__)

_UNSEEN: weakref.WeakSet[SaveFuture] = weakref.WeakSet()  # failed, not yet observed
_LOCK = threading.Lock()


class SaveFuture(Future):
    """``async_save``'s future (module docstring); ``path``: the directory it writes."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._observed = False
        self.staging_completion: Future[None] = Future()
        self.staging_completion.set_result(None)

    @property
    def upload_completion(self) -> SaveFuture:
        """torch DCP's name for the future of the write and commit: this future."""
        return self

    def _seen(self) -> None:
        self._observed = True
        with _LOCK:
            _UNSEEN.discard(self)

    def result(self, timeout: float | None = None) -> Any:
        self._seen()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._seen()
        return super().exception(timeout)

    def add_done_callback(self, fn: Any) -> None:
        self._seen()
        super().add_done_callback(fn)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._observed:
            with _LOCK:
                _UNSEEN.add(self)
        super().set_exception(exception)

    def __del__(self) -> None:
        if not self._observed and self.done() and not self.cancelled() and super().exception(0) is not None:
            _report(self)


def _report(future: SaveFuture) -> None:
    future._observed = True
    logger.error("async_save into %s failed and its result() was never called, so nothing raised: %s. That "
                 "checkpoint was not written (the one before it stays committed); call result() on every "
                 "async_save future (before destroying the process group)", future.path,
                 str(Future.exception(future, 0))[:500])


@atexit.register
def _report_unseen() -> None:
    with _LOCK:
        unseen = list(_UNSEEN)
    for future in unseen:
        if not future._observed:
            _report(future)
