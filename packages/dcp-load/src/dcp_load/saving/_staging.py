"""The staging pool of ``async_save``: one host arena per process, reused across saves.

A save copies only the boxes this rank writes (the save layout picks one writer per
distinct box) into the arena, each at a 64-byte aligned offset; the background write reads
from there, so the caller may change its tensors as soon as ``async_save`` returns.

Bound: the arena is as large as the largest copy one save of this process needed since it
was last released, rounded up to ``ROUND_BYTES``; since a process has at most one save in
flight (``_queue``), that is all the staging memory it holds. It grows only when a save
needs more (the old arena is freed first), never shrinks by itself: ``release()`` (public
as ``dcp_load.release_staging``) frees it, waiting for a save in flight to finish writing.

Accelerator tensors are copied to the host by ``Tensor.copy_`` into plain memory here;
``_host_buffer`` is the seam where a pinned arena (and copies on a side stream) goes.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

__all__ = ["ALIGN", "ROUND_BYTES", "POOL", "StagingPool", "release_staging"]

logger = logging.getLogger(__name__)

#: Offset alignment of each staged box (a cache line; any dtype's element divides it).
ALIGN = 64
#: Arena sizes are rounded up to this, so saves that differ by a few bytes share one arena.
ROUND_BYTES = 1 << 20


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class StagingPool:
    """One reusable host arena (module docstring); ``stage`` and ``done`` bracket a save."""

    def __init__(self) -> None:
        self._arena: Any = None  # numpy uint8, or None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = False

    @property
    def capacity(self) -> int:
        """Bytes the pool holds now."""
        return 0 if self._arena is None else int(self._arena.nbytes)

    def _host_buffer(self, nbytes: int, device_types: set[str]) -> Any:
        """A host buffer of ``nbytes`` for copies from tensors on ``device_types``: plain
        memory (an accelerator's pinned memory belongs here)."""
        import numpy as np

        del device_types  # plain memory for every device type until the pinned path exists
        return np.empty(nbytes, dtype=np.uint8)

    def stage(self, data: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Copies of ``data``'s values ({key: tensor or array}) in the arena: ({key: copy},
        bytes staged). Call ``done()`` once the copies were written."""
        sizes = {k: _nbytes(v) for k, v in data.items()}
        need = sum(_round(n, ALIGN) for n in sizes.values())
        with self._lock:
            while self._busy:
                self._idle.wait()
            self._busy = True
        try:
            if need > self.capacity:
                self._arena = None  # free the smaller arena before taking the larger one
                self._arena = self._host_buffer(_round(need, ROUND_BYTES), {_device(v) for v in data.values()})
                logger.debug("staging pool: %d bytes", self.capacity)
            out: dict[str, Any] = {}
            pos = 0
            for key, value in data.items():
                out[key] = _copy_into(self._arena[pos:pos + sizes[key]], value)
                pos += _round(sizes[key], ALIGN)
        except BaseException:
            self.done()
            raise
        return out, sum(sizes.values())

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
            freed, self._arena = self.capacity, None
        return freed


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


def _copy_into(buf: Any, value: Any) -> Any:
    """``value`` copied into ``buf`` (uint8, exactly its size), as the same kind of object."""
    if _torch_tensor(value):
        import torch

        dst = torch.from_numpy(buf).view(value.dtype).view(value.shape) if buf.nbytes else \
            torch.empty(value.shape, dtype=value.dtype)
        with torch.no_grad():
            dst.copy_(value.detach())
        return dst
    src = _as_array(value)
    dst = buf.view(src.dtype).reshape(src.shape) if buf.nbytes else src.copy()
    dst[...] = src
    return dst


POOL = StagingPool()


def release_staging() -> int:
    """Free the staging memory ``async_save`` keeps for the next save (waiting for a save
    still writing); returns the bytes freed. The next ``async_save`` allocates it again."""
    return POOL.release()
