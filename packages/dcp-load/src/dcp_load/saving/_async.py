"""``async_save``: ``save`` that returns once its snapshot is taken, and writes behind.

On the caller's thread, every rank makes the checks and the one exchange of ``save``
(``plan_save``: rank 0's lock, the layout, every refusal), then copies the boxes it writes
(only those: a replicated box is copied by its one writer) into the staging pool and
returns a ``Future``. A background thread then writes this rank's file from the copies and
coordinates the commit through the platform's key-value store only, never through a
process group: the training loop keeps its communicators to itself (an all-reduce on the
default group while the save commits does not pair with the save's traffic).

The commit through the store (keys under ``dcp-save/<n>/fin``): each rank publishes its
write errors (``w/<rank>``) and counts itself in ``n``; rank 0 waits until every rank
counted (bounded by ``timeout``, from when its own write finished; a dead rank is named by
the watch's heartbeats), commits when nobody failed (the rename of ``save``), and publishes
the outcome; the others wait for it, and rank 0 waits until they have read it (a store that
rank 0 hosts ends with its process). A failure anywhere makes every rank's future raise the
same ``LoadError``, and every rank removes its new files: the committed checkpoint is the
old one. Store traffic per rank: 4 operations, plus one poll every <= ``POLL_MAX_S`` while
waiting; rank 0, the last to count itself as having read the outcome, removes the keys.

The commit uses the store captured at the call (``Watch.store``), never the process group:
a script may call ``destroy_process_group()`` and exit without ``result()``, and the save
still commits (the thread is not a daemon). A failure nobody observed is logged at WARNING
on every rank when it happens and again at ERROR when its future is dropped (``_future``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from dcp_platform import PeerFailure
from dcp_platform.codec import decode, decode_failures, decode_strings, encode, encode_failures

from .._errors import LoadError
from ..run._coordinate import MIN_STALL_S, Coordinator, refused_together
from ..run._torch_args import NATIVE, WriterOptions, save_arguments, writer_options
from ._future import SaveFuture
from ._queue import InFlight, begin
from ._save import PlannedSave, SaveReport, box_data, commit, plan_save, resolve_save, save_slot, write_files
from ._staging import POOL, StagingStopped

__all__ = ["POLL_MAX_S", "async_save"]

logger = logging.getLogger(__name__)

#: Longest pause between two store polls while waiting for the others: a finished write is
#: noticed within it, at ~50 store operations per second per waiting rank.
POLL_MAX_S = 0.02
_SAVES = 0  # async saves of this process, for thread names


def async_save(
    state_dict: Mapping[Any, Any],
    *,
    checkpoint_id: str | os.PathLike[str],
    no_dist: bool = False,
    allow_pickle: bool = False,
    platform: Any = None,
    timeout: Any = None,
    process_group: Any = None,
    storage_writer: Any = None,
    planner: Any = None,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
    use_collectives: bool = True,
    format: str = "native",  # noqa: A002 - save's name
) -> Future[SaveReport]:
    """``save``, returning once every value it writes is copied: a ``Future`` whose
    ``result()`` is this rank's ``SaveReport``, or raises the ``LoadError`` that names every
    failing rank (the same on every rank; the old checkpoint stays committed).

    Call on every rank with ``save``'s arguments. The caller may change or free its tensors
    as soon as the call returns. Refusals that come before anything is written (a second
    writer, boxes that do not tile, a value that cannot be stored) raise here, as from
    ``save``. A call waits first for this process's previous ``async_save`` to finish, so
    one process's saves run in call order and at most one copy is staged (``release_staging``
    frees it). The commit goes through the store captured at the call: destroying the
    process group right after the call (and exiting) still commits; only ``result()`` tells
    whether it did. ``process_group``: as for ``save``; the commit goes through that group's store.
    torch DCP's ``storage_writer``, ``planner`` and ``use_collectives`` are taken as by
    ``save``; ``async_checkpointer_type`` and ``async_stager`` are accepted and stand for what
    dcp does instead (a thread writes; only the boxes this rank writes are staged, into a
    reused pool). The future also has torch's ``staging_completion`` (done at return) and
    ``upload_completion`` (itself). ``format``: as for ``save`` (``"torch_dcp"``: torch's files).
    """
    del async_checkpointer_type, async_stager  # docs/from-torch-dcp.md
    start = time.perf_counter()
    slot = save_slot(no_dist, process_group)
    path, leaves, platform, wait_s, collective, options = refused_together("save", slot, process_group, lambda: (
        *_resolve(state_dict, save_arguments(checkpoint_id, storage_writer, planner, use_collectives, no_dist,
                                             "async_save"), no_dist, platform, timeout, process_group),
        writer_options(storage_writer, format, "async_save")))
    inflight, _ = begin(path)  # the wait counts in blocked_seconds
    try:
        future, job = _snapshot(platform, collective, wait_s, leaves, path, allow_pickle, no_dist, start, inflight,
                                slot, options)
    except BaseException:
        inflight.done.set()
        raise
    global _SAVES
    _SAVES += 1
    # Not a daemon: a script that ends without result() still commits its last save.
    threading.Thread(target=job, name=f"dcp-async-save-{_SAVES}").start()
    return future


def _resolve(state_dict: Mapping[Any, Any], checkpoint_id: Any, no_dist: bool, platform: Any, timeout: Any,
             process_group: Any) -> tuple[str, list[Any], Any, float, bool]:
    """``resolve_save`` for ``async_save``, which needs a store to commit through."""
    out = resolve_save(state_dict, checkpoint_id, no_dist, platform, timeout, "async_save", process_group)
    if out[4] and out[2].store() is None:
        raise ValueError(f"async_save: the {out[2]!r} platform has no key-value store, which the background "
                         "commit coordinates through (it keeps off the training loop's communicators); use save")
    return out


def _snapshot(platform: Any, collective: bool, wait_s: float, leaves: list[Any], path: str, allow_pickle: bool,
              no_dist: bool, start: float, inflight: InFlight, slot: int | None, options: WriterOptions = NATIVE
              ) -> tuple[Future[SaveReport], Callable[[], None]]:
    """The caller's part: checks, exchange, copies. Returns the future and its job."""
    with contextlib.ExitStack() as stack:
        coord = stack.enter_context(Coordinator(platform, collective=collective, timeout=wait_s, operation="save",
                                                slot=slot, target=path))
        coord.arrive()
        planned = _plan(coord, platform, collective, leaves, path, allow_pickle, no_dist, options)
        if planned.me == 0:
            logger.info("async_save %s into %s: started (%d tensors, %d bytes)", planned.save_id, path,
                        *planned.counts)
        staged: dict[str, Any] | None = None
        try:
            staged, nbytes, staging_s = _staged(planned, platform)
            if planned.encoded is not None:  # the inline values are the caller's objects: copy them too
                planned.encoded = dataclasses.replace(planned.encoded, inline=copy.deepcopy(planned.encoded.inline))
        except BaseException:
            planned.release_lock()
            if staged is not None:
                POOL.done()
            raise
        timings = {"staging_seconds": staging_s, "staged_bytes": nbytes,
                   "blocked_seconds": time.perf_counter() - start}
        if planned.me == 0:
            logger.info("async_save %s into %s: staged %d bytes in %.3f s; writing in the background",
                        planned.save_id, path, nbytes, timings["staging_seconds"])
        background = stack.pop_all()
    future = SaveFuture(path)
    future.set_running_or_notify_cancel()

    def job() -> None:
        _background(coord, background, planned, staged, timings, start, wait_s, future, inflight)

    return future, job


def _plan(coord: Coordinator, platform: Any, collective: bool, leaves: list[Any], path: str, allow_pickle: bool,
          no_dist: bool, options: WriterOptions = NATIVE) -> PlannedSave:
    """``plan_save``, copying the boxes this rank wrote last time with the same holdings
    while the ranks agree (the pool is free again when the plan fails)."""
    early: list[Any] = []

    def stage_early(data: dict[str, Any], stop: Callable[[], bool]) -> tuple[dict[str, Any], int, float] | None:
        try:
            early.append(_stage(data, platform, stop))
        except StagingStopped:  # the ranks agreed on other boxes: a rank that gathers waits
            return None
        return early[-1]

    try:
        return plan_save(coord, platform, collective, leaves, path, allow_pickle, no_dist, while_agreeing=stage_early,
                         options=options)
    except BaseException:
        if early:
            POOL.done()
        raise


def _staged(planned: PlannedSave, platform: Any) -> tuple[dict[str, Any], int, float]:
    """(copies of the boxes this rank writes, their bytes, the seconds copying took): those
    copied while the ranks agreed when they are the boxes agreed on, else copied now."""
    data = box_data(planned)
    if planned.early is not None:
        staged, nbytes, seconds = planned.early
        if staged.keys() == data.keys() and all(tuple(staged[k].shape) == tuple(v.shape) for k, v in data.items()):
            return staged, nbytes, seconds
        POOL.done()  # the layout changed since this rank last wrote: copy what it writes now
        logger.debug("async_save: the boxes staged early are not this save's; staging again")
    return _stage(data, platform)


def _stage(data: dict[str, Any], platform: Any, stop: Callable[[], bool] | None = None
           ) -> tuple[dict[str, Any], int, float]:
    t0 = time.perf_counter()
    staged, nbytes = POOL.stage(data, platform, stop=stop)
    return staged, nbytes, time.perf_counter() - t0


def _background(coord: Coordinator, stack: contextlib.ExitStack, planned: PlannedSave, staged: dict[str, Any],
                timings: dict[str, Any], start: float, wait_s: float, future: Future[SaveReport],
                inflight: InFlight) -> None:
    """Write, commit, close the watch, settle the future (in this order: a save waiting for
    this one may start as soon as the future is set)."""
    outcome: Any = None
    try:
        errors: list[str] = []
        t0 = time.perf_counter()
        try:
            files, value_meta = write_files(planned, staged, errors)
        finally:
            staged.clear()
            POOL.done()
        write_s = time.perf_counter() - t0
        _finish(coord, planned, errors, files, value_meta, wait_s)
        outcome = planned.report(len(planned.mine), sum(i.nbytes for i in planned.mine),
                                 time.perf_counter() - start, write_seconds=write_s, **timings)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the future
        outcome = exc
    planned.release_lock()
    try:
        if isinstance(outcome, BaseException):
            stack.__exit__(type(outcome), outcome, outcome.__traceback__)
        else:
            stack.__exit__(None, None, None)
    except BaseException as exc:  # noqa: BLE001 - the watch turned a peer's failure into LoadError
        outcome = exc
    inflight.done.set()
    if isinstance(outcome, SaveReport):
        if planned.me == 0:
            logger.info("async_save %s into %s: committed, %.3f s after the call", planned.save_id, planned.path,
                        outcome.seconds)
        future.set_result(outcome)
    else:
        agreed = isinstance(outcome, LoadError)  # an outcome the ranks share (the agreement, a peer failed)
        outcome = outcome if agreed else _as_load_error(planned, outcome)
        logger.warning("async_save %s into %s: failed (%s): %s", planned.save_id, planned.path,
                       "the checkpoint before it stays committed" if agreed else
                       "this rank did not learn whether rank 0 committed it", str(outcome)[:500])
        future.set_exception(outcome)


#: Added to a failure of the commit's store traffic after the process group was destroyed.
DESTROYED = ("the process group was destroyed before this save committed, and the commit's key-value "
             "store could not be reached (its host, rank 0 with a tcp:// or env:// rendezvous, may have "
             "exited); call result() on every rank's future before destroy_process_group()")


def _as_load_error(planned: PlannedSave, exc: BaseException) -> LoadError:
    causes = [f"{type(exc).__name__}: {exc}"]
    if planned.collective and _group_gone(planned.platform):
        causes.append(DESTROYED)
    err = LoadError({planned.rank: causes}, "save")
    err.__cause__ = exc
    return err


def _group_gone(platform: Any) -> bool:
    """Whether the process group this save ran within has been destroyed since."""
    try:
        return not platform.is_distributed()
    except Exception:  # noqa: BLE001 - a group that cannot answer is gone for this purpose
        return True


def _finish(coord: Coordinator, planned: PlannedSave, errors: list[str], files: list[str],
            value_meta: dict[str, Any], wait_s: float) -> None:
    """Agree on the write's outcome through the store, rank 0 commits (module docstring);
    ``LoadError`` on every rank when any rank failed, after removing this rank's files."""
    if not planned.collective:
        failures = {planned.rank: list(errors)} if errors else {}
        if not failures and planned.me == 0:
            commit(planned.writer, planned.lock, planned.metadata(value_meta), errors)
            failures = {planned.rank: list(errors)} if errors else {}
    else:
        failures = _agree_through_store(coord, planned, errors, value_meta, wait_s)
    if failures:
        # Only on an outcome every rank read: after a peer's death (PeerFailure) rank 0 may
        # have committed, so the files stay (a next save removes them if nothing names them).
        planned.writer.discard(files)
        coord._shared = True  # every rank read the same outcome: nothing to publish
        raise LoadError(failures, "save")


def _agree_through_store(coord: Coordinator, planned: PlannedSave, errors: list[str], value_meta: dict[str, Any],
                         wait_s: float) -> dict[int, list[str]]:
    # The store the watch was made with, not the platform's now: the caller may destroy
    # the process group before the commit (the store stays alive while referenced).
    store, watch, world = coord.watch.store, coord.watch, planned.world
    base = f"{watch.name}/fin"
    mine = f"{base}/w/{planned.me}"
    # Messages through the store are the codec's JSON, never pickles: any process that
    # reaches the store's port can write these keys (dcp_platform.codec).
    store.set(mine, encode("save-errors", list(errors)))
    if errors:
        store.add(f"{base}/bad", 1)
    store.add(f"{base}/n", 1)
    if planned.me == 0:
        bound = max(wait_s, MIN_STALL_S)
        if not _poll(watch, lambda: store.add(f"{base}/n", 0) >= world, bound):
            failures = {r: [f"had not written its files {bound:g} s after rank 0 had (the timeout of the save)"]
                        for r in range(world) if not store.check([f"{base}/w/{r}"])}
        else:
            failures = {}
            if store.add(f"{base}/bad", 0):
                failures = {r: e for r in range(world) if (e := _errors_of(store, f"{base}/w/{r}"))}
        if not failures:
            commit(planned.writer, planned.lock, planned.metadata(value_meta), errors)
            if errors:
                failures = {0: list(errors)}
        store.set(f"{base}/outcome", encode_failures("save-outcome", failures))
        _until_read(watch, store, base, world, max(wait_s, MIN_STALL_S))
    else:
        _poll(watch, lambda: store.check([f"{base}/outcome"]), None)
        failures = {r: list(c) for r, c in decode_failures(store.get(f"{base}/outcome"), key=f"{base}/outcome",
                                                               kind="save-outcome", world=world).items()}
    store.delete_key(mine)
    if store.add(f"{base}/seen", 1) >= world:  # the last reader removes the shared keys
        for key in ("n", "bad", "outcome", "seen"):
            store.delete_key(f"{base}/{key}")
    return failures


def _errors_of(store: Any, key: str) -> list[str]:
    """One rank's write errors as it published them under ``key`` (a codec message)."""
    return decode_strings(decode(store.get(key), key=key, kind="save-errors"), key=key)


def _until_read(watch: Any, store: Any, base: str, world: int, bound_s: float) -> None:
    """Rank 0, once the outcome is published: wait (<= ``bound_s``) until every other rank
    has read it. A store hosted by rank 0 (``tcp://`` or ``env://`` rendezvous without an
    agent) ends with rank 0's process: a script that exits right after ``async_save`` and
    ``destroy_process_group()`` left the others failing to read a committed outcome
    ("Broken pipe"). A rank that died reads nothing: its death ends the wait."""
    try:
        _poll(watch, lambda: store.add(f"{base}/seen", 0) >= world - 1, bound_s)
    except PeerFailure:  # the outcome stands; the dead rank's own future is moot
        logger.debug("async_save: a rank died before reading the outcome of %s", base)


def _poll(watch: Any, ready: Callable[[], bool], bound_s: float | None) -> bool:
    """Wait until ``ready()``; False after ``bound_s``; ``PeerFailure`` once the watch saw
    a failure published or a rank die."""
    start, pause = time.monotonic(), 0.001
    while not ready():
        watch.check()
        if bound_s is not None and time.monotonic() - start > bound_s:
            return False
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    return True
