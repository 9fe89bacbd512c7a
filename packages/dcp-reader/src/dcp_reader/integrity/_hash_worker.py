"""HashWorker: one thread that hashes the blocks a reader has just read while the reader
reads the next ones. xxhash releases the GIL, so hashing overlaps ``preadv`` on a second
core instead of adding to the read time (dcp-reader README, "Measured facts").

A job the thread has not started when the reader needs its result is run by the reader
itself (``finish``): on a machine whose cores are all busy the thread may wait
milliseconds for a time slice, and the reader then waits only for a job already running.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any


class Job:
    """One call, run once: by the worker thread or by ``HashWorker.finish``."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]):
        self.fn, self.args = fn, args
        self._claim = threading.Lock()  # held by whoever runs it, never released
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._claim.locked()

    def run_if_unclaimed(self) -> None:
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.result = self.fn(*self.args)
        except Exception as e:  # noqa: BLE001 - handed to the caller by finish(), which re-raises it
            self.error = e
        finally:
            self._done.set()
            self.fn = self.args = None  # type: ignore[assignment]  # drop the buffers

    def wait(self) -> Any:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class HashWorker:
    """Runs submitted jobs in order on one thread, started by the first ``submit`` and
    stopped (joined) by ``close`` or when the worker is garbage-collected.

    Call order: ``submit`` jobs, then ``finish`` them before using their results (it runs
    the ones not started yet here and waits for the others); one caller thread at a time
    (the reader's).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] | None = None
        self._stop: weakref.finalize | None = None

    @property
    def running(self) -> bool:
        return self._stop is not None and self._stop.alive

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        if not self.running:
            self._jobs = queue.SimpleQueue()
            thread = threading.Thread(target=_run, args=(self._jobs,), name="dcp-reader-hash", daemon=True)
            thread.start()
            # The thread holds the queue, never the worker, so a reader dropped without
            # close() still stops it.
            self._stop = weakref.finalize(self, _stop, self._jobs, thread)
        assert self._jobs is not None
        job = Job(fn, args)
        self._jobs.put(job)
        return job

    @staticmethod
    def finish(jobs: Sequence[Job]) -> list[Any]:
        """The results of ``jobs``: runs those not started yet here, waits for the others;
        re-raises the first error a job raised."""
        for job in jobs:
            job.run_if_unclaimed()
        for job in jobs:  # every job has ended before anything is raised
            job._done.wait()
        return [job.wait() for job in jobs]

    def close(self) -> None:
        """Stop and join the thread (idempotent); a later ``submit`` starts a new one."""
        if self._stop is not None:
            self._stop()
        self._jobs = self._stop = None


def _run(jobs: queue.SimpleQueue[Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run_if_unclaimed()


def _stop(jobs: queue.SimpleQueue[Job | None], thread: threading.Thread) -> None:
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join()
