"""MindSpore backend: ``mindspore.communication`` / ``mindspore.mint.distributed``.

What MindSpore 2.10 does on the CPU (measured; dcp-platform README, "Measured facts") shapes this module:

* Broadcast runs on the world group only ("Broadcast only support mccl_world_group on
  CPU"), and only float32/int32 arrive intact: bf16, int8, uint8 and bool fail or are
  unsupported, int64/float64 were seen truncated to 32 bits. Every other dtype therefore
  travels as raw bytes packed into int32 words (padded to a multiple of 4 bytes).
* all_reduce and barrier fail or do nothing on the CPU, so ``all_gather_object`` is built
  from world-group broadcasts of int32 words.
* PyNative launches operations asynchronously even on the CPU: a broadcast's result is
  in memory only after the operation queue has been drained.
* In-place operations do not write through views there (``copy_`` into a slice leaves
  the base unchanged, ``add_`` does nothing), and ``asnumpy()`` of a view is a copy.
  Data is therefore written through NumPy arrays that alias a tensor's own memory
  (``asnumpy()`` of a tensor that owns its storage, ``Tensor.from_numpy``), and a
  destination that is a view of another tensor is refused with ``ValueError``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any

import mindspore
import numpy as np
from mindspore import Tensor, mint
from mindspore.communication import GlobalComm
from mindspore.mint import distributed as msdist

from . import codec
from ._base import Capabilities, Handle, Platform

logger = logging.getLogger(__name__)

try:  # the only way to drain PyNative's operation queue on the CPU (see synchronize)
    from mindspore.common.api import _pynative_executor
except ImportError as exc:  # pragma: no cover - depends on the MindSpore release
    raise ImportError(
        "the 'mindspore' platform needs mindspore.common.api._pynative_executor to wait for "
        f"queued operations; it is missing in MindSpore {mindspore.__version__}. "
        "Install mindspore>=2.3,<2.11"
    ) from exc

# Measured on CPU (module docstring): the only dtypes MindSpore's CPU broadcast sends intact.
_CPU_NATIVE = frozenset({"float32", "int32"})
# HCCL/NCCL broadcast types per MindSpore's Broadcast documentation (not run here).
_DEVICE_NATIVE = frozenset({"float32", "float16", "bfloat16", "int8", "int32"})

# neutral name -> attribute of the mindspore module; the names match dcp's torch names.
_DTYPE_ATTRS = {
    "float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "hifloat8": "hifloat8",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8",
    "uint64": "uint64", "uint32": "uint32", "uint16": "uint16", "uint8": "uint8",
    "bool": "bool_", "complex64": "complex64", "complex128": "complex128",
}
_NAME_TO_DTYPE: dict[str, Any] = {
    name: getattr(mindspore, attr) for name, attr in _DTYPE_ATTRS.items() if hasattr(mindspore, attr)
}
_DTYPE_TO_NAME: dict[Any, str] = {dtype: name for name, dtype in _NAME_TO_DTYPE.items()}

_DEVICE_TYPES = {"CPU": "cpu", "Ascend": "npu", "GPU": "cuda"}

# On the CPU each broadcast is completed before broadcast() returns (which returns None):
# CPU broadcasts do not overlap (capabilities.async_overlap is False), and a queued
# broadcast's failure ("CollectiveWait N failed") was seen to surface only at a later,
# unrelated synchronize; completed inline, the error belongs to the call that caused it.
_CPU_INLINE = True


def _drain() -> None:
    """Wait until every operation PyNative has queued in this process has run."""
    _pynative_executor.sync()


class _Handle:
    """A queued broadcast; ``wait`` drains the queue, then unpacks words on receivers."""

    def __init__(self, finish: Any = None, keep: Any = None):
        self._finish, self._keep = finish, keep

    def wait(self) -> None:
        _drain()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self._keep = None


class _NonMember:
    """What ``new_group`` returns on ranks outside the group (nothing to create there)."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"_NonMember(ranks={self.ranks})"


class MindSporePlatform(Platform):
    """MindSpore collectives on the device set by ``mindspore.set_device``.

    Create it after ``mindspore.communication.init()``. On the CPU only the world group
    exists (``capabilities.subgroups`` is False and ``new_group`` raises
    ``NotImplementedError``) and only float32/int32 are sent as they are; any other dtype
    goes bit-exact as int32 words.
    """

    name = "mindspore"

    def __init__(self) -> None:
        self._target = str(mindspore.get_context("device_target"))
        self._cpu = self._target == "CPU"
        self._created: dict[str, tuple[int, ...]] = {}
        self._group_ids = itertools.count()
        self._caps = Capabilities(
            subgroups=not self._cpu,
            native_dtypes=_CPU_NATIVE if self._cpu else _DEVICE_NATIVE,
            host_collectives=self._cpu,
            device_type=_DEVICE_TYPES.get(self._target, self._target.lower()),
            async_overlap=not self._cpu,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_target={self._target!r})"

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # -- ranks -------------------------------------------------------------------------
    def _initialised(self) -> bool:
        return bool(msdist.is_initialized())

    def is_distributed(self) -> bool:
        return self._initialised() and self.world_size() > 1

    def rank(self) -> int:
        return int(msdist.get_rank()) if self._initialised() else 0

    def world_size(self) -> int:
        return int(msdist.get_world_size()) if self._initialised() else 1

    def all_gather_object(self, obj: Any, *, waiter: Any = None) -> list[Any]:
        # Synchronous (one completed broadcast at a time): ``waiter`` is never needed.
        if not self.is_distributed():
            return [obj]
        payload = codec.pack_or_refusal(obj)  # plain data, never pickle (dcp_platform.codec)
        world, me = self.world_size(), self.rank()
        # Every rank sends its byte length in turn, then its payload in turn: broadcast on
        # the world group is the one collective that works on every MindSpore target.
        # One broadcast at a time, each completed before the next (see _CPU_INLINE).
        sizes = []
        for r in range(world):
            box = np.array([len(payload) if r == me else 0], dtype=np.int32)
            msdist.broadcast(Tensor.from_numpy(box), r, group=self.world_group())
            _drain()
            sizes.append(int(box[0]))
        codec.check_lengths(sizes)
        words = []
        for r, size in enumerate(sizes):
            buf = np.zeros(math.ceil(size / 4), dtype=np.int32)
            if r == me:
                buf.view(np.uint8)[:size] = np.frombuffer(payload, dtype=np.uint8)
            words.append(buf)
            if buf.size:
                msdist.broadcast(Tensor.from_numpy(buf), r, group=self.world_group())
                _drain()
        return codec.unpack_gathered([buf.view(np.uint8)[:size].tobytes() for buf, size in zip(words, sizes,
                                                                                             strict=True)])

    # -- groups ------------------------------------------------------------------------
    def world_group(self) -> str:
        if not self._initialised():
            raise RuntimeError(
                f"the {self.name!r} platform has no world group: MindSpore communication is "
                "not initialised (call mindspore.communication.init() first)"
            )
        return str(GlobalComm.WORLD_COMM_GROUP)

    def new_group(self, ranks: Sequence[int]) -> Any:
        key = tuple(int(r) for r in ranks)
        if list(key) != sorted(set(key)):
            raise ValueError(f"new_group: ranks must be sorted and unique, got {list(key)}")
        world = self.world_size()
        if not key or key[0] < 0 or key[-1] >= world:
            raise ValueError(f"new_group: ranks {list(key)} out of range for world size {world}")
        if self._cpu:
            raise self._unsupported(
                f"new_group({list(key)}) on the CPU: MindSpore's CPU collectives run on the world "
                "group only; check capabilities.subgroups and use world_group() instead"
            )
        if self.rank() not in key:
            return _NonMember(key)
        from mindspore.communication import create_group

        name = f"dcp_{next(self._group_ids)}_{'_'.join(map(str, key))}"
        create_group(name, list(key))
        self._created[name] = key
        return name

    def destroy_group(self, group: Any) -> None:
        if group is None or (self._initialised() and group == self.world_group()):
            raise ValueError("destroy_group: the world group cannot be destroyed")
        if isinstance(group, _NonMember):
            return  # nothing was created on this rank
        if group not in self._created:
            raise ValueError(f"destroy_group: {group!r} was not created by this platform object")
        from mindspore.communication import destroy_group

        del self._created[group]
        destroy_group(group)

    # -- host views ---------------------------------------------------------------------
    def _host_alias(self, tensor: Any, what: str) -> np.ndarray:
        """A NumPy array sharing ``tensor``'s memory (waits for queued work on it first)."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{what}: expected a mindspore.Tensor, got {type(tensor).__qualname__}")
        if not self._cpu:
            raise self._unsupported(
                f"{what} on {self._target}: device memory cannot be aliased from the host"
            )
        arr = tensor.asnumpy()
        if arr.size and arr.ctypes.data != tensor.data_ptr():
            raise ValueError(
                f"{what}: the tensor of shape {tuple(tensor.shape)} is a view of another tensor "
                f"(storage offset {tensor.storage_offset()}, contiguous={tensor.is_contiguous()}); "
                "MindSpore on the CPU does not write through views. Pass a tensor that owns its "
                "memory (e.g. view.copy()) and assign it into the base with base[...] = tensor"
            )
        return arr

    # -- data movement -----------------------------------------------------------------
    def _check_group(self, group: Any) -> str:
        if group is None:
            return self.world_group()
        if isinstance(group, _NonMember):
            raise ValueError(f"broadcast: this rank ({self.rank()}) is not in group {group.ranks}")
        if self._cpu and group != self.world_group():
            raise self._unsupported(f"broadcast on group {group!r} on the CPU (world group only)")
        return str(group)

    def broadcast(self, tensor: Any, src: int, group: Any = None) -> Handle | None:
        name = self._check_group(group)
        world = self.world_size()
        if not 0 <= src < world:
            raise ValueError(f"broadcast: src {src} out of range for world size {world}")
        if not self._cpu:
            dtype = self.dtype_name(tensor.dtype)
            if dtype not in self._caps.native_dtypes:
                raise self._unsupported(
                    f"broadcast of {dtype} on {self._target}: only {sorted(self._caps.native_dtypes)} "
                    "are sent as they are there, and raw bytes are moved through host memory"
                )
            msdist.broadcast(tensor, src, group=name)
            return _Handle(keep=tensor)
        nbytes = self.nbytes(tensor)
        if nbytes == 0:
            return None  # same shape on every rank: nobody sends anything
        me = self.rank()
        dst = self._host_alias(tensor, "broadcast") if me != src else None
        if self.dtype_name(tensor.dtype) in self._caps.native_dtypes:
            wire = tensor
            if me == src:
                data = tensor.asnumpy()
                if data.size and data.ctypes.data != tensor.data_ptr():
                    # A view: asnumpy() gave a contiguous copy; send that (same dtype and size).
                    wire = Tensor.from_numpy(data)
            msdist.broadcast(wire, src, group=name)
            return self._cpu_handle(_Handle(keep=wire))
        # Raw bytes as int32 words, padded; receivers unpack after the queue has run.
        words = np.zeros(math.ceil(nbytes / 4), dtype=np.int32)
        if me == src:
            words.view(np.uint8)[:nbytes] = tensor.asnumpy().reshape(-1).view(np.uint8)
        wire = Tensor.from_numpy(words)
        msdist.broadcast(wire, src, group=name)
        if dst is None:
            return self._cpu_handle(_Handle(keep=(words, wire)))

        def unpack() -> None:
            dst.reshape(-1).view(np.uint8)[:] = words.view(np.uint8)[:nbytes]

        return self._cpu_handle(_Handle(finish=unpack, keep=(words, wire)))

    def _cpu_handle(self, handle: _Handle) -> _Handle | None:
        """On the CPU, complete the broadcast before returning (see ``_CPU_INLINE``)."""
        if not _CPU_INLINE:
            return handle
        handle.wait()
        return None

    def fused_copy(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"fused_copy: {len(dsts)} destinations but {len(srcs)} sources")
        bad = [f"pair {i}: dst {tuple(d.shape)} {d.dtype} vs src {tuple(s.shape)} {s.dtype}"
               for i, (d, s) in enumerate(zip(dsts, srcs, strict=True))
               if tuple(d.shape) != tuple(s.shape) or d.dtype != s.dtype]
        if bad:
            raise ValueError("fused_copy: shapes and dtypes must match; " + "; ".join(bad))
        if not dsts:
            return
        if not self._cpu:
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(s)
            return
        _drain()
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            out = self._host_alias(d, f"fused_copy destination {i}")
            # Copy bytes: exact for every dtype, float8 included (no NumPy dtype of its own).
            out.reshape(-1).view(np.uint8)[:] = s.asnumpy().reshape(-1).view(np.uint8)

    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Any:
        if device is not None and str(device).lower() not in (self._caps.device_type, self._target.lower()):
            raise ValueError(
                f"empty: device {device!r} is not this platform's device "
                f"({self._caps.device_type!r}); MindSpore places tensors on the device chosen "
                "with mindspore.set_device"
            )
        return mint.empty(tuple(int(n) for n in shape), dtype=dtype)

    def nbytes(self, tensor: Any) -> int:
        return int(tensor.nbytes)

    def as_bytes(self, tensor: Any) -> Any:
        if not tensor.is_contiguous():
            raise ValueError(
                f"as_bytes: tensor of shape {tuple(tensor.shape)} is not contiguous; "
                "call .contiguous() first"
            )
        arr = self._host_alias(tensor, "as_bytes")
        return Tensor.from_numpy(arr.reshape(-1).view(np.uint8))

    def from_bytes(self, raw: Any, dtype: Any, shape: Sequence[int]) -> Any:
        if not isinstance(raw, Tensor) or raw.dtype != mindspore.uint8 or raw.ndim != 1:
            raise ValueError(
                f"from_bytes: expected a 1-D uint8 mindspore.Tensor, got "
                f"{getattr(raw, 'dtype', type(raw).__qualname__)} {tuple(getattr(raw, 'shape', ()))}"
            )
        shape = tuple(int(n) for n in shape)
        try:
            np_dtype = np.dtype(mindspore.dtype_to_nptype(dtype))
        except (KeyError, TypeError):
            raise TypeError(
                f"from_bytes: MindSpore has no NumPy dtype for {self.dtype_name(dtype)}, so raw "
                "bytes cannot be viewed as it on the host; move such data as bytes end to end"
            ) from None
        arr = self._host_alias(raw, "from_bytes")
        need = math.prod(shape) * np_dtype.itemsize
        if arr.size != need:
            raise ValueError(f"from_bytes: {arr.size} bytes cannot hold shape {shape} of "
                             f"{self.dtype_name(dtype)} ({need} bytes)")
        if arr.ctypes.data % np_dtype.itemsize:
            raise ValueError(f"from_bytes: the bytes start at an address not aligned to "
                             f"{np_dtype.itemsize} bytes ({self.dtype_name(dtype)})")
        return Tensor.from_numpy(arr.view(np_dtype).reshape(shape))

    def dtype_name(self, dtype: Any) -> str:
        try:
            return _DTYPE_TO_NAME[dtype]
        except (KeyError, TypeError):
            raise ValueError(f"the {self.name!r} platform has no neutral name for dtype {dtype!r}; "
                             f"known: {sorted(_NAME_TO_DTYPE)}") from None

    def dtype_from_name(self, name: str) -> Any:
        try:
            return _NAME_TO_DTYPE[name]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r} for the {self.name!r} platform; "
                             f"known: {sorted(_NAME_TO_DTYPE)}") from None

    def synchronize(self) -> None:
        # PyNative queues operations even on the CPU, where mindspore.runtime.synchronize()
        # does nothing (it logs "CPU device is not supported"): drain the queue itself.
        _drain()
        if not self._cpu:
            mindspore.runtime.synchronize()
