"""A fake accelerator, for testing the device path of dcp without a GPU.

``FakeAccelerator`` stands in for a torch device module behind ``DeviceCopies``:

* device memory is host memory: ``empty``/``to_device`` give CPU tensors that this fake
  registers as "device" memory (``owns``); its pinned host buffers are registered too.
  Both are poisoned when allocated (every byte 0xFF: NaN in floating dtypes, -1 in
  integers), so bytes no copy has written yet never look like data;
* each copy stream is a worker thread that runs its queue in order, and it runs an
  operation (a host-to-device or device-to-host copy, a cast kernel, an event firing)
  **late by construction**: only once something waits for it, that is, the host waits on
  an event recorded after it (``Event.synchronize``, or the current stream's
  ``wait_event``, which is the host here), the stream is synchronized, or another stream
  reaches a wait on such an event; else ``hold_s`` seconds after it was queued (``None``:
  never; then ``close`` runs what is left). Before each operation the worker also sleeps
  a seeded random delay of at most ``max_delay_s``. A consumer that reads a copy's
  destination without waiting for its event therefore reads the poison (or the stale
  values it had), a pinned buffer rewritten before its copy ran is what the copy then
  moves, and a device tensor changed right after a device-to-host copy was queued without
  a wait is copied with its new values: a missing wait shows as a wrong value, not by a
  race that timing may win;
* the caller's current stream is the host itself (gloo's broadcasts and a test's writes
  happen at once, and ``begin`` has nothing to order after): waiting on an event there
  blocks until it fired. The platform's own ``synchronize`` is the gloo/CPU one, which
  does not drain the copy streams (as for device tensors under a gloo process group).

What it checks is in ``violations`` (a copy from pageable memory, a copy source rewritten
before the copy ran, a wait for an event that never fired), and what it saw in counters:
``copies``, ``stream_syncs`` (``finish``: once per load), ``event_waits`` (host waits on
one event), ``log`` (the order of queued, run and fired operations).

``platform()`` gives a ``TorchPlatform`` (gloo, CPU) whose ``device_copies`` is this fake.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ._device import DeviceCopies

__all__ = ["POISON_BYTE", "FakeAccelerator", "FakeCopies", "FakeEvent", "FakeStream"]

#: The byte every new "device" tensor and pinned buffer of the fake is filled with.
POISON_BYTE = 0xFF

_FAKES = itertools.count()  # a key per fake for the pinned caches (ids of dead fakes recur)


class FakeEvent:
    """Fires once the work queued on its stream before ``record`` has run."""

    def __init__(self, fake: FakeAccelerator):
        self._fake = fake
        self._fired = threading.Event()
        self._fired.set()  # an event never recorded has nothing to wait for
        self._stream: FakeStream | None = None
        self._seq = -1
        self.name = f"e{next(fake._ids)}"

    def record(self, stream: FakeStream) -> None:
        self._fired.clear()
        self._stream = stream
        self._seq = stream._put(self._fired.set, f"fire {self.name}")

    def query(self) -> bool:
        """Whether it fired (asking does not make the stream run)."""
        return self._fired.is_set()

    def _wait(self) -> bool:
        """Make its stream run up to it and wait for it to fire (bounded by ``timeout_s``)."""
        if self._stream is not None and not self._fired.is_set():
            self._stream._release(self._seq)
        return self._fired.wait(self._fake.timeout_s)

    def synchronize(self) -> None:
        self._fake.event_waits += 1
        if not self._wait():
            self._fake.violation(f"event {self.name} did not fire within {self._fake.timeout_s} s")


class FakeStream:
    """A copy stream: one worker thread running its queue in order, each operation only
    once it is waited for or ``hold_s`` after it was queued (module docstring)."""

    def __init__(self, fake: FakeAccelerator, name: str):
        self._fake, self.name = fake, name
        self._cond = threading.Condition()
        # (seq, op, what, queued at, delay before it)
        self._queue: deque[tuple[int, Callable[[], None], str, float, float]] = deque()
        self._seq = -1  # the last operation queued
        self._done = -1  # the last operation run
        self._released = -1  # operations up to this one may run now
        self._closing = False
        self._thread = threading.Thread(target=self._work, name=f"fake-{name}", daemon=True)
        self._thread.start()

    def _put(self, op: Callable[[], None], what: str) -> int:
        delay = self._fake._delay()
        with self._cond:
            self._seq += 1
            seq = self._seq
            self._queue.append((seq, op, what, time.monotonic(), delay))
            self._cond.notify_all()
        self._fake._note(f"queue {self.name}: {what}")
        return seq

    def _release(self, seq: int) -> None:
        """Let every operation up to ``seq`` run (something waits for it)."""
        with self._cond:
            if seq > self._released:
                self._released = seq
                self._cond.notify_all()

    def _next(self) -> tuple[int, Callable[[], None], str, float] | None:
        """The next operation once it may run; None once closed and drained."""
        hold = self._fake.hold_s
        with self._cond:
            while True:
                if self._queue:
                    seq, op, what, queued, delay = self._queue[0]
                    left = None if hold is None else queued + hold - time.monotonic()
                    if self._closing or seq <= self._released or (left is not None and left <= 0):
                        self._queue.popleft()
                        return seq, op, what, delay
                    self._cond.wait(left)
                elif self._closing:
                    return None
                else:
                    self._cond.wait()

    def _work(self) -> None:
        while True:
            entry = self._next()
            if entry is None:
                return
            seq, op, what, delay = entry
            if delay > 0:
                time.sleep(delay)
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - recorded; a real stream fails asynchronously too
                self._fake.violation(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}")
            self._fake._note(f"ran {self.name}: {what}")
            with self._cond:
                self._done = seq
                self._cond.notify_all()

    def wait_stream(self, other: Any) -> None:
        if isinstance(other, FakeStream) and other is not self:
            event = FakeEvent(self._fake)
            event.record(other)
            self.wait_event(event)
        # the host stream has run everything already

    def wait_event(self, event: FakeEvent) -> None:
        def wait() -> None:
            if not event._wait():
                self._fake.violation(f"stream {self.name}: event {event.name} did not fire")

        self._put(wait, f"wait {event.name}")

    def _drain(self) -> bool:
        """Run everything queued so far and wait for it (bounded by ``timeout_s``)."""
        with self._cond:
            last = self._seq
        self._release(last)
        deadline = time.monotonic() + self._fake.timeout_s
        with self._cond:
            while self._done < last:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def synchronize(self) -> None:
        self._fake.stream_syncs += 1
        if not self._drain():
            self._fake.violation(f"stream {self.name} did not drain within {self._fake.timeout_s} s")

    def close(self) -> None:
        """Run what is still queued, then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self._fake.timeout_s)


class _HostStream:
    """The caller's current stream: the host, where everything has run when queued."""

    name = "host"

    def wait_stream(self, other: Any) -> None:
        if isinstance(other, FakeStream):
            other.synchronize()

    def wait_event(self, event: FakeEvent) -> None:
        if not event._wait():
            event._fake.violation(f"event {event.name} waited on by the host did not fire")

    def synchronize(self) -> None:
        pass


class FakeCopies(DeviceCopies):
    """``DeviceCopies`` whose device operations are ``FakeAccelerator``'s."""

    def __init__(self, fake: FakeAccelerator):
        import torch

        super().__init__(torch.device("cpu"), None)
        self._fake = fake
        self._current: threading.local = threading.local()

    def _cache_key(self) -> str:
        return f"fake-{self._fake.key}"

    def _pin(self, nbytes: int) -> Any:
        return self._fake.pinned(nbytes)

    def _new_stream(self) -> Any:
        return self._fake.new_stream()

    def _new_event(self) -> Any:
        return FakeEvent(self._fake)

    def _current_stream(self) -> Any:
        return getattr(self._current, "stream", None) or self._fake.host

    def _on(self, stream: Any) -> Any:
        return _Using(self._current, stream)

    def _copy(self, dst: Any, src: Any) -> None:
        self._fake.copy(dst, src, self._current_stream())

    def is_pinned(self, tensor: Any) -> bool:
        return self._fake.is_pinned(tensor)

    def owns(self, tensor: Any) -> bool:
        return self._fake.owns(tensor)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        return self._fake.empty(shape, dtype)

    def _kernel(self, dst: Any, src: Any) -> None:
        """The cast / strided write is queued on the current (copy) stream, in its order."""
        stream = self._current_stream()
        if not isinstance(stream, FakeStream):
            dst.copy_(src)
            return
        stream._put(lambda: dst.copy_(src), f"kernel into {tuple(dst.shape)}")


class _Using:
    def __init__(self, local: threading.local, stream: Any):
        self._local, self._stream = local, stream

    def __enter__(self) -> Any:
        self._prev = getattr(self._local, "stream", None)
        self._local.stream = self._stream
        return self._stream

    def __exit__(self, *exc: Any) -> None:
        self._local.stream = self._prev


class FakeAccelerator:
    """Host memory posing as an accelerator's (module docstring).

    ``max_delay_s``: the most a worker sleeps before an operation (drawn from
    ``random.Random(seed)`` in the order operations are queued); ``hold_s``: how long an
    operation nobody waits for is held before it runs anyway (``None``: until ``close``);
    ``timeout_s``: the bound of every wait, after which it is recorded in ``violations``.
    """

    def __init__(self, max_delay_s: float = 0.002, seed: int = 0, timeout_s: float = 60.0,
                 hold_s: float | None = 2.0):
        self.max_delay_s, self.timeout_s, self.hold_s = max_delay_s, timeout_s, hold_s
        self.key = next(_FAKES)
        self._random = random.Random(seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._device: dict[int, Any] = {}  # storage address -> tensor (kept: addresses stay unique)
        self._pinned: dict[int, Any] = {}
        self.host = _HostStream()
        self.streams: list[FakeStream] = []
        self.violations: list[str] = []
        self.log: list[str] = []
        self.copies = self.stream_syncs = self.event_waits = 0
        self.engine = FakeCopies(self)

    # -- memory -----------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """Uninitialised "device" memory (poisoned: every byte ``POISON_BYTE``)."""
        import torch

        t = torch.empty(tuple(shape), dtype=dtype)
        _poison(t)
        with self._lock:
            self._device[t.untyped_storage().data_ptr()] = t
        return t

    def to_device(self, tensor: Any) -> Any:
        """A "device" copy of the host tensor ``tensor`` (made at once, not on a stream)."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def pinned(self, nbytes: int) -> Any:
        """A pinned host buffer of ``nbytes`` (poisoned)."""
        import torch

        t = torch.full((nbytes,), POISON_BYTE, dtype=torch.uint8)
        with self._lock:
            self._pinned[t.untyped_storage().data_ptr()] = t
        return t

    def owns(self, tensor: Any) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device

    def is_pinned(self, tensor: Any) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    # -- streams and copies -----------------------------------------------------------------
    def new_stream(self) -> FakeStream:
        stream = FakeStream(self, f"s{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def _delay(self) -> float:
        with self._lock:
            return self._random.uniform(0, self.max_delay_s) if self.max_delay_s > 0 else 0.0

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (it runs late: module docstring); record violations."""
        h2d, d2h = self.is_pinned(src) and self.owns(dst), self.owns(src) and self.is_pinned(dst)
        if not (h2d or d2h):
            self.violation(f"copy of {tuple(src.shape)} {src.dtype} not between pinned host memory and the "
                           f"device (source pinned: {self.is_pinned(src)}, device: {self.owns(src)}; "
                           f"destination pinned: {self.is_pinned(dst)}, device: {self.owns(dst)})")
        if not isinstance(stream, FakeStream):
            self.violation("a copy queued on the host stream, not on a copy stream")
            dst.copy_(src)
            return
        self.copies += 1
        snapshot = src.clone()
        what = "a pinned buffer reused before its event fired" if h2d else \
            "a device tensor written before the copy's event was waited for"

        def run() -> None:
            if not _same(src, snapshot):
                self.violation(f"the source of a copy of {tuple(src.shape)} {src.dtype} was rewritten before the "
                               f"copy ran ({what})")
            dst.copy_(src)

        stream._put(run, f"copy {tuple(src.shape)} {'H2D' if h2d else 'D2H'}")

    def violation(self, what: str) -> None:
        with self._lock:
            self.violations.append(what)

    def _note(self, what: str) -> None:
        with self._lock:
            self.log.append(what)

    def platform(self, **kwargs: Any) -> Any:
        """A ``TorchPlatform`` (the initialised process group's, CPU staging) whose
        ``device_copies`` is this fake for every device."""
        from ._torch import TorchPlatform

        fake = self

        class FakeAcceleratorPlatform(TorchPlatform):
            def device_copies(self, device: Any) -> Any:
                del device
                return fake.engine

        return FakeAcceleratorPlatform(**kwargs)

    def close(self) -> None:
        """Run every operation still held, stop the streams' threads, and drop this fake's
        pinned ring and cached buffers from the process-wide caches of ``_device``."""
        from . import _device

        for s in self.streams:
            s.close()
        key = self.engine._cache_key()
        with _device._LOCK:
            _device._CACHE.pop(key, None)
            for ring in [k for k in _device._RINGS if k.startswith(key + ":")]:
                del _device._RINGS[ring]


def _poison(t: Any) -> None:
    import torch

    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(POISON_BYTE)


def _same(a: Any, b: Any) -> bool:
    """Bit-equal (NaNs included)."""
    import torch

    def raw(t: Any) -> Any:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return bool(torch.equal(raw(a), raw(b)))
