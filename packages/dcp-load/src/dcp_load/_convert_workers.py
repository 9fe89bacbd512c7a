"""``--workers N``: N processes split the output files by bytes; each reads only what its
files need. The layout (every header and offset) is fixed before they start, so the files
are the same byte for byte whatever N is."""

from __future__ import annotations

import heapq
import logging
import queue as queue_mod
from collections.abc import Callable, Sequence
from typing import Any

from ._convert_fill import FileResult, worker_main
from ._convert_layout import OutFile

__all__ = ["run_workers", "split_files"]

logger = logging.getLogger(__name__)

#: Seconds between checks that every worker is still alive while waiting for messages.
_POLL_S = 0.5


def split_files(files: Sequence[OutFile], parts: int) -> list[list[OutFile]]:
    """``files`` dealt into at most ``parts`` lists of about equal bytes (largest first to the
    lightest list); each list keeps the files' order. Empty lists are dropped."""
    loads = [(0, k) for k in range(parts)]
    owner = {}
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        size, k = heapq.heappop(loads)
        owner[i] = k
        heapq.heappush(loads, (size + files[i].size, k))
    out: list[list[OutFile]] = [[] for _ in range(parts)]
    for i, f in enumerate(files):
        out[owner[i]].append(f)
    return [p for p in out if p]


#: Imported once by the fork server, so that each worker starts in milliseconds instead of
#: importing torch and torch.distributed itself (seconds each; on a shared 2-core machine
#: two spawned workers spent most of a 1 GiB conversion importing).
PRELOAD = ["torch", "torch.distributed", "dcp_reader", "dcp_platform", "dcp_load._convert_fill", "dcp_load._load"]


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


def run_workers(src: str, root: str, files: Sequence[OutFile], workers: int, *, sources: Any, native: bool,
                on_bytes: Callable[[int], None], on_file: Callable[[FileResult], None]) -> list[FileResult]:
    """Fill ``files`` on ``workers`` processes. A worker that fails or dies stops the others;
    the error names it and its cause. Waits are bounded by the workers' lives: a dead worker
    is seen within ``_POLL_S``."""
    ctx = _context()
    messages = ctx.Queue()
    import torch

    parts = split_files(files, workers)
    threads = max(1, torch.get_num_threads() // len(parts))  # the workers share this process's threads
    procs = [ctx.Process(target=worker_main, args=(src, root, part, sources, native, messages, threads),
                         name=f"dcp-convert-{k}", daemon=True) for k, part in enumerate(parts)]
    results: list[FileResult] = []
    done: set[int] = set()
    try:
        for p in procs:
            p.start()
        finished = 0
        while finished < len(procs):
            try:
                msg = messages.get(timeout=_POLL_S)
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and messages.empty():
                    raise RuntimeError(f"convert worker {dead[0].name} died (exit code {dead[0].exitcode}) "
                                       "without reporting an error; the conversion was abandoned") from None
                continue
            if msg[0] == "bytes":
                on_bytes(msg[1])
            elif msg[0] == "file":
                results.append(msg[1])
                on_file(msg[1])
            elif msg[0] == "error":
                raise RuntimeError(f"a convert worker failed: {msg[1]}")
            else:
                finished += 1
        for k, p in enumerate(procs):
            p.join(timeout=60)
            done.add(k)
    finally:
        for k, p in enumerate(procs):
            if k not in done and p.is_alive():
                p.terminate()
                p.join(timeout=10)
        messages.close()
    order = {f.name: i for i, f in enumerate(files)}
    return sorted(results, key=lambda r: order[r.name])
