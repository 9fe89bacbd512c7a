"""The copy engine between host and accelerator memory: pinned host buffers, one copy
stream per device, an event per copy.

``DeviceCopies`` is what ``Platform.device_copies(device)`` returns for an accelerator
whose backend has pinned memory (``None`` otherwise: the caller takes the plain path). It
talks to the device through the module ``torch.get_device_module(device)`` gives (CUDA,
NPU and XPU alike: ``Stream``, ``Event``, ``stream``, ``current_stream``), so one path
serves every torch accelerator.

Pinned memory is costly to allocate (it is locked in RAM and registered with the driver),
so every host buffer comes from ``host_buffer`` and goes back through ``give_back``: a
process-wide cache keeps up to ``CACHE_BYTES`` of released buffers per device type for the
next request of the same size. Load and save take their buffers there.

Loads stage through ``ring()``: ``RING_BUFFERS`` pinned buffers of ``RING_BUFFER_BYTES``
per device, allocated on first use, kept for the life of the process (the bound on the
pinned memory a load holds: 4 x 16 MiB). A buffer is handed out (``acquire``) only once
the event of the copy that last read it has fired, and the ring hands buffers out in the
order they came back, so while one buffer is being copied the next one is being read.

Ordering: ``begin`` makes the copy stream wait for the caller's current stream (the
destinations' earlier writes); ``publish(event)`` makes the caller's current stream wait
for a copy (a broadcast of the destination is queued after it); ``finish`` waits once for
the copy stream, at the end of a load: nothing waits per tensor.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["CACHE_BYTES", "RING_BUFFERS", "RING_BUFFER_BYTES", "DeviceCopies", "PinnedRing"]

logger = logging.getLogger(__name__)

#: Pinned buffers of a load's ring: one being read, one being copied, two spare so that a
#: copy slower than a read does not stall the reader at once.
RING_BUFFERS = 4
#: Bytes of each ring buffer: the staging piece of dcp-load (``run._stage.STAGE_BYTES``),
#: large enough that a copy's launch cost (~10 us) is under 1% of its transfer at 25 GB/s.
RING_BUFFER_BYTES = 16 * 1024 * 1024
#: Released pinned bytes kept per device type for reuse (beyond them, buffers are freed).
CACHE_BYTES = 1 << 30

_LOCK = threading.Lock()
_CACHE: dict[str, dict[int, list[Any]]] = {}  # device type -> size -> free pinned buffers
_RINGS: dict[str, PinnedRing] = {}  # str(device) -> ring


class PinnedRing:
    """Reused pinned buffers, each with the event of the copy that last read it."""

    def __init__(self, copies: DeviceCopies, buffers: int, buffer_bytes: int):
        self.buffers, self.buffer_bytes = buffers, buffer_bytes
        self._copies = copies
        self._free: collections.deque[tuple[Any, Any]] = collections.deque()
        self._made = 0
        self._ready = threading.Condition()

    def acquire(self) -> Any:
        """A pinned uint8 buffer of ``buffer_bytes`` that no copy reads any more."""
        with self._ready:
            while not self._free and self._made >= self.buffers:
                self._ready.wait()
            if not self._free:
                self._made += 1
                entry = None
            else:
                entry = self._free.popleft()
        if entry is None:
            return self._copies.host_buffer(self.buffer_bytes)
        buf, event = entry
        if event is not None:
            self._copies.wait_event(event)  # waits for this buffer's own copy, never the stream
        return buf

    def release(self, buf: Any, event: Any) -> None:
        """Hand ``buf`` back; ``event`` fires once the copy reading it has finished."""
        with self._ready:
            self._free.append((buf, event))
            self._ready.notify()


class DeviceCopies:
    """Host <-> device copies of one accelerator device (module docstring).

    The device operations are methods of their own (``_pin``, ``_new_stream``,
    ``_new_event``, ``_copy``...) so that a fake accelerator replaces just those.
    """

    def __init__(self, device: Any, module: Any):
        self.device, self.module = device, module
        self._stream: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"

    # -- the device operations (a fake accelerator overrides these) ---------------------
    def _pin(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _new_stream(self) -> Any:
        return self.module.Stream(device=self.device)

    def _new_event(self) -> Any:
        return self.module.Event()

    def _current_stream(self) -> Any:
        return self.module.current_stream(self.device)

    def _on(self, stream: Any) -> Any:
        return self.module.stream(stream)

    def _copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src, non_blocking=True)

    def _kernel(self, dst: Any, src: Any) -> None:
        """A device-to-device copy on the current stream (a cast and/or a strided write)."""
        dst.copy_(src)

    def wait_event(self, event: Any) -> None:
        """The host waits until ``event`` fired."""
        event.synchronize()

    def is_pinned(self, tensor: Any) -> bool:
        return bool(tensor.is_pinned())

    def owns(self, tensor: Any) -> bool:
        """Whether ``tensor`` lives on this device (a destination this engine serves)."""
        return tensor.device.type == self.device.type and \
            (tensor.device.index is None or self.device.index is None or tensor.device.index == self.device.index)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """Uninitialised device memory, for use on the copy stream only."""
        import torch

        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    # -- host buffers ---------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> Any:
        """A pinned uint8 host tensor of ``nbytes``: a cached one of that size, or a new one."""
        with _LOCK:
            free = _CACHE.get(self._cache_key(), {}).get(nbytes)
            if free:
                return free.pop()
        return self._pin(nbytes)

    def give_back(self, buf: Any) -> None:
        """Return a buffer from ``host_buffer`` (no copy may still read or write it)."""
        key, n = self._cache_key(), int(buf.numel())
        with _LOCK:
            sizes = _CACHE.setdefault(key, {})
            if sum(k * len(v) for k, v in sizes.items()) + n <= CACHE_BYTES:
                sizes.setdefault(n, []).append(buf)

    def _cache_key(self) -> str:
        return f"{type(self).__name__}:{self.device.type}"

    def ring(self) -> PinnedRing:
        """This process's ring of pinned load buffers for this device (made on first use)."""
        key = f"{self._cache_key()}:{self.device}"
        with _LOCK:
            ring = _RINGS.get(key)
            if ring is None:
                ring = _RINGS[key] = PinnedRing(self, RING_BUFFERS, RING_BUFFER_BYTES)
            ring._copies = self
            return ring

    # -- copies ---------------------------------------------------------------------------
    @property
    def stream(self) -> Any:
        """The dedicated copy stream (created on first use)."""
        if self._stream is None:
            self._stream = self._new_stream()
        return self._stream

    def begin(self) -> None:
        """Order the copy stream after the caller's current stream (earlier writes)."""
        self.stream.wait_stream(self._current_stream())

    def to_device(self, dst: Any, src: Any, staging: Any = None) -> Any:
        """Queue the copy of the pinned host tensor ``src`` into the device tensor ``dst``
        on the copy stream; the event that fires once ``dst`` holds the values (and
        ``src`` may be rewritten).

        A ``dst`` of another dtype, or a strided one, is reached through ``staging`` (a
        contiguous device tensor of ``src``'s dtype and shape, made here when ``None``):
        the cast and the strided write run on the device after the transfer, before the
        event (a broadcast ordered after the event reads the written ``dst``)."""
        with self._on(self.stream):
            if dst.dtype == src.dtype and dst.is_contiguous():
                self._copy(dst, src)
            else:
                tmp = self.empty(src.shape, src.dtype) if staging is None else staging
                self._copy(tmp, src)
                self._kernel(dst, tmp)  # a device kernel on the copy stream: cast and/or strided write
            event = self._new_event()
            event.record(self.stream)
        return event

    def to_host(self, dst: Any, src: Any) -> Any:
        """Queue the copy of the device tensor ``src`` into the pinned host tensor ``dst``
        on the copy stream (call ``begin`` first); the event that fires once ``dst`` holds it."""
        with self._on(self.stream):
            self._copy(dst, src)
            event = self._new_event()
            event.record(self.stream)
        return event

    def publish(self, event: Any) -> None:
        """Order the caller's current stream after ``event`` (a broadcast queued next reads
        the copied data)."""
        self._current_stream().wait_event(event)

    def finish(self) -> None:
        """Wait once for every copy queued so far."""
        if self._stream is not None:
            self._stream.synchronize()


def torch_device_copies(device: Any) -> DeviceCopies | None:
    """``DeviceCopies`` for a torch accelerator device, or None when it is the host, its
    device module lacks streams and events, or pinned memory cannot be had (then logged
    once, and the caller takes the plain path)."""
    import torch

    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = torch.get_device_module(device)
    except (RuntimeError, AttributeError, ValueError, TypeError):  # no device module for this type
        return None
    if not all(hasattr(module, n) for n in ("Stream", "Event", "stream", "current_stream")):
        return None
    if device.index is None and hasattr(module, "current_device"):
        device = torch.device(device.type, module.current_device())
    copies = DeviceCopies(device, module)
    if not _can_pin(copies):
        return None
    return copies


_PINNABLE: dict[str, bool] = {}


def _can_pin(copies: DeviceCopies) -> bool:
    key = copies.device.type
    if key not in _PINNABLE:
        try:
            copies.give_back(copies.host_buffer(1))
            _PINNABLE[key] = True
        except RuntimeError as exc:
            logger.info("no pinned host memory for %s (%s): host-device copies take the plain path", key, exc)
            _PINNABLE[key] = False
    return _PINNABLE[key]
