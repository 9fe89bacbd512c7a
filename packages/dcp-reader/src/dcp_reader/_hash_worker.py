"""HashWorker: one thread that hashes the pieces a reader has just read while the reader
reads the next ones. xxhash releases the GIL, so hashing overlaps ``preadv`` on a second
core instead of adding to the read time (dcp-reader README, "Measured facts")."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any


class HashWorker:
    """Runs jobs in the order they were submitted, on one thread started by the first
    ``submit`` and stopped (joined) by ``close`` or when the worker is garbage-collected.

    Call order: ``submit`` any number of jobs, then ``drain`` before using their results;
    one caller thread at a time (the reader's). Jobs record their results where the
    caller looks after ``drain``; an exception a job raises is re-raised by ``drain``.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] | None = None
        self._stop: weakref.finalize | None = None
        self._errors: list[BaseException] = []

    @property
    def running(self) -> bool:
        return self._stop is not None and self._stop.alive

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if not self.running:
            self._jobs = queue.SimpleQueue()
            thread = threading.Thread(target=_run, args=(self._jobs, self._errors), name="dcp-reader-hash", daemon=True)
            thread.start()
            # The thread holds the queue, never the worker, so a reader dropped without
            # close() still stops it.
            self._stop = weakref.finalize(self, _stop, self._jobs, thread)
        assert self._jobs is not None
        self._jobs.put((fn, args))

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        if not self.running:
            return
        assert self._jobs is not None
        done = threading.Event()
        self._jobs.put((done.set, ()))
        done.wait()
        if self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self) -> None:
        """Stop and join the thread (idempotent); a later ``submit`` starts a new one."""
        if self._stop is not None:
            self._stop()
        self._jobs = self._stop = None


def _run(jobs: queue.SimpleQueue[Any], errors: list[BaseException]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args = job
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the caller by drain(), which re-raises it
            errors.append(e)


def _stop(jobs: queue.SimpleQueue[Any], thread: threading.Thread) -> None:
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join()
