"""``broadcast_items``: run the plan with at most K broadcasts in flight per rank."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from dcp_platform import Platform

from ._groups import GroupManager
from ._items import DEFAULT_BATCH_BYTES, DEFAULT_MAX_IN_FLIGHT, BroadcastItem, BroadcastStats
from ._plan import Transfer, build_plan, supports_byte_ranges
from ._schedule import check_schedule as _check_schedule
from ._validate import item_errors, validate_arguments

logger = logging.getLogger(__name__)

_Finish = Callable[[], None] | None


class _Runner:
    """Issues the transfers this rank takes part in; waits oldest first beyond the cap."""

    def __init__(self, platform: Platform, items: Sequence[BroadcastItem], groups: GroupManager,
                 max_in_flight: int, prepare: Callable[[int], Any] | None, watch: Any = None):
        self.platform, self.items, self.groups = platform, items, groups
        self.watch = watch
        self.max_in_flight, self.prepare = max_in_flight, prepare
        self.rank = platform.rank()
        self.uint8 = platform.dtype_from_name("uint8")
        self.in_flight: deque[tuple[Any, _Finish, Any]] = deque()  # (handle, finish, pooled buffer)
        self.pool: list[Any] = []  # staging buffers of retired batched transfers, for reuse
        self.pool_bytes = 0
        self.broadcasts = self.items_moved = self.items_batched = 0
        self.bytes_sent = self.bytes_received = self.max_seen = 0
        self.pack_s = self.issue_s = self.wait_s = self.unpack_s = 0.0

    def run(self, plan: Sequence[Transfer]) -> None:
        subgroups = self.groups.subgroups
        # Every batched transfer stages through a buffer of the plan's largest batch, reused
        # once its transfer retired: at most max_in_flight exist, whatever the allocator
        # does with freed memory. A fresh buffer per transfer was freed in time, but glibc
        # then raised its mmap threshold to the batch size and kept the freed buffers on
        # its heap: 166 MiB peak extra memory per rank instead of 42-55 MiB with reuse
        # (6 MiB batches x 8 in flight, FSDP4 -> DP2xTP2 in benchmarks/run_all.py).
        self.pool_bytes = max((t.nbytes for t in plan if t.batched and self.rank in t.ranks), default=0)
        for transfer in plan:
            member = self.rank in transfer.ranks
            if not member and subgroups:
                continue
            # Wait before allocating, so staging memory stays under batch_bytes x K.
            while len(self.in_flight) >= self.max_in_flight:
                self._retire_oldest()
            buf, finish, pooled = self._stage(transfer, member)
            # A non-contiguous tensor sent alone travels through a full-size contiguous
            # temporary (Platform.broadcast): send it with nothing else in flight and wait
            # for it at once, so that at most one such temporary exists at a time.
            alone = not transfer.batched and _needs_temporary(buf)
            while alone and self.in_flight:
                self._retire_oldest()
            group = self.groups.get(transfer.ranks)
            t0 = time.perf_counter()
            handle = self.platform.broadcast(buf, transfer.src, group)
            self.issue_s += time.perf_counter() - t0
            self.broadcasts += 1
            self.max_seen = max(self.max_seen, len(self.in_flight) + 1)
            if handle is None:  # the backend completed it inline: the buffer is final now
                if finish is not None:
                    finish()
                if pooled is not None:
                    self.pool.append(pooled)
            else:
                self.in_flight.append((handle, finish, pooled))
                if alone:
                    self._retire_oldest()
        while self.in_flight:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        handle, finish, pooled = self.in_flight.popleft()
        t0 = time.perf_counter()
        if handle is not None:
            if self.watch is not None:
                self.watch.wait(handle)  # bounded: raises PeerFailure when a peer failed
            else:
                handle.wait()
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        if finish is not None:
            finish()
            self.unpack_s += time.perf_counter() - t1
        if pooled is not None:
            self.pool.append(pooled)

    def _staging(self, nbytes: int) -> tuple[Any, Any]:
        """(a pooled buffer, its first ``nbytes`` bytes): a retired transfer's buffer when
        there is one, else a new one of the plan's largest batch."""
        pooled = self.pool.pop() if self.pool else self.platform.empty((self.pool_bytes,), self.uint8)
        return pooled, pooled[:nbytes]

    def _stage(self, transfer: Transfer, member: bool) -> tuple[Any, _Finish, Any]:
        """The buffer to broadcast, what to do once its wait returns, and the pooled buffer
        to reuse after that (None when the buffer is not pooled)."""
        items, rank, platform = self.items, self.rank, self.platform
        is_src = rank == transfer.src
        if member:
            self.items_moved += len(transfer.indices)
            moved = sum(items[i].nbytes for i in transfer.indices)
            if is_src:
                self.bytes_sent += moved
            else:
                self.bytes_received += moved
        if not member:
            # World-group fallback: receive into scratch and drop it. A broadcast delivers
            # the whole buffer, so the scratch is as large as the transfer (README,
            # "Memory"); it is allocated after the in-flight wait like any staging.
            return platform.empty((transfer.nbytes,), self.uint8), None, None
        if not transfer.batched:
            index = transfer.indices[0]
            if is_src and self.prepare is not None:
                self.prepare(index)
            return items[index].tensor, None, None
        t0 = time.perf_counter()
        pooled, staging = self._staging(transfer.nbytes)
        self.items_batched += len(transfer.indices)
        assert transfer.offsets is not None
        tensors = [items[i].tensor for i in transfer.indices]
        views = [
            platform.from_bytes(staging[off:off + items[i].nbytes], t.dtype, tuple(t.shape))
            for i, off, t in zip(transfer.indices, transfer.offsets, tensors, strict=True)
        ]
        if is_src:
            if self.prepare is not None:
                for i in transfer.indices:
                    self.prepare(i)
            platform.fused_copy(views, tensors)
            self.pack_s += time.perf_counter() - t0
            return staging, None, pooled

        def scatter() -> None:
            platform.fused_copy(tensors, views)

        return staging, scatter, pooled


def _needs_temporary(tensor: Any) -> bool:
    contiguous = getattr(tensor, "is_contiguous", None)
    return contiguous is not None and not contiguous()


def _plan(platform: Platform, items: Sequence[BroadcastItem], batch_bytes: int) -> list[Any]:
    """The transfers of ``items``: packed below ``batch_bytes``, unless the platform cannot
    view part of a byte buffer (then every item goes alone)."""
    t_plan = time.perf_counter()
    plan = build_plan(items, batch_bytes)
    if any(t.batched for t in plan) and not supports_byte_ranges(platform):
        # Packing needs typed views of parts of one buffer; without them every item goes
        # alone. Every rank runs the same backend, so every rank decides the same way.
        logger.warning("the %r platform cannot view part of a byte buffer as a tensor; "
                       "broadcasting every item alone (batch_bytes=%d ignored)", platform.name,
                       batch_bytes)
        plan = build_plan(items, 0)
    logger.debug("rank %d: planned %d broadcast(s) for %d item(s) in %.4f s", platform.rank(), len(plan),
                 len(items), time.perf_counter() - t_plan)
    return plan


def broadcast_items(
    platform: Platform,
    items: Sequence[BroadcastItem],
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    groups: GroupManager | Mapping[tuple[int, ...], Any] | None = None,
    check_schedule: bool = False,
    prepare: Callable[[int], Any] | None = None,
    watch: Any = None,
) -> BroadcastStats:
    """Move every item from its source to the other ranks of its group; call on every rank.

    Every rank passes the same items in the same order (see ``BroadcastItem``) and the same
    ``batch_bytes`` and ``max_in_flight``. Items smaller than ``batch_bytes`` (0: none) are
    packed per (ranks, source) into staging buffers of at most ``batch_bytes``; larger ones
    go alone, in place. At most ``max_in_flight`` broadcasts are in flight per rank, waited
    oldest first; a receiver's tensor is written only after its broadcast's wait returns.

    ``groups``: ``None`` builds the groups needed and destroys them before returning; a
    ``GroupManager`` is used and left open (the caller owns it); a mapping from rank tuple
    to group supplies groups the caller owns (missing ones are built and destroyed).
    ``check_schedule``: one extra all-gather first, so that ranks whose items or settings
    differ, or whose items are invalid, raise ``ScheduleMismatchError`` on every rank
    instead of hanging (without it, invalid local items raise ``ValueError`` on that rank
    only). ``prepare(index)`` is called on the source just before item ``index``'s tensor
    is read; items waiting in a batch are prepared, in index order, when their batch is
    sent, so calls follow transfer order, which is not always index order.
    """
    start = time.perf_counter()
    validate_arguments(items, batch_bytes, max_in_flight, groups, prepare)
    rank = platform.rank()
    errors = item_errors(platform, items)
    if check_schedule:
        _check_schedule(platform, items, batch_bytes, max_in_flight, errors)
    elif errors:
        raise ValueError(f"broadcast_items: invalid items on rank {rank}:\n  " + "\n  ".join(errors))
    plan = _plan(platform, items, batch_bytes)
    manager = groups if isinstance(groups, GroupManager) else GroupManager(platform, groups, watch=watch)
    owned = manager is not groups
    with manager if owned else nullcontext(manager):
        manager.ensure({t.ranks for t in plan})
        runner = _Runner(platform, items, manager, max_in_flight, prepare, watch)
        t_run = time.perf_counter()
        runner.run(plan)
        logger.debug(
            "rank %d: %d broadcast(s), %d item(s) (%d batched) in %.4f s: pack %.4f s, issue "
            "%.4f s, wait %.4f s, unpack %.4f s", rank, runner.broadcasts, runner.items_moved,
            runner.items_batched, time.perf_counter() - t_run, runner.pack_s, runner.issue_s,
            runner.wait_s, runner.unpack_s)
    seconds = time.perf_counter() - start
    logger.debug("rank %d: broadcast_items done in %.4f s", rank, seconds)
    return BroadcastStats(
        broadcasts=runner.broadcasts, items=runner.items_moved, items_batched=runner.items_batched,
        bytes_sent=runner.bytes_sent, bytes_received=runner.bytes_received,
        max_in_flight_seen=runner.max_seen, seconds=seconds,
    )
