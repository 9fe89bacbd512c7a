"""A fake accelerator, for testing the device path of dcp without a GPU.

``FakeAccelerator`` stands in for a torch device module behind ``DeviceCopies``:

* device memory is host memory: ``empty``/``to_device`` give CPU tensors that this fake
  registers as "device" memory (``owns``); its pinned host buffers are registered too;
* each copy stream is a worker thread that runs its queue in order: a copy sleeps a random
  delay (up to ``max_delay_s``) and only then does the memcpy, and an event fires after
  the work queued before it. A pinned buffer rewritten before its copy ran therefore
  corrupts the destination, and is also recorded: the copy compares its source with a
  snapshot taken when it was queued;
* the caller's current stream is the host itself (gloo's broadcasts and a test's writes
  happen at once): waiting on an event there blocks until it fired.

What it checks is in ``violations`` (a copy from pageable memory, a pinned buffer
rewritten before its copy ran, a host read of an event that never fired), and what it
saw in counters: ``copies``, ``stream_syncs`` (``finish``: once per load), ``event_waits``
(a buffer's own copy), ``log`` (the order of queued, run and fired operations).

``platform()`` gives a ``TorchPlatform`` (gloo, CPU) whose ``device_copies`` is this fake.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._device import DeviceCopies

__all__ = ["FakeAccelerator", "FakeCopies", "FakeEvent", "FakeStream"]


class FakeEvent:
    """Fires once the work queued on its stream before ``record`` has run."""

    def __init__(self, fake: FakeAccelerator):
        self._fake = fake
        self._fired = threading.Event()
        self._fired.set()  # an event never recorded has nothing to wait for
        self.name = f"e{next(fake._ids)}"

    def record(self, stream: FakeStream) -> None:
        self._fired.clear()
        stream._put(self._fire, f"fire {self.name}")

    def _fire(self) -> None:
        self._fired.set()

    def query(self) -> bool:
        return self._fired.is_set()

    def synchronize(self) -> None:
        self._fake.event_waits += 1
        if not self._fired.wait(self._fake.timeout_s):
            self._fake.violation(f"event {self.name} did not fire within {self._fake.timeout_s} s")


class FakeStream:
    """A copy stream: one worker thread running its queue in order."""

    def __init__(self, fake: FakeAccelerator, name: str):
        self._fake, self.name = fake, name
        self._queue: queue.Queue[tuple[Callable[[], None], str] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=f"fake-{name}", daemon=True)
        self._thread.start()

    def _put(self, op: Callable[[], None], what: str) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._fake._note(f"queue {self.name}: {what}")
        self._queue.put((op, what))

    def _work(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            op, what = entry
            try:
                op()
            except Exception as exc:  # noqa: BLE001 - recorded; a real stream fails asynchronously too
                self._fake.violation(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}")
            self._fake._note(f"ran {self.name}: {what}")
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()

    def wait_stream(self, other: Any) -> None:
        if isinstance(other, FakeStream) and other is not self:
            event = FakeEvent(self._fake)
            event.record(other)
            self.wait_event(event)
        # the host stream has run everything already

    def wait_event(self, event: FakeEvent) -> None:
        self._put(lambda: event._fired.wait(self._fake.timeout_s), f"wait {event.name}")

    def synchronize(self) -> None:
        self._fake.stream_syncs += 1
        if not self._idle.wait(self._fake.timeout_s):
            self._fake.violation(f"stream {self.name} did not drain within {self._fake.timeout_s} s")

    def close(self) -> None:
        self._queue.put(None)


class _HostStream:
    """The caller's current stream: the host, where everything has run when queued."""

    name = "host"

    def wait_stream(self, other: Any) -> None:
        if isinstance(other, FakeStream):
            other.synchronize()

    def wait_event(self, event: FakeEvent) -> None:
        if not event._fired.wait(event._fake.timeout_s):
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
        return f"fake-{id(self._fake)}"

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
        stream = self._current_stream()
        self._fake.copy(dst, src, stream)

    def is_pinned(self, tensor: Any) -> bool:
        return self._fake.is_pinned(tensor)

    def owns(self, tensor: Any) -> bool:
        return self._fake.owns(tensor)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        return self._fake.empty(shape, dtype)

    def to_device(self, dst: Any, src: Any, staging: Any = None) -> Any:
        if dst.dtype == src.dtype and dst.is_contiguous():
            return super().to_device(dst, src, staging)
        # the device kernel after the transfer runs on the copy stream too
        tmp = self.empty(src.shape, src.dtype) if staging is None else staging
        event = super().to_device(tmp, src)
        stream = self.stream
        stream._put(lambda: dst.copy_(tmp), f"kernel into {tuple(dst.shape)}")
        return event


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
    """Host memory posing as an accelerator's (module docstring)."""

    def __init__(self, max_delay_s: float = 0.002, seed: int = 0, timeout_s: float = 60.0):
        import itertools

        self.max_delay_s, self.timeout_s = max_delay_s, timeout_s
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
        """Uninitialised "device" memory."""
        import torch

        t = torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            self._device[t.untyped_storage().data_ptr()] = t
        return t

    def to_device(self, tensor: Any) -> Any:
        """A "device" copy of the host tensor ``tensor``."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def pinned(self, nbytes: int) -> Any:
        import torch

        t = torch.empty(nbytes, dtype=torch.uint8)
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

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` after a random delay; record violations."""
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
        delay = self._random.uniform(0, self.max_delay_s)

        def run() -> None:
            time.sleep(delay)
            if not _same(src, snapshot):
                self.violation(f"the source of a copy of {tuple(src.shape)} {src.dtype} was rewritten before the "
                               "copy ran (a pinned buffer reused before its event fired)")
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
        for s in self.streams:
            s.close()


def _same(a: Any, b: Any) -> bool:
    """Bit-equal (NaNs included)."""
    import torch

    def raw(t: Any) -> Any:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return bool(torch.equal(raw(a), raw(b)))
