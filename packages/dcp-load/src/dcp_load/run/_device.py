"""Loads into accelerator destinations: reads land in pinned host buffers and are copied
to the device on a copy stream while the next piece is read.

The copy engine is the platform's (``Platform.device_copies``, ``dcp_platform._device``):
a process-wide ring of ``RING_BUFFERS`` pinned buffers of ``RING_BUFFER_BYTES`` (64 MiB of
pinned memory per device in all, allocated on first use and kept for the next load), one
copy stream, an event per copy. Each piece of a box (``_stage.stage_pieces``, at most one
buffer) is read into a buffer, its copy to the destination queued with ``non_blocking``,
and the buffer handed back with the copy's event: it is handed out again only once that
event fired. A cast or a strided destination is written on the device after the transfer.
Nothing waits per tensor: ``finish`` waits for the copy stream once per load, and a piece
that feeds a broadcast orders the broadcasting stream after its last copy (``publish``).

A destination no engine serves (the host, MindSpore, a backend without pinned memory)
takes the plain path of ``_execute._read_piece``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..layouts._targets import Target
from ._stage import narrowed, stage_pieces

__all__ = ["DeviceLoad"]


class DeviceLoad:
    """The copy engines of one load's device destinations, by ``str(tensor.device)``."""

    def __init__(self, engines: Mapping[str, Any]):
        self.engines = dict(engines)
        for engine in self.engines.values():
            engine.begin()  # copies come after whatever the caller queued on its destinations

    @classmethod
    def of(cls, platform: Any, targets: Mapping[str, Target]) -> DeviceLoad | None:
        """The engines serving some torch destination of ``targets``, or None (plain path)."""
        of = getattr(platform, "device_copies", None)
        if of is None:
            return None
        by_device: dict[str, Any] = {}
        for t in targets.values():
            if t.adapter.name == "torch" and hasattr(t.local, "device"):
                by_device.setdefault(str(t.local.device), t.local)
        engines = {}
        for key, tensor in by_device.items():
            engine = of(tensor.device)
            if engine is not None and any(engine.owns(t.local) for t in targets.values()
                                          if t.adapter.name == "torch" and str(t.local.device) == key):
                engines[key] = engine
        return cls(engines) if engines else None

    def engine_for(self, dest: Any) -> Any:
        """The engine that writes ``dest``, or None when it is not device memory."""
        engine = self.engines.get(str(getattr(dest, "device", "")))
        return engine if engine is not None and engine.owns(dest) else None

    def read(self, engine: Any, reader: Any, item: Any, chunk: Any, dest: Any, saved_dtype: str,
             verify: bool) -> Any:
        """Read ``item``'s box into the device tensor ``dest`` through ``engine``'s ring;
        the event of its last copy."""
        import torch

        saved = getattr(torch, saved_dtype)
        ring = engine.ring()
        last = None
        nbytes = math.prod(item.sizes) * saved.itemsize
        for offsets, sizes in stage_pieces(item.offsets, item.sizes, nbytes, ring.buffer_bytes):
            last = self._piece(engine, ring, reader, item, chunk, dest, saved, offsets, sizes, verify) or last
        return last

    @staticmethod
    def _piece(engine: Any, ring: Any, reader: Any, item: Any, chunk: Any, dest: Any, saved: Any,
               offsets: tuple[int, ...], sizes: tuple[int, ...], verify: bool) -> Any:
        """One piece: read into a pinned buffer, queue its copy; the copy's event."""
        buf, event = ring.acquire(), None
        try:
            staged = buf[:math.prod(sizes) * saved.itemsize].view(saved).view(sizes)
            reader.read_into(item.name, chunk, offsets, sizes, staged, verify=verify)
            with torch_no_grad():
                event = engine.to_device(narrowed(dest, item.offsets, offsets, sizes), staged)
        finally:
            ring.release(buf, event)
        return event

    @staticmethod
    def publish(engine: Any, event: Any) -> None:
        """Order the broadcasting stream after ``event`` (a piece about to be broadcast)."""
        if event is not None:
            engine.publish(event)

    def finish(self) -> None:
        """Wait once for every copy of this load."""
        for engine in self.engines.values():
            engine.finish()


def torch_no_grad() -> Any:
    import torch

    return torch.no_grad()
