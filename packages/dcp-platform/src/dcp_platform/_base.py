"""The seam every other dcp package talks to: one ``Platform`` object per backend.

Call order and threading contract
---------------------------------
* A platform object is created once per process (``get_platform``) after the framework's
  process group / communication is initialised, and passed down explicitly.
* ``new_group`` is a collective: every rank of the world calls it with the same rank list,
  members and non-members alike, and in the same order as every other rank.
* ``broadcast`` is asynchronous: it returns a handle with ``wait()``, or ``None`` when the
  backend completed the broadcast inline. The tensor must not be read (on receivers) or
  written (on the source) until the handle is waited on. Any dtype is accepted: dtypes the
  backend cannot send natively travel as raw bytes and arrive bit-exact.
* ``empty`` allocates; nothing else allocates more than a transport view of its inputs,
  except ``broadcast`` for dtypes outside ``capabilities.native_dtypes`` on backends that
  cannot alias raw bytes (documented per backend).
* All methods are called from one thread per process, except ``store`` operations, which
  a watch thread (``dcp_platform.Watch``) also uses.
* ``wait(handle, timeout)`` bounds one wait on a handle; ``all_gather_object(obj,
  waiter=...)`` hands each of its internal collectives to ``waiter`` instead of blocking,
  so that a caller can bound and abort it (see ``Watch``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Handle(Protocol):
    """An in-flight collective. ``wait()`` blocks until the local buffer is final."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so that callers choose a strategy instead of failing late.

    ``subgroups``: collectives on groups smaller than the world are supported.
    ``native_dtypes``: dtype names (``str(dtype)`` without the framework prefix, e.g.
    ``"float32"``, ``"bfloat16"``) that the collective library sends as they are; others
    travel as raw bytes.
    ``host_collectives``: collectives work on tensors in host memory (gloo: yes, NCCL: no).
    ``device_type``: where staging buffers live by default (``"cpu"``, ``"cuda"``, ``"npu"``).
    ``async_overlap``: in-flight broadcasts progress concurrently (False on gloo, where
    asynchronous small broadcasts were measured not to overlap).
    ``member_groups``: ``new_member_group`` works: a group is created by its members alone,
    with no call on other ranks and no exchange of rank lists.
    """

    subgroups: bool
    native_dtypes: frozenset[str]
    host_collectives: bool
    device_type: str
    async_overlap: bool = True
    member_groups: bool = False


class Platform(abc.ABC):
    """One backend's collectives, groups, fused copy and allocation.

    A method a backend cannot honour raises ``NotImplementedError`` naming the backend; no
    method is a silent no-op.
    """

    #: backend name, as accepted by ``get_platform``
    name: str

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    # -- ranks -------------------------------------------------------------------------
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's global rank (0 when not distributed)."""

    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks (1 when not distributed)."""

    @abc.abstractmethod
    def is_distributed(self) -> bool:
        """True when a process group / communicator is initialised with world size > 1."""

    @abc.abstractmethod
    def all_gather_object(self, obj: Any, *, waiter: Any = None) -> list[Any]:
        """Collective: every rank contributes a small plain-data object, all receive the list.

        Plain data is what ``dcp_platform.codec.pack`` carries (None, bool, int, float, str,
        bytes, list, tuple, dict), never pickle: bytes that are not the codec's raise
        ``codec.ValueMessageError`` and a value a rank cannot encode
        ``codec.UnsendableValueError``, each naming the rank, on every rank alike.

        ``waiter(handle)``: called to wait on each collective the all-gather issues (it
        must return once the handle completed, or raise). Control traffic: it travels over
        host memory (a gloo group or the backend's host path), never device memory.
        Backends whose all-gather is synchronous (MindSpore) never call ``waiter``.
        """

    def store(self) -> Any:
        """The job's key-value store (torch: the default process group's), or ``None``.

        Used by ``Watch`` for arrival barriers, abort keys and heartbeats. ``None`` (the
        default, MindSpore) means waits cannot be bounded: they block as the backend does.
        """
        return None

    def group_timeout(self) -> float | None:
        """The default process group's timeout in seconds, or ``None`` when there is none
        (not initialised, or a backend without one): ``dcp-load`` takes it as the default
        bound on how long ranks wait for each other."""
        return None

    def wait(self, handle: Handle, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``handle``: True once complete, False if not yet.

        Raises the collective's own error (a dead peer's "connection closed"...). This
        default cannot bound the wait: it blocks in ``handle.wait()`` and returns True.
        """
        handle.wait()
        return True

    # -- groups ------------------------------------------------------------------------
    @abc.abstractmethod
    def world_group(self) -> Any:
        """The group of all ranks."""

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Any:
        """Collective over the world: create a group of exactly ``ranks`` (sorted, unique).

        Every rank must call it, in the same order as every other rank. Raises
        ``NotImplementedError`` when ``capabilities.subgroups`` is False.
        """

    def new_member_group(self, ranks: Sequence[int], name: str) -> Any:
        """Collective over ``ranks`` only: create a group of exactly ``ranks`` (sorted, unique).

        Only members call it; non-members do nothing. ``name`` is the same on every member
        and unique in the job (it keys the group's rendezvous). A rank that creates several
        such groups must create them in one order shared by all ranks (for example sorted
        rank tuples), so that no two members wait on each other in different orders.
        Raises ``NotImplementedError`` unless ``capabilities.member_groups``.
        """
        raise self._unsupported("groups created by their members alone (new_member_group)")

    @abc.abstractmethod
    def destroy_group(self, group: Any) -> None:
        """Release a group created by ``new_group``. The world group cannot be destroyed."""

    # -- data movement -----------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, tensor: Any, src: int, group: Any = None) -> Handle | None:
        """Asynchronously broadcast ``tensor`` in place from global rank ``src``.

        ``group`` is a group from ``new_group``/``world_group`` (``None``: the world).
        Returns a handle to ``wait()`` on, or ``None`` when already complete.
        """

    @abc.abstractmethod
    def fused_copy(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
        """Copy ``srcs[i]`` into ``dsts[i]`` for all i, in as few kernel launches as possible.

        Pairs have equal shapes and dtypes; destinations may be non-contiguous views.
        """

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: Any, device: Any = None) -> Any:
        """An uninitialised tensor (``device=None``: the platform's staging device)."""

    @abc.abstractmethod
    def nbytes(self, tensor: Any) -> int:
        """Bytes of the tensor's elements (numel x element size)."""

    @abc.abstractmethod
    def as_bytes(self, tensor: Any) -> Any:
        """A 1-D uint8 tensor sharing memory with the contiguous ``tensor``."""

    @abc.abstractmethod
    def from_bytes(self, raw: Any, dtype: Any, shape: Sequence[int]) -> Any:
        """View of the 1-D uint8 tensor ``raw`` as ``dtype`` with ``shape`` (shares memory).

        ``raw`` must start at an offset aligned to the element size.
        """

    @abc.abstractmethod
    def dtype_name(self, dtype: Any) -> str:
        """Framework-neutral dtype name: ``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``..."""

    @abc.abstractmethod
    def dtype_from_name(self, name: str) -> Any:
        """Inverse of ``dtype_name``; raises ``ValueError`` naming an unknown dtype."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work queued on the current device stream (a real sync on GPU/NPU)."""

    # -- host <-> accelerator copies ------------------------------------------------------
    def device_copies(self, device: Any) -> Any:
        """The copy engine (``dcp_platform._device.DeviceCopies``: pinned host buffers, a
        copy stream, events) for tensors on ``device``, or ``None``: ``device`` is the host,
        or this backend has no pinned memory or streams there. ``None`` means the plain
        path: ``Tensor.copy_`` through pageable memory, as before. The default (MindSpore,
        which keeps its own host-device path) is ``None``."""
        del device
        return None

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name!r} platform does not support {what}")
