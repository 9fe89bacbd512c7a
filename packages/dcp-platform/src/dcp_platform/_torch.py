"""torch backend: CPU tensors over gloo, CUDA tensors over NCCL."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import codec
from ._base import Capabilities, Handle, Platform
from ._group import GroupView

logger = logging.getLogger(__name__)

# Measured (dcp-platform README, "Measured facts", and the rank tests): gloo rejects float8
# and int16 ("Invalid scalar type"); these go as they are. NCCL has no int16 type either.
_GLOO_NATIVE = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool"}
)
_NCCL_NATIVE = _GLOO_NATIVE | {"float8_e4m3fn", "float8_e5m2"}

DEFAULT_GROUP_TIMEOUT = timedelta(minutes=10)


class _CopyBackHandle:
    """Waits on a broadcast done through a temporary, then copies into the caller's tensor."""

    def __init__(self, work: Handle | None, tmp: torch.Tensor, dst: torch.Tensor):
        self._work, self._tmp, self._dst = work, tmp, dst

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> None:
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout=timeout)
        self._work = None
        self._dst.copy_(self._tmp.view(self._dst.dtype).view(self._dst.shape))


def _wait(handle: Any) -> None:
    handle.wait()


def _timed_out(handle: Any, exc: BaseException) -> bool:
    """Whether a ``wait(timeout=)`` that raised only ran out of time (the work lives on).

    The work may finish between the expiry and this check (seen under load: 8 gloo ranks on
    2 cores): then its own ``wait()`` decides, raising if it failed."""
    if "timed out" not in str(exc).lower():
        return False
    completed = getattr(handle, "is_completed", None)
    if completed is not None and completed():
        handle.wait()
    return True


# The gloo control group of each default process group, by id of that group. A cache by
# design: dcp-load makes a platform object per load, and a new gloo group per load would
# leak one group per load. An entry counts only while its group is still registered with
# torch.distributed (destroy_process_group() unregisters every group), so a re-initialised
# default group gets a fresh one.
_CONTROL_GROUPS: dict[int, Any] = {}


def _control_group_for(timeout: timedelta) -> Any:
    from torch.distributed import distributed_c10d as c10d

    key = id(c10d._get_default_group())
    group = _CONTROL_GROUPS.get(key)
    if group is None or group not in c10d._world.pg_map:
        group = dist.new_group(backend="gloo", timeout=timeout)
        _CONTROL_GROUPS[key] = group
    return group


def _member_groups_supported() -> bool:
    """Whether ``new_member_group`` can run here (see ``TorchPlatform.new_member_group``).

    gloo and NCCL only (measured on gloo; NCCL takes the code path torch's own
    ``new_group(use_local_synchronization=True)`` takes, untested here for want of GPUs),
    and not with NCCL's communicator splitting (a default group bound to a device: a split
    is a collective over the whole parent), TorchComms, or where torch's group helper lacks
    the arguments it is called with. HCCL (Ascend) is left on the all-gathered path until
    measured.
    """
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return False
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None or not hasattr(c10d._world, "pg_group_ranks"):
        return False
    needed = {"group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name", "timeout"}
    if not needed <= _parameters(helper):
        return False
    torchcomms = getattr(c10d, "_use_torchcomms_enabled", lambda: False)
    default = c10d._get_default_group()
    backends = set(str(dist.get_backend()).replace(",", ":").split(":")) - {"cpu", "cuda"}
    return (getattr(default, "bound_device_id", None) is None and not torchcomms()
            and bool(backends) and backends <= {"gloo", "nccl"})


@functools.lru_cache(maxsize=4)
def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of ``fn``: ``inspect.signature`` took 18 of the 22 us that making
    a platform took (one per load), and a function's signature does not change."""
    import inspect

    return frozenset(inspect.signature(fn).parameters)


class TorchPlatform(Platform):
    """torch.distributed over gloo (host tensors) or NCCL (CUDA tensors).

    ``device``: where staging buffers live; by default ``cuda:<current>`` when the process
    group uses NCCL, else ``cpu``. ``group_timeout`` bounds every group created here.

    ``group``: the process group to work within (default ``None``: the default group, the
    world). With a group, ranks, world size, store and every collective are the group's
    (``_group.GroupView``): ranks outside it take no part. ``store``, ``group_key`` and
    ``global_ranks`` describe a group not registered with ``torch.distributed`` (one joined
    through a ``TCPStore``; see ``GroupView``).
    """

    name = "torch"
    _device_type = "cpu"
    #: collective library assumed when no process group is initialised yet
    _default_backend = "gloo"

    def __init__(self, device: str | torch.device | None = None,
                 group_timeout: timedelta = DEFAULT_GROUP_TIMEOUT, group: Any = None, *, store: Any = None,
                 group_key: str | None = None, global_ranks: Sequence[int | None] | None = None):
        self._group_timeout = group_timeout
        self._created: dict[tuple[int, ...], Any] = {}
        self._control: Any = None
        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and initialised and group is dist.group.WORLD:
            group = None  # the world is the default: the same platform as without a group
        self._view = GroupView(group, group_timeout, store=store, key=group_key,
                               global_ranks=global_ranks) if group is not None else None
        backend = (self._view.backend if self._view is not None else dist.get_backend() if initialised
                   else self._default_backend)
        self._backend = str(backend)
        if device is None:
            device = self._default_device()
        self._device = torch.device(device)
        native = _NCCL_NATIVE if self._backend in ("nccl", "hccl") else _GLOO_NATIVE
        host = "gloo" in self._backend or self._backend in ("mpi",)
        self._caps = Capabilities(
            subgroups=True,
            native_dtypes=native,
            host_collectives=host,
            device_type=self._device.type,
            async_overlap=self._device.type != "cpu",
            member_groups=self._view is not None or _member_groups_supported(),
        )

    def _default_device(self) -> torch.device:
        if "nccl" in self._backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        within = f", group={self._view!r}" if self._view is not None else ""
        return f"{type(self).__name__}(backend={self._backend!r}, device={str(self._device)!r}{within})"

    @property
    def group_key(self) -> str:
        """A name for the group this platform works within, the same on every member:
        ``"world"`` for the default group, else the group's key (``GroupView.key``)."""
        return "world" if self._view is None else self._view.key

    def global_ranks(self) -> tuple[int | None, ...] | None:
        """Per rank of this platform, its rank in this process's default world (None where
        outside it); None when the platform is the world itself (the identity)."""
        return None if self._view is None else self._view.global_ranks

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        """The collective library of the default process group (``gloo``, ``nccl``...)."""
        return self._backend

    # -- ranks -------------------------------------------------------------------------
    def is_distributed(self) -> bool:
        if self._view is not None:
            return self._view.size() > 1
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def rank(self) -> int:
        if self._view is not None:
            return self._view.rank()
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def world_size(self) -> int:
        if self._view is not None:
            return self._view.size()
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        if self._view is not None:
            return self._view.all_gather(outs, tensor)
        return dist.all_gather(outs, tensor, group=self._control_group(), async_op=True)

    def all_gather_object(self, obj: Any, *, waiter: Callable[[Any], Any] | None = None) -> list[Any]:
        """Every rank's ``obj`` (plain data: ``dcp_platform.codec.pack``), in rank order.

        Two asynchronous all-gathers (lengths, then padded payloads), each waited on by
        ``waiter`` (default: without a bound), so that a caller can bound the wait and abort
        it. Nothing is unpickled: a payload that is not the codec's raises
        ``ValueMessageError`` naming its rank, and a value a rank could not encode raises
        ``UnsendableValueError`` naming that rank, on every rank alike."""
        if self._view is None and not (dist.is_available() and dist.is_initialized()):
            return [obj]
        waiter = waiter or _wait
        world = self.world_size()
        payload = torch.frombuffer(bytearray(codec.pack_or_refusal(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        waiter(self._all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64)))
        lengths = [int(s[0]) for s in sizes]
        codec.check_lengths(lengths)
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        outs = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(world)]
        waiter(self._all_gather(outs, padded))
        return codec.unpack_gathered([o.numpy()[:n].tobytes() for o, n in zip(outs, lengths, strict=True)])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        """Start an element-wise ``"sum"`` or ``"max"`` of the host (int64) ``tensor`` over
        every rank, in place, on the control group; returns the handle to wait on."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
        if self._view is not None:
            return self._view.all_reduce(tensor, op)
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                               group=self._control_group(), async_op=True)

    def _control_group(self) -> Any:
        """A host-memory (gloo) group over the world for small control messages.

        The default group when it is gloo; under NCCL/HCCL a gloo group created on first
        use (a collective: every rank reaches it in its first all-gather) and shared by
        every platform object of this default group (see ``_CONTROL_GROUPS``).
        """
        if "gloo" in self._backend:
            return None
        if self._control is None:
            self._control = _control_group_for(self._group_timeout)
        return self._control

    def store(self) -> Any:
        if self._view is not None:
            return self._view.store
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()

    def group_timeout(self) -> float | None:
        if self._view is not None:
            return self._view.timeout_seconds()
        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed import distributed_c10d as c10d

        # The timeout init_process_group gave the backend (gloo, NCCL): torch keeps it in the
        # backend's options; the store got the same value, which is the fallback.
        try:
            backend = c10d._get_default_group()._get_backend(self._device)
            timeout = backend.options._timeout
        except Exception:  # noqa: BLE001 - a backend without options (custom, fake): ask the store
            timeout = getattr(self.store(), "timeout", None)
        return timeout.total_seconds() if isinstance(timeout, timedelta) else None

    def wait(self, handle: Any, timeout: float) -> bool:
        completed = getattr(handle, "is_completed", None)
        if completed is not None and completed():
            handle.wait()
            return True
        if "gloo" not in self._backend or completed is None:
            # NCCL's wait(timeout=) treats expiry as a fatal error: poll instead.
            end = time.monotonic() + timeout
            while completed is not None and not completed():
                if time.monotonic() >= end:
                    return False
                time.sleep(0.0005)
            handle.wait()
            return True
        try:
            # gloo honours the timeout and leaves the work running when it expires
            # (measured: "Operation timed out!" after 0.30 s of a 0.3 s wait, later wait() ok).
            handle.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            if _timed_out(handle, exc):
                return bool(getattr(handle, "is_completed", lambda: False)())
            raise
        return True

    # -- groups ------------------------------------------------------------------------
    def world_group(self) -> Any:
        if self._view is not None:
            return self._view.pg
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"the {self.name!r} platform has no world group: torch.distributed is not "
                "initialised (call torch.distributed.init_process_group first)"
            )
        return dist.group.WORLD

    def new_group(self, ranks: Sequence[int]) -> Any:
        key = tuple(ranks)
        if list(key) != sorted(set(key)):
            raise ValueError(f"new_group: ranks must be sorted and unique, got {list(key)}")
        world = self.world_size()
        if not key or key[0] < 0 or key[-1] >= world:
            raise ValueError(f"new_group: ranks {list(key)} out of range for world size {world}")
        if self._view is not None:  # every member of the view's group calls it, in one order
            return self._view.make(key, self._view.next_name(key))
        group = dist.new_group(ranks=list(key), timeout=self._group_timeout)
        self._created[key] = group
        return group

    def new_member_group(self, ranks: Sequence[int], name: str) -> Any:
        """A group of exactly ``ranks``, created by its members alone (``Platform``).

        ``torch.distributed.new_group(use_local_synchronization=True)`` lets only members
        call it, but names the group from the ranks and this process's count of groups,
        which differs between members that belong to different groups: two overlapping
        groups created that way waited for each other until killed (3 gloo ranks, groups
        (0, 1), (0, 2), (1, 2) in one sorted order). So the group is made by torch's own
        group helper under ``name``, which every member passes alike.
        """
        from torch.distributed import distributed_c10d as c10d

        key = tuple(ranks)
        if not self._caps.member_groups:
            raise self._unsupported("groups created by their members alone (new_member_group)")
        world, me = self.world_size(), self.rank()
        if list(key) != sorted(set(key)) or not key or key[0] < 0 or key[-1] >= world:
            raise ValueError(f"new_member_group: ranks must be sorted, unique and in range for world "
                             f"size {world}, got {list(key)}")
        if me not in key:
            raise ValueError(f"new_member_group: rank {me} is not in {list(key)}; only members call it")
        if self._view is not None:
            return self._view.make(key, f"m-{name}")
        out = c10d._new_process_group_helper(
            group_size=len(key), group_rank=key.index(me), global_ranks_in_group=list(key),
            backend=c10d.Backend(dist.get_backend()), store=c10d._get_default_store(),
            group_name=f"dcp:{name}", timeout=self._group_timeout)
        group = out[0] if isinstance(out, tuple) else out
        c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(key)}
        self._created[key] = group
        return group

    def destroy_group(self, group: Any) -> None:
        if group is None or group is dist.group.WORLD or (self._view is not None and group is self._view.pg):
            raise ValueError("destroy_group: the world group cannot be destroyed")
        if self._view is not None:
            self._view.destroy(group)
            return
        for key, g in list(self._created.items()):
            if g is group:
                del self._created[key]
        # Non-members hold GroupMember.NON_GROUP_MEMBER; there is nothing to release there.
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)

    # -- data movement -----------------------------------------------------------------
    def _transport(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The tensor to hand to the collective, and whether it is a temporary copy."""
        needs_bytes = self.dtype_name(tensor.dtype) not in self._caps.native_dtypes
        if tensor.is_contiguous():
            return (self.as_bytes(tensor) if needs_bytes else tensor), False
        tmp = tensor.contiguous()
        return (self.as_bytes(tmp) if needs_bytes else tmp), True

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> Handle | None:
        wire, is_tmp = self._transport(tensor)
        if self._view is not None:
            work = self._view.broadcast(wire, src, group)
        else:
            work = dist.broadcast(wire, src=src, group=group, async_op=True)
        if is_tmp:
            return _CopyBackHandle(work, wire, tensor)
        return work

    def fused_copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"fused_copy: {len(dsts)} destinations but {len(srcs)} sources")
        if not dsts:
            return
        torch._foreach_copy_(list(dsts), list(srcs))

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device or self._device)

    def nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def as_bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError(
                f"as_bytes: tensor of shape {tuple(tensor.shape)} is not contiguous; "
                "call .contiguous() first"
            )
        return tensor.reshape(-1).view(torch.uint8)

    def from_bytes(self, raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise ValueError(f"from_bytes: expected a 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
        return raw.view(dtype).view(tuple(shape))

    def dtype_name(self, dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    def dtype_from_name(self, name: str) -> torch.dtype:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r} for the {self.name!r} platform")
        return dtype

    def device_copies(self, device: Any) -> Any:
        """``DeviceCopies`` through ``torch.get_device_module(device)`` (CUDA, NPU, XPU),
        one per device and platform object; ``None`` for the host or where pinned memory
        cannot be allocated (``Platform.device_copies``)."""
        from ._device import torch_device_copies

        key = str(torch.device(device))
        cache = self.__dict__.setdefault("_copies", {})
        if key not in cache:
            cache[key] = torch_device_copies(device)
        return cache[key]

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        # On the CPU every queued operation has already completed when its call returned;
        # gloo work is waited on through its handle, so there is no stream to drain.
