"""``--workers N``: this process and N - 1 worker processes share the output files, each
claiming the next unfilled file from a shared counter and reading only the chunks that
file needs. The layout (every header and offset) is fixed before they start, so the files
are the same byte for byte whatever N is.

This process fills files from the start, while the workers are still starting: a worker
comes from a fork server that imports torch once (seconds on a busy machine), so a small
conversion may finish before any worker has claimed a file. Once every file is whole,
workers are stopped rather than awaited (a start in progress is let finish first), so N
workers are at most a worker's start slower than one.
"""

from __future__ import annotations

import logging
import queue as queue_mod
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._fill import FileResult, claimer, fill_files, worker_main
from ._layout import OutFile

__all__ = ["run_workers"]

logger = logging.getLogger(__name__)

#: Seconds between checks that every worker is still alive while waiting for messages.
_POLL_S = 0.5
#: Longest wait for a worker start in progress once every file is whole (the fork server
#: imports torch first: ~3 s of CPU, 15-25 s on the shared 2-core development machine).
_START_S = 120.0

#: Imported once by the fork server, so that each worker starts in milliseconds instead of
#: importing torch and torch.distributed itself.
PRELOAD = ["torch", "torch.distributed", "dcp_reader", "dcp_platform", "dcp_load.conversion._fill", "dcp_load._load"]


def _context() -> Any:
    """A fork server's context (never a plain fork of this process: it may have run torch's
    thread pools, which a forked child inherits broken), else spawn."""
    import multiprocessing as mp

    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # a platform without a fork server
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs (it has them or its own)
    return ctx


class _Messages:
    """The workers' messages, handed to the callbacks; a worker's error or death raises."""

    def __init__(self, queue: Any, procs: Sequence[Any], on_bytes: Callable[[int], None],
                 on_file: Callable[[FileResult], None]):
        self.queue, self.procs, self.on_bytes, self.on_file = queue, procs, on_bytes, on_file
        self.results: list[FileResult] = []
        self.started = 0  # workers running (they say so first)

    def drain(self, timeout: float | None = None) -> None:
        """Handle every waiting message (``timeout``: wait that long for the first one)."""
        while True:
            try:
                msg = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
            except queue_mod.Empty:
                if timeout:
                    self._check_alive()
                return
            timeout = None
            if msg[0] == "bytes":
                self.on_bytes(msg[1])
            elif msg[0] == "file":
                self.results.append(msg[1])
                self.on_file(msg[1])
            elif msg[0] == "error":
                raise RuntimeError(f"a convert worker failed: {msg[1]}")
            elif msg[0] == "started":
                self.started += 1

    def _check_alive(self) -> None:
        dead = [p for p in self.procs if p.exitcode not in (0, None)]
        if dead and self.queue.empty():
            raise RuntimeError(f"convert worker {dead[0].name} died (exit code {dead[0].exitcode}) without "
                               "reporting an error; the conversion was abandoned")


def run_workers(src: str, root: str, files: Sequence[OutFile], workers: int, *, reads: Mapping[str, Any],
                native: bool,
                on_bytes: Callable[[int], None], on_file: Callable[[FileResult], None]) -> list[FileResult]:
    """Fill ``files`` here and on ``workers - 1`` worker processes. A worker that fails or
    dies stops the conversion; the error names it and its cause. Waits are bounded by the
    workers' lives: a dead worker is seen within ``_POLL_S``."""
    import torch

    ctx = _context()
    queue, counter = ctx.Queue(), ctx.Value("q", 0)
    extra = min(workers, len(files)) - 1
    threads = max(1, torch.get_num_threads() // (extra + 1))  # the processes share this one's threads
    procs = [ctx.Process(target=worker_main, args=(src, root, files, counter, reads, native, queue, threads),
                         name=f"dcp-convert-{k + 1}", daemon=True) for k in range(extra)]
    messages = _Messages(queue, procs, on_bytes, on_file)
    mine: list[FileResult] = []
    stop = threading.Event()
    # Process.start() on a fork server waits until the server has imported torch (seconds):
    # the workers are started on a thread while this process fills files
    starter = threading.Thread(target=_start_all, args=(procs, stop), name="dcp-convert-start", daemon=True)
    old_threads = torch.get_num_threads()
    try:
        starter.start()

        def here(r: FileResult) -> None:
            mine.append(r)
            on_file(r)
            messages.drain()  # the workers' progress, between this process's files
            # all of this process's threads until a worker runs, then its share
            torch.set_num_threads(threads if messages.started else old_threads)

        fill_files(src, root, files, reads=reads, native=native, on_bytes=on_bytes, on_file=here,
                   claim=claimer(counter, len(files)))
        while len(mine) + len(messages.results) < len(files):
            messages.drain(timeout=_POLL_S)
        # every file is whole: a worker still starting (or finding nothing left) is stopped
        # instead of awaited; a start still in progress is let finish first (bounded), as a
        # worker forked after this process dropped the queue would fail noisily
    finally:
        stop.set()
        starter.join(timeout=_START_S)
        torch.set_num_threads(old_threads)
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.terminate()
                p.join(timeout=10)
        queue.close()
    order = {f.name: i for i, f in enumerate(files)}
    return sorted(mine + messages.results, key=lambda r: order[r.name])


def _start_all(procs: Sequence[Any], stop: threading.Event) -> None:
    """Start each worker unless the conversion is over; one started after that is stopped."""
    for p in procs:
        if stop.is_set():
            return
        try:
            p.start()
        except Exception:  # noqa: BLE001 - a worker that cannot start leaves its files to the others
            logger.warning("convert worker %s could not start", p.name, exc_info=True)
            return
        if stop.is_set():
            p.terminate()
            p.join(timeout=10)
            return
