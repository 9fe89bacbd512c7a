"""Bounded, abort-aware waits for one collective operation (a load, a broadcast run).

Call order: every rank creates ``Watch(platform, name)`` with the same ``name`` (unique per
operation, e.g. ``"dcp-load/7"``), enters it (which hands it to the process's heartbeat
thread), calls ``arrive(timeout)`` once, then uses ``wait`` / ``wait_event`` / ``gather``
for every wait of the operation, and leaves it (which returns once no heartbeat of it runs
or will run) on success and on failure alike.

How ranks learn of a failure, through the platform's key-value store (``Platform.store``):

* **Arrival**: each rank adds itself to ``<name>/arrived``; the last one sets
  ``<name>/all``. A rank that does not arrive within ``timeout`` is named in the abort key
  by the ranks that did.
* **Abort key** ``<name>/abort``: the first rank that fails publishes its cause (rank ->
  causes, a ``codec`` message: never a pickle); every waiting rank sees it within
  ``HEARTBEAT_S`` and raises ``PeerFailure``. A value there that is not such a message (another
  process wrote the key) fails the operation too, its cause naming the key.
* **Barriers** ``<name>/b/<key>``: ``barrier(key, ranks)`` meets some ranks only (a new
  group's members before they connect), bounded like every other wait.
* **Heartbeats** ``<name>/hb/<rank>``: every ``heartbeat_s`` while the watch is open, each
  rank bumps its own key, reads the abort key, and (once arrived) watches its ring
  successor's key. A successor whose key has not changed for ``STALE_S`` is named dead in
  the abort key (with at least one live rank, some live rank watches a dead one).

One thread per process, ``dcp-heartbeat`` (``HEARTBEAT_THREAD``), beats every open watch
on its own schedule; it is started by the first watch entered and then stays, idle (blocked,
no wake-ups) while no watch is open. With a thread started and joined per watch, entering
and closing a load's watch took 0.31-0.61 ms per rank, 0.14-0.21 ms with the one thread
(each benchmarks/bench_tp.py case on 2 gloo ranks, medians of 30 loads, measured
alternately); entering alone took up to 2.4 ms on a busy 2-core machine, where ``start``
waits for a core to run the new thread.

Store traffic per rank: three operations per ``HEARTBEAT_S`` (2 s), so a 16k-rank job
puts ~24k operations per second on the store, independent of how many collectives run;
while arriving (or at a barrier), one non-blocking ``check`` per poll, the first poll after
``first_pause`` (31.25 us per rank, at most 10 ms), each pause twice the last up to 1 s
(about 15 in the first second for 2 ranks, then one per second); after an
arrival timeout one rank checks every rank's key once (the others wait for its verdict).
Waits poll with ``check`` rather than ``store.wait(timeout)``: each expired TCPStore wait
logged two ``[c10d] waitForInput`` warnings, about 1,200 lines per rank over a 10-minute
arrival wait.

``stall_s`` bounds each single wait on a collective (``wait``, and so ``gather``) and each
barrier, even while every rank is alive: ranks that disagree (one in an all-gather, another
broadcasting) would otherwise wait until the process-group timeout. On expiry the cause is
published like any failure. ``interrupted`` is True once a wait left a collective unfinished
(a failure was raised while its handle was pending): the process group may then hold that
collective, and later collectives on it would pair with the wrong partner.
Without a store (MindSpore) nothing is bounded: waits block as the backend does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ._base import Handle, Platform
from ._store_reduce import STORE_LANES_MAX, STORE_REDUCE_MAX, StoreReduction
from .codec import ControlMessageError, decode_failures, decode_ints, encode, encode_failures

__all__ = ["HEARTBEAT_S", "HEARTBEAT_THREAD", "STALE_S", "PeerFailure", "Watch"]

logger = logging.getLogger(__name__)

#: Seconds between a rank's heartbeats and abort-key checks.
HEARTBEAT_S = 2.0
#: The name of the process's one heartbeat thread (module docstring).
HEARTBEAT_THREAD = "dcp-heartbeat"
#: A heartbeat unchanged this long names its rank dead. Generous against a process that
#: holds the GIL for seconds, yet with HEARTBEAT_S it names a dead rank in <= 12 s.
STALE_S = 10.0
#: Longest single blocking wait on a handle between checks of the abort flag.
SLICE_S = 0.5
#: Store polls while waiting for a key: the first after ``first_pause(world)``, then twice
#: as long each time, up to POLL_MAX_S. POLL_MIN_S is the longest first pause.
POLL_MIN_S = 0.01
POLL_MAX_S = 1.0
#: The first pause per rank: ``world`` ranks polling every ``world`` x 31.25 us send a store
#: at most 32k checks a second, for the first milliseconds only, and larger worlds start
#: slower. A fixed 10 ms made every load's arrival cost a 10 ms sleep on the rank that came
#: first (2 gloo ranks, a 1 MiB load: 26 ms, of which 10.8 ms in the arrival); with 0.5 ms
#: per 16 ranks the first of 2 ranks still left the arrival 0.41-0.61 ms after the last one,
#: 0.13-0.19 ms with this pause (each benchmarks/bench_tp.py case on 2 gloo ranks, medians
#: of 30 loads, the two pauses measured alternately).
POLL_FIRST_PER_RANK_S = 0.0005 / 16


def first_pause(world: int) -> float:
    """The first store poll's pause for a wait that ``world`` ranks may share."""
    return min(POLL_MIN_S, POLL_FIRST_PER_RANK_S * max(1, world))


class PeerFailure(RuntimeError):
    """A rank of the operation failed, died or never arrived; ``failures``: rank -> causes."""

    def __init__(self, failures: Mapping[int, Sequence[str]]):
        self.failures = {int(r): tuple(c) for r, c in sorted(failures.items())}
        lines = [f"rank {r}: {c}" for r, causes in self.failures.items() for c in causes]
        super().__init__("; ".join(lines))

    def __reduce__(self):
        return (type(self), (self.failures,))


class Watch:
    """One operation's arrival barrier, abort key and heartbeat ring (see module docstring)."""

    def __init__(self, platform: Platform, name: str, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, stall_s: float | None = None):
        self.platform, self.name = platform, name
        self.stall_s = stall_s
        #: a wait raised while its collective was still pending (see module docstring)
        self.interrupted = False
        self.rank, self.world = platform.rank(), platform.world_size()
        self._store = platform.store()
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self._cause: dict[int, tuple[str, ...]] | None = None
        self._aborted = threading.Event()
        self._arrived = threading.Event()
        self._open = False  # entered, with a store: the heartbeat thread beats it
        self._successor = (-1, 0.0)  # its heartbeat's last value, and when that value changed
        self._cleanup: list[str] = []  # barrier keys this rank removes on success
        self._reductions = 0  # store reductions made so far (``start_reduce``)

    @property
    def store(self) -> Any:
        """The store this watch was made with (``Platform.store()`` at creation), or None.
        Kept by the watch: a commit that runs behind the caller (``async_save``) goes on
        through it after the process group was destroyed."""
        return self._store

    @property
    def bounded(self) -> bool:
        """Whether waits are bounded (the platform has a store)."""
        return self._store is not None

    def _key(self, *parts: object) -> str:
        return "/".join((self.name, *map(str, parts)))

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        if self._store is not None:
            self._store.add(self._key("hb", self.rank), 1)
            self._successor = (-1, time.monotonic())
            _HEARTBEATS.add(self)
            self._open = True
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(success=exc_type is None)

    def close(self, *, success: bool = True) -> None:
        """Stop the heartbeats (once no beat of this watch runs); drop this rank's heartbeat key.

        ``success``: every rank has passed the operation's last collective, so rank 0 also
        removes the arrival keys (after a failure they stay, for late ranks to find).
        """
        if not self._open:
            return
        _HEARTBEATS.remove(self)
        self._open = False
        try:
            self._store.delete_key(self._key("hb", self.rank))
            if success:
                for key in self._cleanup:
                    self._store.delete_key(key)
            if success and self.rank == 0:
                self._store.delete_key(self._key("arrived"))
                self._store.delete_key(self._key("all"))
        except Exception as exc:  # noqa: BLE001 - cleanup only; the operation's outcome stands
            logger.warning("rank %d: could not remove %s keys from the store: %r", self.rank, self.name, exc)

    # -- failing together -----------------------------------------------------------------
    def abort(self, failures: Mapping[int, Sequence[str]]) -> None:
        """Publish this operation's failure for every rank (the first publication wins)."""
        if self._store is None:
            return
        blob = encode_failures("abort", failures)
        try:
            self._store.compare_set(self._key("abort"), "", blob)
        except Exception as exc:  # noqa: BLE001 - the local error is raised anyway
            logger.warning("rank %d: could not publish the failure of %s: %r", self.rank, self.name, exc)

    def _read_abort(self) -> dict[int, tuple[str, ...]] | None:
        key = self._key("abort")
        if not self._store.check([key]):
            return None
        try:
            return decode_failures(self._store.get(key), key=key, kind="abort", world=self.world)
        except ControlMessageError as exc:
            # Not a failure any rank of this operation wrote: the operation fails all the
            # same (its abort key is no longer its own), naming the key, on every rank that reads it.
            return {self.rank: (f"ControlMessageError: {exc}",)}

    def check(self) -> None:
        """Raise ``PeerFailure`` when another rank published a failure."""
        if self._aborted.is_set():
            raise PeerFailure(self._cause or {})

    def _set_cause(self, cause: dict[int, tuple[str, ...]]) -> None:
        if self._cause is None:
            self._cause = cause
        self._aborted.set()

    # -- one heartbeat (run by the heartbeat thread) ---------------------------------------
    def _beat(self) -> None:
        try:
            # Counters through add(): reading a key with add(key, 0) never blocks, where
            # get() on a key its owner just removed would wait for the store timeout. 0
            # means the successor closed its watch (removed its key).
            self._store.add(self._key("hb", self.rank), 1)
            cause = self._read_abort()
            if cause is not None:
                self._set_cause(cause)
                return
            successor, (last, changed) = (self.rank + 1) % self.world, self._successor
            if not self._arrived.is_set() or successor == self.rank or last == 0:
                return
            value = self._store.add(self._key("hb", successor), 0)
            now = time.monotonic()
            if value != last:
                self._successor = (value, now)
            elif now - changed >= self.stale_s:
                dead = {successor: (f"stopped responding: its heartbeat did not change for "
                                    f"{now - changed:.0f} s (the process died, was killed or hangs)",)}
                self.abort(dead)
                self._set_cause(self._read_abort() or dead)
        except Exception as exc:  # noqa: BLE001 - a store hiccup must not stop the heartbeats
            logger.debug("rank %d: watch %s: store error %r", self.rank, self.name, exc)

    # -- bounded waits --------------------------------------------------------------------
    def arrive(self, timeout: float) -> None:
        """Store barrier: return once every rank arrived; ``PeerFailure`` after ``timeout`` s.

        On expiry the ranks missing are named in the abort key (and listed under
        ``<name>/missing``, see ``left_behind``); a rank arriving after an abort raises that
        abort at once.
        """
        if self._store is None:
            return
        cause = self._read_abort()
        if cause is not None:
            self._set_cause(cause)
            self.check()
        if self._store.add(self._key("arrived"), 1) >= self.world:
            self._store.set(self._key("all"), "1")  # the last rank: no need to read it back
            self._arrived.set()
            return
        end = time.monotonic() + timeout
        pause = first_pause(self.world)
        while not self._store.check([self._key("all")]):
            cause = self._read_abort()
            if cause is not None:
                self._set_cause(cause)
                self.check()
            now = time.monotonic()
            if now >= end:
                self._name_missing(timeout)
            time.sleep(min(pause, max(0.0, end - now)))
            pause = min(2 * pause, POLL_MAX_S)
        self._arrived.set()

    def left_behind(self) -> bool:
        """Whether an expired arrival of this operation named this rank missing: the others
        gave up on it without this rank (it came late, or they made one call more)."""
        if self._store is None:
            return False
        key = self._key("missing")
        return bool(self._store.check([key])) and self.rank in decode_ints(self._store.get(key), key=key,
                                                                              kind="missing", high=self.world)

    def _name_missing(self, timeout: float) -> None:
        """After the arrival timeout: one rank lists who is missing (one store check per
        rank, on this error path only); the others wait for its abort, then raise it."""
        if self._store.add(self._key("expired"), 1) == 1:
            missing = [r for r in range(self.world) if not self._store.check([self._key("hb", r)])]
            self._store.set(self._key("missing"), encode("missing", missing))
            self.abort({r: (f"did not reach {self.name.split('/')[0]} within {timeout:g} s of "
                            f"the first rank (ranks arrived: {self.world - len(missing)} of "
                            f"{self.world})",) for r in missing})
        end = time.monotonic() + max(30.0, 10 * self.heartbeat_s)
        cause = self._read_abort()
        while cause is None and time.monotonic() < end:
            time.sleep(0.1)
            cause = self._read_abort()
        self._set_cause(cause or {self.rank: (f"timed out after {timeout:g} s waiting for the other "
                                              "ranks to arrive",)})
        self.check()

    def wait(self, handle: Handle | None, *, phases: int = 1) -> None:
        """Wait for ``handle`` in slices, raising ``PeerFailure`` once a failure is published.

        A collective error (a peer's connection closed) is published and raised; when the
        heartbeats name the dead rank within ``STALE_S + 2 HEARTBEAT_S``, that rank is named.
        ``phases``: how many steps of local work the other ranks may make before joining
        (each bounded by ``stall_s``): the wait is bounded by ``phases * stall_s``.
        """
        if handle is None:
            return
        if self._store is None:
            handle.wait()
            return
        start = time.monotonic()
        try:
            while True:
                self.check()
                try:
                    if self.platform.wait(handle, SLICE_S):
                        return
                except Exception as exc:
                    raise self.lost(exc) from exc
                self._check_stall(start, "a collective", phases)
        except BaseException:
            self.interrupted = True  # the collective is left pending in the process group
            raise

    def _check_stall(self, start: float, what: str, phases: int = 1) -> None:
        """Publish and raise once one wait has lasted ``phases * stall_s`` with every rank alive."""
        waited = time.monotonic() - start
        if self.stall_s is None or waited < phases * self.stall_s:
            return
        cause = {self.rank: (f"waited {waited:.0f} s in {what} of {self.name} while every rank was alive "
                             f"(the bound is {phases} x the operation's timeout, {self.stall_s:g} s): the ranks are "
                             "most likely in different collectives because they passed different "
                             "arguments; pass the same arguments on every rank, or a larger timeout "
                             "if a single broadcast really takes that long",)}
        self.abort(cause)
        self._set_cause(self._read_abort() or cause)
        self.check()

    def wait_event(self, event: threading.Event) -> None:
        """Wait for a local event (a read-ahead thread), raising once a failure is published."""
        while not event.wait(SLICE_S):
            self.check()

    def gather(self, obj: Any) -> list[Any]:
        """``platform.all_gather_object`` with every internal wait bounded by this watch."""
        if self._store is None:
            return self.platform.all_gather_object(obj)
        return self.platform.all_gather_object(obj, waiter=self.wait)

    def start_reduce(self, lanes: Sequence[int], op: str) -> StoreReduction | None:
        """A SUM or MAX of int64 ``lanes`` over every rank through the store
        (``_store_reduce``), begun; None when this watch has no store, its world is larger
        than ``STORE_REDUCE_MAX`` or the lanes more than ``STORE_LANES_MAX`` (then the caller
        all-reduces on the process group). A sum wraps around as an int64 all-reduce's does; a
        lane outside int64 is a ValueError. Every rank makes the operation's reductions in the
        same order, with the same number of lanes; ``reduced`` waits."""
        if self._store is None or self.world > STORE_REDUCE_MAX or len(lanes) > STORE_LANES_MAX:
            return None
        reduction = StoreReduction(self._store, self._key("r", self._reductions + 1), self.rank, self.world,
                                   lanes, op, first_pause(self.world))
        self._reductions += 1  # not for lanes refused before anything was sent
        return reduction

    def reduced(self, reduction: StoreReduction, *, phases: int = 1) -> list[int]:
        """``reduction``'s result, bounded like ``wait``: ``PeerFailure`` once a failure is
        published or the wait lasted ``phases * stall_s``. No collective is left pending in
        the process group when it raises."""
        return reduction.result(self.check, lambda start: self._check_stall(start, "a reduction", phases))

    def barrier(self, key: str, ranks: Sequence[int]) -> None:
        """Store barrier among ``ranks`` (a subset of the world, each calling it with the same
        ``key``, unique within this operation): returns once all of them arrived, raises
        ``PeerFailure`` once a failure is published (a member that died is named by the
        heartbeats within ``STALE_S + HEARTBEAT_S``).

        Used before a step that cannot itself be interrupted (connecting a new group), so
        that a member that is dead or elsewhere cannot hold the others there. Two store
        operations per rank, plus one for the last to arrive; the lowest rank removes the
        keys when the operation closes successfully (every rank has passed them then).
        """
        if self._store is None:
            return
        count, done = self._key("b", key), self._key("b", key, "all")
        if self.rank == min(ranks):
            self._cleanup.extend((count, done))
        if self._store.add(count, 1) >= len(ranks):
            self._store.set(done, "1")
        start, pause = time.monotonic(), first_pause(len(ranks))
        while not self._store.check([done]):
            self.check()
            self._check_stall(start, "a barrier")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)

    def lost(self, exc: BaseException) -> PeerFailure:
        """The error to raise after a collective failed here (a peer's connection closed):
        the dead rank's when the heartbeats find it, else this rank's, published either way."""
        self.interrupted = True
        mine = f"rank {self.rank} lost a collective: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        end = time.monotonic() + self.stale_s + 2 * self.heartbeat_s
        while time.monotonic() < end and not self._aborted.is_set():
            self._aborted.wait(0.1)
        if self._cause is None:
            self.abort({self.rank: (mine,)})
            self._set_cause(self._read_abort() or {self.rank: (mine,)})
        cause = {r: c for r, c in self._cause.items()}
        return PeerFailure(cause)


class _Heartbeats:
    """The process's heartbeat thread (module docstring): beats each watch ``add`` gave it
    every ``heartbeat_s`` of that watch, the first ``heartbeat_s`` after ``add``, until
    ``remove``. One beat runs at a time; ``remove`` returns once no beat of its watch runs."""

    def __init__(self) -> None:
        self.after_fork()

    def after_fork(self) -> None:
        """A fresh state: a forked child has none of its parent's threads or open watches."""
        self._cond = threading.Condition()
        self._due: dict[Watch, float] = {}  # open watch -> monotonic time of its next beat
        self._beating: Watch | None = None
        self._wake = float("inf")  # when the thread wakes next, unless notified
        self._thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=HEARTBEAT_THREAD, daemon=True)
                self._thread.start()
            due = self._due[watch] = time.monotonic() + watch.heartbeat_s
            if due < self._wake:
                self._cond.notify()

    def remove(self, watch: Watch) -> None:
        with self._cond:
            self._due.pop(watch, None)
            self._cond.notify_all()  # a thread waiting for this watch's beat lets go of it
            while self._beating is watch:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                watch = self._beating = self._next_due()
            try:
                watch._beat()
            finally:
                with self._cond:
                    self._beating = None
                    if watch in self._due:
                        self._due[watch] = time.monotonic() + watch.heartbeat_s
                    self._cond.notify_all()
            # not held while this thread waits for the next beat: a closed watch (and the
            # store, group and port it references) goes with its owner's last reference
            del watch

    def _next_due(self) -> Watch:
        """The open watch whose beat is due, once one is (called holding the lock)."""
        while True:
            watch = min(self._due, key=self._due.__getitem__, default=None)
            now = time.monotonic()
            if watch is not None and self._due[watch] <= now:
                self._wake = now
                return watch
            self._wake = self._due[watch] if watch is not None else float("inf")
            self._cond.wait(None if watch is None else self._wake - now)


_HEARTBEATS = _Heartbeats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HEARTBEATS.after_fork)
