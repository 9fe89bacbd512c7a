"""The staging pool of ``async_save``: one host arena per process, reused across saves.

A save copies only the boxes this rank writes (the save layout picks one writer per
distinct box) into the arena, each at a 64-byte aligned offset; the background write reads
from there, so the caller may change its tensors as soon as ``async_save`` returns.

Bound: the arena is as large as the largest copy one save of this process needed since it
was last released, rounded up to ``ROUND_BYTES``; since a process has at most one save in
flight (``_queue``), that is all the staging memory it holds. It grows only when a save
needs more (the old arena is freed first), never shrinks by itself: ``release()`` (public
as ``dcp_load.release_staging``) frees it, waiting for a save in flight to finish writing.

The first save: an arena taken on the first ``async_save`` was faulted in page by page by
its copy (256 MiB: 0.39-1.03 s of first copy against 0.12-0.15 s into warm pages, one
process on the 2-core machine under load). ``prepare(nbytes)`` (public as
``dcp_load.prepare_staging``, for a training script to call once before its loop) maps the
arena with ``MAP_POPULATE`` on a background thread (the kernel takes the pages in one call,
0.24-0.30 s for 256 MiB, without the GIL), so that the first save copies into warm pages;
a save that starts before it is done waits for it.

Accelerator tensors: when the platform has a copy engine for their device
(``Platform.device_copies``: CUDA, NPU, XPU through torch's device module) the arena is
pinned host memory from that engine (``_host_buffer``), the boxes are copied into it on the
engine's copy stream with ``non_blocking``, and ``stage`` returns once the event of the
last copy fired: that wait is the blocking time of ``async_save`` on a device. Values the
engine does not serve (host tensors, MindSpore, a backend without pinned memory) are
copied by ``Tensor.copy_`` / numpy as before.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

__all__ = ["ALIGN", "ROUND_BYTES", "POOL", "StagingPool", "StagingStopped", "prepare_staging", "release_staging"]

logger = logging.getLogger(__name__)

#: Offset alignment of each staged box (a cache line; any dtype's element divides it).
ALIGN = 64
#: Arena sizes are rounded up to this, so saves that differ by a few bytes share one arena.
ROUND_BYTES = 1 << 20
#: A copy that may be stopped (``stage(stop=)``) asks between slices of about this many
#: bytes: ~10-70 ms of copying here (1-6 GB/s with 4 ranks on 2 cores), far below any
#: wait's bound.
PIECE_BYTES = 64 << 20


class StagingStopped(Exception):
    """``stage`` stopped between two boxes because its ``stop()`` said so (the pool is free)."""


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class StagingPool:
    """One reusable host arena (module docstring); ``stage`` and ``done`` bracket a save."""

    def __init__(self) -> None:
        self._arena: Any = None  # numpy uint8, or None
        self._pinned: Any = None  # (torch uint8 pinned tensor behind the arena, its engine), or None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = False

    @property
    def capacity(self) -> int:
        """Bytes the pool holds now."""
        return 0 if self._arena is None else int(self._arena.nbytes)

    def _host_buffer(self, nbytes: int, device_types: set[str], copies: Any = None) -> Any:
        """A host buffer of ``nbytes`` for copies from tensors on ``device_types``: pinned
        memory from the copy engine ``copies`` when there is one, else plain memory."""
        del device_types  # the engine decides: one per device, or None for the plain path
        if copies is None:
            return _plain_buffer(nbytes)
        pinned = copies.host_buffer(nbytes)
        self._pinned = (pinned, copies)
        return pinned.numpy()

    def _drop_arena(self) -> None:
        """Free the arena (a pinned one goes back to its engine's cache)."""
        self._arena = None
        if self._pinned is not None:
            pinned, copies = self._pinned
            self._pinned = None
            copies.give_back(pinned)

    def stage(self, data: dict[str, Any], platform: Any = None, *, stop: Any = None) -> tuple[dict[str, Any], int]:
        """Copies of ``data``'s values ({key: tensor or array}) in the arena: ({key: copy},
        bytes staged). ``platform``: whose copy engine moves device tensors (module
        docstring). ``stop``: asked between two boxes; once it returns True the copies
        queued so far are waited for, the pool is freed and ``StagingStopped`` raised.
        Call ``done()`` once the copies were written."""
        copies = _engine_for(platform, data)
        sizes = {k: _nbytes(v) for k, v in data.items()}
        need = sum(_round(n, ALIGN) for n in sizes.values())
        with self._lock:
            while self._busy:
                self._idle.wait()
            self._busy = True
        try:
            pinned_by = None if self._pinned is None else self._pinned[1]
            if need > self.capacity or (copies is not None and pinned_by is not copies):
                self._drop_arena()  # free the smaller (or unpinned) arena before taking the next
                self._arena = self._host_buffer(_round(need, ROUND_BYTES), {_device(v) for v in data.values()},
                                                copies)
                logger.debug("staging pool: %d bytes", self.capacity)
            out = self._copy_all(data, sizes, copies, stop)
        except BaseException:
            self.done()
            raise
        return out, sum(sizes.values())

    def prepare(self, nbytes: int, *, wait: bool = False) -> int:
        """Grow the arena to ``nbytes`` ahead of a save, its pages taken on a background
        thread (module docstring): returns the capacity it will have. Nothing to do when it
        is already as large; ``wait``: return once the pages are taken."""
        size = _round(max(0, int(nbytes)), ROUND_BYTES)
        with self._lock:
            while self._busy:
                self._idle.wait()
            if size <= self.capacity or not size:
                return self.capacity
            self._busy = True  # a save waits in ``stage`` until the arena is ready
            self._drop_arena()
        thread = threading.Thread(target=self._fill, args=(size,), name="dcp-staging-prepare", daemon=True)
        thread.start()
        if wait:
            thread.join()
        return size

    def _fill(self, size: int) -> None:
        try:
            self._arena = _plain_buffer(size, populate=True)
            logger.debug("staging pool: %d bytes prepared", size)
        except BaseException:  # noqa: BLE001 - no memory now: the save takes its arena as before
            logger.warning("staging pool: preparing %d bytes failed; the next save allocates", size, exc_info=True)
        finally:
            self.done()

    def done(self) -> None:
        """The copies of the last ``stage`` are no longer read: the arena is free again."""
        with self._lock:
            self._busy = False
            self._idle.notify_all()

    def release(self) -> int:
        """Free the arena (after a save in flight finished writing); the bytes freed."""
        with self._lock:
            while self._busy:
                self._idle.wait()
            freed = self.capacity
            self._drop_arena()
        return freed

    def _copy_all(self, data: dict[str, Any], sizes: dict[str, int], copies: Any, stop: Any = None
                  ) -> dict[str, Any]:
        """Every value copied into the arena; device values through ``copies`` on its copy
        stream, waited for once, after the last has been queued."""
        out: dict[str, Any] = {}
        pos, last = 0, None
        if copies is not None:
            copies.begin()  # after the caller's pending writes to its tensors
        arena = self._arena if self._arena is not None else _empty()  # None while every box is empty
        for key, value in data.items():
            if stop is not None and stop():
                if last is not None:
                    copies.wait_event(last)  # nothing may still write into the arena once it is free
                raise StagingStopped(f"stopped after {len(out)} of {len(data)} boxes")
            if copies is not None and _torch_tensor(value) and sizes[key] and copies.owns(value):
                dst = self._pinned[0][pos:pos + sizes[key]].view(value.dtype).view(value.shape)
                last = copies.to_host(dst, value.detach())
                out[key] = dst
            else:
                out[key] = _copy_into(arena[pos:pos + sizes[key]], value, stop)
            pos += _round(sizes[key], ALIGN)
        if last is not None:
            copies.wait_event(last)  # one stream: the last copy's event fires after all others
        return out


def _plain_buffer(nbytes: int, *, populate: bool = False) -> Any:
    """``nbytes`` of private anonymous memory of ordinary pages, as a uint8 array
    (``populate``: every page taken by the kernel at once, where Linux offers it).

    Not ``np.empty``: NumPy advises arrays of 4 MiB or more for transparent huge pages, and
    with THP "madvise" the first save's copy then takes the arena huge page by huge page, a
    cost that swung from fast to seconds here while ordinary pages cost about the same
    every time. First touch and copy of 256 MiB, 5 launches each (2 shared cores, a VM,
    other jobs running): huge pages 41-717 ms in one process, 45-1401 ms in each of 2,
    817-3899 ms in each of 4; ordinary pages 159-251, 167-348 and 341-1381 ms. The first
    ``async_save`` of 1 GiB (``bench_save``'s FSDP4 state, 4 ranks) blocked 4.3-9.6 s with
    huge pages against 1.5-2.3 s, on 2 ranks 0.26-3.7 s against 0.43-2.4 s (huge pages
    faster once), 3 launches each; copies into the warm arena took the same
    time either way (min of 9: 29-32 against 24-32 ms in one process). The memory goes back
    when the last view of it is dropped."""
    import mmap

    import numpy as np

    private = getattr(mmap, "MAP_PRIVATE", None)
    if not nbytes or private is None:  # no anonymous private maps here (Windows): NumPy's memory
        return np.empty(nbytes, dtype=np.uint8)
    flags = private | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    # Private: a shared map would be shmem, and a forked child would write into this one.
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)


def _empty() -> Any:
    import numpy as np

    return np.empty(0, dtype=np.uint8)


def _engine_for(platform: Any, data: dict[str, Any]) -> Any:
    """The platform's copy engine of the first device tensor in ``data`` it serves, or None."""
    of = getattr(platform, "device_copies", None)
    if of is None:
        return None
    seen: set[str] = set()
    for value in data.values():
        if _torch_tensor(value) and str(value.device) not in seen:
            seen.add(str(value.device))
            copies = of(value.device)
            if copies is not None and copies.owns(value):
                return copies
    return None


def _torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _device(value: Any) -> str:
    return str(value.device.type) if _torch_tensor(value) else "cpu"


def _nbytes(value: Any) -> int:
    if _torch_tensor(value):
        return value.numel() * value.element_size()
    return int(_as_array(value).nbytes)


def _as_array(value: Any) -> Any:
    import numpy as np

    ms = sys.modules.get("mindspore")
    if ms is not None and isinstance(value, ms.Tensor):
        value = value.asnumpy()
    return np.asarray(value)


def _copy_into(buf: Any, value: Any, stop: Any = None) -> Any:
    """``value`` copied into ``buf`` (uint8, exactly its size), as the same kind of object;
    with ``stop``, a torch tensor of more than ``PIECE_BYTES`` is copied in slices of its
    rows with ``stop()`` asked between them (``StagingStopped``)."""
    if _torch_tensor(value):
        import torch

        dst = torch.from_numpy(buf).view(value.dtype).view(value.shape) if buf.nbytes else \
            torch.empty(value.shape, dtype=value.dtype)
        rows = value.shape[0] if value.dim() else 1
        step = max(1, rows * PIECE_BYTES // max(buf.nbytes, 1))
        with torch.no_grad():
            if stop is None or step >= rows:
                dst.copy_(value.detach())
                return dst
            for i in range(0, rows, step):
                if i and stop():
                    raise StagingStopped(f"stopped inside a box, at row {i} of {rows}")
                dst[i:i + step].copy_(value.detach()[i:i + step])
        return dst
    src = _as_array(value)
    dst = buf.view(src.dtype).reshape(src.shape) if buf.nbytes else src.copy()
    dst[...] = src
    return dst


POOL = StagingPool()


def prepare_staging(state_dict: Any = None, *, nbytes: int | None = None, wait: bool = False) -> int:
    """Take the staging memory of the first ``async_save`` ahead of it, on a background
    thread, so that the first save blocks no longer than the ones after it: call once on
    each rank before the training loop. Sized to ``nbytes``, else to the bytes of the
    tensors this rank holds in ``state_dict`` (an upper bound: with replicated tensors a
    rank writes less, and the pool then holds more than its saves need until
    ``release_staging``; pass ``nbytes=report.staged_bytes`` of an earlier save to hold
    exactly that). Returns the bytes the pool holds; ``wait``: once they are taken."""
    if nbytes is None:
        if state_dict is None:
            raise TypeError("prepare_staging: pass the state dict you will save, or nbytes=")
        nbytes = held_bytes(state_dict)
    if nbytes < 0:
        raise ValueError(f"prepare_staging: nbytes must be >= 0, got {nbytes}")
    return POOL.prepare(nbytes, wait=wait)


def held_bytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in ``obj`` (nested dicts, lists, tuples) as this rank
    holds them (a DTensor's local shard), each rounded up to ``ALIGN`` as the pool places them."""
    if isinstance(obj, dict):
        return sum(held_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v) for v in obj)
    local = getattr(obj, "_local_tensor", None)  # a DTensor: its shard
    value = local if local is not None else obj
    if _torch_tensor(value) or hasattr(value, "nbytes"):
        try:
            return _round(_nbytes(value), ALIGN)
        except (TypeError, ValueError):
            return 0
    return 0


def release_staging() -> int:
    """Free the staging memory ``async_save`` keeps for the next save (waiting for a save
    still writing); returns the bytes freed. The next ``async_save`` allocates it again."""
    return POOL.release()
