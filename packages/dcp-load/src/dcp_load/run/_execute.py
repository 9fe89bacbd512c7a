"""Running the agreed plan: reads on a read-ahead thread, broadcasts on the calling thread.

A rank with nothing to broadcast or receive (one process, or every rank reading for itself)
reads on up to ``MAX_READ_THREADS`` threads instead, as many as torch's intra-op threads,
each with a sibling reader, its reads dealt by bytes.

The read-ahead thread reads this rank's pieces in the agreed order, narrowed in the file,
straight into their destination views: first the pieces this rank broadcasts (in broadcast
order, so the broadcast scheduler rarely waits), then the pieces only it wants. The calling
thread runs ``dcp_broadcast.broadcast_items`` over every replicated piece; its ``prepare``
hook blocks until the thread has produced the piece about to be sent.

A read failure does not stop the collective schedule: the thread records it and releases
every waiting piece, the source sends whatever its destination holds, and the caller
raises on every rank after a final exchange of errors. The thread is joined on every path.
"""

from __future__ import annotations

import heapq
import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layouts._targets import Target
from ..plan._items import GlobalPlan, ReadItem
from ..plan._read_cost import ReadCost, choose, read_cost_of
from ._device import DeviceLoad
from ._stage import StagingPool, can_cover, covering_geometry, read_covering, read_staged, saved_box
from ._together import read_together, row_groups

__all__ = ["ExecuteStats", "execute"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecuteStats:
    """What this rank moved: pieces and bytes read, broadcast statistics, errors met."""

    pieces_read: int
    bytes_read: int
    broadcasts: int
    bytes_sent: int
    bytes_received: int
    read_seconds: float
    broadcast_seconds: float
    errors: tuple[str, ...]
    bytes_fetched: int = 0  # bytes_read plus what covering reads fetched around their boxes


class _ReadAhead(threading.Thread):
    def __init__(self, reader: Any, reads: Sequence[ReadItem], targets: Mapping[str, Target],
                 events: Mapping[int, threading.Event], staged: Mapping[int, Any],
                 on_read: Callable[[int], None] | None = None, positions: Sequence[int] | None = None,
                 pool: StagingPool | None = None, device: DeviceLoad | None = None):
        super().__init__(name="dcp-load-read-ahead", daemon=True)
        self.device = device  # the copy engines of device destinations (``_device``), or None
        # the plan positions of ``reads`` (default 0, 1, ...): several threads may share a plan
        self.positions = range(len(reads)) if positions is None else positions
        self.on_read = on_read  # told each piece's bytes once it is in place (progress)
        self.reader, self.reads, self.targets, self.events = reader, reads, targets, events
        self.staged = staged  # read position -> staging tensor to read into instead of the target
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.seconds = 0.0
        # staging for casts, strided destinations and covering reads: the load's pool, shared
        # by its reading threads (each holds one buffer at a time), or one of its own
        self.own_pool = pool is None
        self.pool = StagingPool(buffers=1) if pool is None else pool
        self.cost = read_cost_of(reader)

    def _on_device(self, engine: Any, item: ReadItem, chunk: Any, dest: Any, saved: str, position: int) -> None:
        """Read a piece into device memory through pinned buffers; a piece feeding a
        broadcast orders the broadcasting stream after its copies."""
        assert self.device is not None
        copied = self.device.read(engine, self.reader, item, chunk, dest, saved, not item.cached)
        if position in self.events:
            self.device.publish(engine, copied)

    def _read_group(self, group: Sequence[int]) -> bool:
        """Read the reads at indices ``group`` (``row_groups``: one, or boxes of one slab's
        rows read together) and tell each one's waiters; False after a failure (recorded)."""
        tensors = self.reader.metadata.tensors
        items = [self.reads[i] for i in group]
        positions = [self.positions[i] for i in group]
        chunk = tensors[items[0].name].chunks[items[0].chunk]
        item = items[0]
        try:
            dests = [self._dest(p, i) for p, i in zip(positions, items, strict=True)]
            if len(items) > 1 and self._together(items, chunk, dests, tensors):
                for item, position in zip(items, positions, strict=True):
                    self._finished(item, position)
                return True
            for item, dest, position in zip(items, dests, positions, strict=True):
                self._read_one(item, chunk, dest, position, tensors)
                self._finished(item, position)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            self.errors.append(f"reading {item.name!r} box offsets={item.offsets} sizes={item.sizes} from "
                               f"{chunk.file!r} failed: {type(exc).__name__}: {exc}")
            return False
        return True

    def _dest(self, position: int, item: ReadItem) -> Any:
        """Where the piece at ``position`` lands: its staging tensor, else its target view."""
        dest = self.staged.get(position)
        return self.targets[item.name].view(item.offsets, item.sizes) if dest is None else dest

    def _read_one(self, item: ReadItem, chunk: Any, dest: Any, position: int, tensors: Mapping[str, Any]) -> None:
        target = self.targets[item.name]
        saved = _saved_dtype(self.reader, item.name, chunk, tensors)
        engine = None if self.device is None else self.device.engine_for(dest)
        if engine is None or target.adapter.name != "torch":
            _read_piece(self.reader, item, chunk, target, dest, saved, self.pool, self.cost)
        else:
            self._on_device(engine, item, chunk, dest, saved, position)

    def _together(self, items: Sequence[ReadItem], chunk: Any, dests: Sequence[Any],
                  tensors: Mapping[str, Any]) -> bool:
        """Read boxes of one slab's rows as one covering range (``_together``) when every
        destination is a host torch tensor; False, with nothing read, otherwise."""
        import torch

        if any(self.targets[i.name].adapter.name != "torch" for i in items) or (
                self.device is not None and any(self.device.engine_for(d) is not None for d in dests)):
            return False
        saved = _saved_dtype(self.reader, items[0].name, chunk, tensors)
        return read_together(self.reader, items, chunk, dests, getattr(torch, saved).itemsize, self.pool,
                             not items[0].cached, self.cost.max_overread)

    def _finished(self, item: ReadItem, position: int) -> None:
        """A piece is in place: count it, tell the progress and the broadcast waiting for it."""
        if self.on_read is not None:
            self.on_read(item.nbytes)
        self.done += 1
        event = self.events.get(position)
        if event is not None:
            event.set()

    def run(self) -> None:
        start = time.perf_counter()
        try:
            for group in row_groups(self.reads):
                if self.stop.is_set() or not self._read_group(group):
                    break
        finally:
            # Release every waiter: after a failure the broadcasts still run (with whatever
            # the destination holds) so that no other rank hangs in a collective. A thread
            # that finished its own reads leaves the other threads' events alone.
            failed = bool(self.errors) or self.stop.is_set()
            mine = self.positions if isinstance(self.positions, range) else set(self.positions)
            for position, event in self.events.items():
                if failed or position in mine:
                    event.set()
            if self.own_pool:
                self.pool.close()
            self.seconds = time.perf_counter() - start


#: Pieces read at once from an object store by one rank (each on its own thread and
#: reader; each piece's GETs run in parallel too): a piece's latency (20-50 ms per GET)
#: would otherwise be paid once per piece, one after the other.
def remote_readers(reader: Any, reads: Sequence[ReadItem]) -> int:
    """Threads to read ``reads`` with: ``DCP_STORAGE_READERS`` (default 8) when the
    checkpoint is in an object store, else 1."""
    from dcp_reader.storage import ObjectOptions, storage_type

    if len(reads) < 2 or storage_type(getattr(reader, "path", None)).local or not hasattr(reader, "sibling"):
        return 1
    return max(1, min(ObjectOptions.from_env().readers, len(reads)))


class _ReadAheads:
    """``_ReadAhead`` on ``n`` threads, the plan's pieces dealt round robin (so that they
    finish about in the plan's order, which the broadcasts follow; the boxes of one slab
    that are read together, ``_together.row_groups``, as one), each with its own sibling
    reader; one thread and the caller's reader when ``n`` is 1."""

    def __init__(self, reader: Any, reads: Sequence[ReadItem], targets: Mapping[str, Target],
                 events: Mapping[int, threading.Event], staged: Mapping[int, Any],
                 on_read: Callable[[int], None] | None, n: int, pool: StagingPool | None = None,
                 device: DeviceLoad | None = None):
        self.readers = [reader] + [reader.sibling() for _ in range(n - 1)]
        dealt: list[list[int]] = [[] for _ in range(n)]
        for k, group in enumerate(row_groups(reads)):  # a slab's boxes read together stay together
            dealt[k % n].extend(group)
        self.threads = [_ReadAhead(r, [reads[i] for i in mine], targets, events, staged, on_read, mine, pool, device)
                        for r, mine in zip(self.readers, dealt, strict=True)]

    def start(self, inline: bool = False) -> None:
        """Start the threads; ``inline``: one reader and nothing to feed, so its reads run
        here, on the calling thread. Starting and joining a thread cost 1.5-3 ms per load
        on 2 busy cores (cProfile of a 1 MiB load on 2 gloo ranks), a tenth of a small load."""
        if inline and len(self.threads) == 1:
            self.threads[0].run()
            return
        for t in self.threads:
            t.start()

    @property
    def stop(self) -> Any:
        return _StopAll(self.threads)

    def join(self) -> None:
        try:
            for t in self.threads:
                if t.ident is not None:
                    t.join()
        finally:
            for r in self.readers[1:]:
                r.close()

    def bytes_read(self, before: int) -> int:
        return self.readers[0].bytes_read - before + sum(r.bytes_read for r in self.readers[1:])

    def bytes_fetched(self, before: int) -> int:
        return fetched(self.readers[0]) - before + sum(fetched(r) for r in self.readers[1:])

    @property
    def done(self) -> int:
        return sum(t.done for t in self.threads)

    @property
    def seconds(self) -> float:
        return max(t.seconds for t in self.threads)

    @property
    def errors(self) -> list[str]:
        return [e for t in self.threads for e in t.errors]


class _StopAll:
    def __init__(self, threads: Sequence[_ReadAhead]):
        self.threads = threads

    def set(self) -> None:
        for t in self.threads:
            t.stop.set()


def _saved_dtype(reader: Any, name: str, chunk: Any, tensors: Mapping[str, Any]) -> str:
    """The dtype of ``chunk``'s saved bytes: its tensor's, or a composed part's own."""
    of = getattr(reader, "chunk_dtype", None)
    return of(name, chunk) if of is not None else tensors[name].dtype


def _read_piece(reader: Any, item: ReadItem, chunk: Any, target: Target, dest: Any, saved_dtype: str,
                pool: StagingPool | None = None, cost: ReadCost | None = None) -> None:
    """Read one piece into ``dest``. A box that is not contiguous in its saved chunk may be
    read as covering ranges through ``pool`` (``_covered``); a contiguous torch destination
    of the saved dtype is read in place (``CheckpointReader.read_into``: one copy instead of
    two); a cast or a strided torch destination is staged in bounded pieces
    (``_stage.read_staged``); a MindSpore destination goes through ``read`` and the
    adapter's copy. Block checksums are verified by the rank that fetches a box for its
    host, not again by the ranks that re-read it from that host's page cache."""
    verify = not item.cached  # a page-cache re-read: the fetching rank of this host verifies
    torch_dest = target.adapter.name == "torch"
    if torch_dest and pool is not None and cost is not None and _covered(reader, item, chunk, dest, saved_dtype,
                                                                         pool, cost, verify):
        return
    if torch_dest and target.dtype == saved_dtype and dest.is_contiguous():
        reader.read_into(item.name, chunk, item.offsets, item.sizes, dest, verify=verify)
        return
    if torch_dest and pool is not None:
        # a cast or a strided destination: staged in bounded pieces, never the whole box
        read_staged(reader, item, chunk, dest, saved_dtype, target.dtype == saved_dtype, pool, verify)
        return
    data = reader.read(item.name, chunk, item.offsets, item.sizes, framework=target.adapter.read_framework,
                       verify=verify)
    target.adapter.copy(dest, data)


def _covered(reader: Any, item: ReadItem, chunk: Any, dest: Any, saved_dtype: str, pool: StagingPool,
             cost: ReadCost, verify: bool) -> bool:
    """Read the box as covering ranges when the read cost model (``plan._read_cost``) says
    that beats its exact runs; False (nothing read) when it does not, or when the reader
    cannot."""
    import torch

    inner, name, saved, offsets, sizes, out = saved_box(reader, item.name, chunk, item.offsets, item.sizes, dest)
    if not can_cover(inner):
        return False
    itemsize = getattr(torch, saved_dtype).itemsize
    choice = choose(covering_geometry(saved, offsets, sizes, itemsize), cost, pool.buffer_bytes)
    if not choice.covering:
        return False
    return read_covering(inner, name, saved, offsets, sizes, out, choice, itemsize, pool, verify)


@dataclass
class _Schedule:
    """This rank's side of the broadcasts: one ``BroadcastItem`` per plan broadcast, the
    event of each read position that feeds one (this rank's sources, in order), and the
    staging tensors of destinations that cannot take a broadcast in place (a sub-box of a
    MindSpore tensor, which has no aliasing views), copied into place once every broadcast
    has completed. A box this rank relays (``ReadItem.relay``) is read into a staging
    tensor of its own and only sent."""

    items: list[Any] = field(default_factory=list)
    events: dict[int, threading.Event] = field(default_factory=dict)  # read position -> event
    by_item: dict[int, threading.Event] = field(default_factory=dict)  # broadcast index -> event
    staged: list[tuple[Target, ReadItem, Any]] = field(default_factory=list)
    staged_at: dict[int, Any] = field(default_factory=dict)  # read position -> staging tensor

    @classmethod
    def of(cls, platform: Any, plan: GlobalPlan, rank: int, targets: Mapping[str, Target]) -> _Schedule:
        from dcp_broadcast import BroadcastItem

        out = cls()
        for index, item in enumerate(plan.broadcasts):
            tensor = None
            if item.relay and item.reader == rank:  # read only to be sent: into staging, never copied
                tensor = platform.empty(item.sizes, platform.dtype_from_name(targets[item.name].dtype))
            elif rank in item.ranks:
                target = targets[item.name]
                if target.in_place(item.offsets, item.sizes):
                    tensor = target.view(item.offsets, item.sizes)
                else:
                    tensor = platform.empty(item.sizes, platform.dtype_from_name(target.dtype))
                    out.staged.append((target, item, tensor))
            if item.reader == rank:
                position = len(out.events)
                out.events[position] = out.by_item[index] = threading.Event()
                if item.relay or (out.staged and out.staged[-1][1] is item):
                    out.staged_at[position] = tensor
            out.items.append(BroadcastItem(src=item.reader, ranks=item.ranks, nbytes=item.nbytes, tensor=tensor))
        return out


#: At most this many threads read at once when a rank has no broadcasts (its reads are all
#: its own): one process loading 1.08 GiB warm read ~4.5 GB/s on one thread; two threads
#: copying out of the page cache at once took 0.13 s per GiB against 0.20 s for one
#: (2-core development machine); more than 4 are not measured.
MAX_READ_THREADS = 4


def read_threads(reads: Sequence[ReadItem], targets: Mapping[str, Target]) -> int:
    """How many threads read ``reads`` when nothing is broadcast: torch's intra-op thread
    count (the CPU budget a job gives each process; torchrun sets 1 per rank), capped by
    ``MAX_READ_THREADS`` and the number of reads; 1 for other frameworks."""
    if len(reads) < 2 or any(targets[r.name].adapter.name != "torch" for r in reads):
        return 1
    import torch

    return max(1, min(MAX_READ_THREADS, torch.get_num_threads(), len(reads)))


def split_reads(reads: Sequence[ReadItem], parts: int) -> list[list[ReadItem]]:
    """``reads`` dealt into ``parts`` lists of about equal bytes: largest first to the list
    with the fewest bytes (ties to the lower list); each list keeps the plan's order."""
    loads = [(0, k) for k in range(parts)]
    owner: dict[int, int] = {}
    for i in sorted(range(len(reads)), key=lambda i: (-reads[i].nbytes, i)):
        nbytes, k = heapq.heappop(loads)
        owner[i] = k
        heapq.heappush(loads, (nbytes + reads[i].nbytes, k))
    out: list[list[ReadItem]] = [[] for _ in range(parts)]
    for i, item in enumerate(reads):
        out[owner[i]].append(item)
    return out


def _read_in_parallel(reader: Any, reads: Sequence[ReadItem], targets: Mapping[str, Target], threads: int,
                      on_read: Callable[[int], None] | None, pool: StagingPool | None = None,
                      device: DeviceLoad | None = None) -> ExecuteStats:
    """Every read of a rank with no broadcasts, on ``threads`` threads, each with its own
    reader (``CheckpointReader.sibling``: a reader serves one thread at a time)."""
    lock = threading.Lock()

    def told(nbytes: int) -> None:
        assert on_read is not None
        with lock:
            on_read(nbytes)

    readers = [reader] + [reader.sibling() for _ in range(threads - 1)]
    before = [r.bytes_read for r in readers]
    before_fetched = [fetched(r) for r in readers]
    workers = [_ReadAhead(r, part, targets, {}, {}, told if on_read is not None else None, pool=pool, device=device)
               for r, part in zip(readers, split_reads(reads, threads), strict=True)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for w in workers:
            w.stop.set()
            if w.ident is not None:
                w.join()
        for r in readers[1:]:
            r.close()
    logger.debug("read %d piece(s) on %d threads in %.4f s", sum(w.done for w in workers), threads,
                 max(w.seconds for w in workers))
    return ExecuteStats(
        pieces_read=sum(w.done for w in workers),
        bytes_read=sum(r.bytes_read - b for r, b in zip(readers, before, strict=True)), broadcasts=0,
        bytes_sent=0, bytes_received=0, read_seconds=max(w.seconds for w in workers), broadcast_seconds=0.0,
        errors=tuple(e for w in workers for e in w.errors),
        bytes_fetched=sum(fetched(r) - b for r, b in zip(readers, before_fetched, strict=True)),
    )


def fetched(reader: Any) -> int:
    """Bytes ``reader`` took from storage (``bytes_fetched``; ``bytes_read`` for a reader
    that does not count them apart)."""
    return int(getattr(reader, "bytes_fetched", reader.bytes_read))


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS, Windows)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


#: Give memory back at most this often, unless it grew (``TRIM_GROWTH_BYTES``). A trim costs
#: the next load the page faults of the buffers it reallocates: one process loading 205
#: tensors (240 MB) took 0.237 s with a trim after every load against 0.215 s without
#: (median of 30 each, alternating).
TRIM_EVERY_S = 30.0
#: ... and give it back at once when the process's anonymous memory grew by this much since
#: the last trim. With the interval alone a burst of loads kept what their threads freed: 4
#: ranks loading 40 tensors 50 times in 7 s ("True", tests-integration/load) saw one trim,
#: at the first load, and three ranks' arenas held 20-45 MiB more free memory at the end
#: (malloc's in-use bytes unchanged, 108.3 -> 108.8 MiB).
TRIM_GROWTH_BYTES = 8 * 1024 * 1024

# [the looked-up function, when it last ran, the least anonymous memory since]: once per
# process (a list: no global statement)
_TRIM: list[Any] = []


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (Linux ``/proc/self/statm``: resident less
    shared pages), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def give_back_memory() -> None:
    """Return the free memory of every malloc arena to the system (glibc only), at most
    once per ``TRIM_EVERY_S`` unless the anonymous memory grew by ``TRIM_GROWTH_BYTES``
    since the last trim.

    Each load reads on threads of its own; glibc serves each thread from an arena whose
    freed memory it keeps. Over repeated loads a long-running process kept tens of MiB it
    no longer used (one rank of 4, 205 tensors, "auto": +42 MiB after 150 loads, where
    threads that outlived the loads had kept it at 12 MiB).
    """
    if not _TRIM:
        _TRIM.extend((_malloc_trim(), -TRIM_EVERY_S, anonymous_bytes()))
    trim, last, least = _TRIM
    if trim is None:
        return
    now, anon = time.monotonic(), anonymous_bytes()
    if now - last >= TRIM_EVERY_S or anon - least >= TRIM_GROWTH_BYTES:
        trim(0)
        _TRIM[1:] = [now, anonymous_bytes()]
    else:
        _TRIM[2] = min(least, anon)  # memory the caller freed since counts too


def execute(platform: Any, reader: Any, plan: GlobalPlan, rank: int, targets: Mapping[str, Target], *,
            batch_bytes: int, groups: Any = None, watch: Any = None,
            on_read: Callable[[int], None] | None = None) -> ExecuteStats:
    """Read this rank's pieces and run the broadcasts of ``plan`` (``rank``: its index there).

    ``watch``: a ``dcp_platform.Watch`` bounding every wait (see ``_coordinate``).
    ``on_read(nbytes)`` is called on the read-ahead thread after each piece is in place.
    """
    reads = plan.reads_for(rank)
    remote = remote_readers(reader, reads)
    threads = 1 if plan.broadcasts or not hasattr(reader, "sibling") else max(remote, read_threads(reads, targets))
    # one staging buffer per reading thread at most, reused by all of this load's pieces
    pool = StagingPool(buffers=max(threads, remote))
    device = DeviceLoad.of(platform, targets)
    try:
        if threads > 1:
            stats = _read_in_parallel(reader, reads, targets, threads, on_read, pool, device)
            _finish_copies(device)
            platform.synchronize()
            give_back_memory()
            return stats
        return _execute_scheduled(platform, reader, plan, rank, targets, reads, remote, pool, batch_bytes=batch_bytes,
                                  groups=groups, watch=watch, on_read=on_read, device=device)
    finally:
        pool.close()


def _finish_copies(device: DeviceLoad | None) -> None:
    """Wait once for the device copies of this load (none on the plain path)."""
    if device is not None:
        device.finish()


def _execute_scheduled(platform: Any, reader: Any, plan: GlobalPlan, rank: int, targets: Mapping[str, Target],
                       reads: Sequence[ReadItem], remote: int, pool: StagingPool, *, batch_bytes: int, groups: Any,
                       watch: Any, on_read: Callable[[int], None] | None,
                       device: DeviceLoad | None = None) -> ExecuteStats:
    """``execute`` with the read-ahead thread(s) feeding the broadcasts of ``plan``."""
    sched = _Schedule.of(platform, plan, rank, targets)
    assert all(r.reader == rank for r in reads[:len(sched.events)])
    items, events, by_item, staged, staged_at = (sched.items, sched.events, sched.by_item, sched.staged,
                                                 sched.staged_at)

    before, before_fetched = reader.bytes_read, fetched(reader)
    thread = _ReadAheads(reader, reads, targets, events, staged_at, on_read, remote, pool, device)
    thread.start(inline=not items)
    broadcasts = sent = received = 0
    t0 = time.perf_counter()
    try:
        if items:
            from dcp_broadcast import broadcast_items

            def prepare(index: int) -> None:
                if watch is not None:
                    watch.wait_event(by_item[index])  # a peer's failure ends the wait
                else:
                    by_item[index].wait()

            stats = broadcast_items(platform, items, batch_bytes=batch_bytes, groups=groups, prepare=prepare,
                                    watch=watch)
            broadcasts, sent, received = stats.broadcasts, stats.bytes_sent, stats.bytes_received
    except BaseException:
        thread.stop.set()
        raise
    finally:
        bcast_s = time.perf_counter() - t0
        thread.join()
    _finish_copies(device)
    platform.synchronize()
    for target, item, tensor in staged:
        target.adapter.copy(target.view(item.offsets, item.sizes), tensor)
    give_back_memory()
    logger.debug("rank %d: read %d piece(s) in %.4f s on the read-ahead thread; %d broadcast(s) "
                 "in %.4f s", platform.rank(), thread.done, thread.seconds, broadcasts, bcast_s)
    return ExecuteStats(
        pieces_read=thread.done, bytes_read=thread.bytes_read(before), broadcasts=broadcasts,
        bytes_sent=sent, bytes_received=received, read_seconds=thread.seconds,
        broadcast_seconds=bcast_s, errors=tuple(thread.errors), bytes_fetched=thread.bytes_fetched(before_fetched),
    )
