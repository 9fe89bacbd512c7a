"""Functions that run inside real ranks for the dcp-platform tests (not a test module).

The tests put this folder on ``sys.path`` so that rank processes can import these
functions by name (pytest's importlib mode gives test modules names that children cannot
import). Frameworks are imported lazily, so this module imports without torch or MindSpore.

Each ``*_cases`` function runs many checks in one launch and returns this rank's list of
problems (empty when everything held), so a test asserts ``not errors`` with every problem
of every rank in the message. Receiving tensors are poisoned (0x7F bytes) before each
receive, so data that never arrived fails a check.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import numpy as np

POISON = 0x7F
# Every dtype the neutral names cover on both frameworks, and shapes that catch 0-dim,
# odd byte counts (int8 x 7 = 7 bytes: MindSpore pads to int32 words) and 2-D.
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8",
          "uint8", "bool", "float8_e4m3fn")
SHAPES = ((), (7,), (3, 5))
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1}


def pattern(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Deterministic bytes for a tensor of ``dtype``/``shape`` (same on every rank).

    Random bytes make int64/float64 values that need all 64 bits, so a transport that
    truncates to 32 bits fails; bool bytes are 0/1 (the only valid bool bytes).
    """
    n = math.prod(shape) * ITEMSIZE[dtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    if dtype == "bool":
        raw %= 2
    raw[raw == POISON] = 1  # so that the poison can never pass for data
    return raw


class TorchKit:
    """Makes torch tensors from bytes and reads their bytes back, without the platform."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def make(self, raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
        t = self.torch.from_numpy(raw.copy())
        return t.view(self.dtype(dtype)).reshape(shape)

    def poisoned(self, dtype: str, shape: tuple[int, ...]) -> Any:
        n = math.prod(shape) * ITEMSIZE[dtype]
        return self.make(np.full(n, POISON, np.uint8), dtype, shape)

    def data(self, raw: np.ndarray, dtype: str, shape: tuple[int, ...], seed: int) -> Any:
        return self.make(raw, dtype, shape)

    def bytes_of(self, t: Any) -> bytes:
        return t.contiguous().reshape(-1).view(self.torch.uint8).numpy().tobytes()

    def set_byte(self, raw_u8: Any, index: int, value: int) -> None:
        raw_u8[index] = value

    def queue_copy(self, dst: Any, src: Any) -> np.ndarray:
        """Start copying src into dst; return dst's memory as an array that waits on nothing."""
        out = dst.numpy()
        dst.copy_(src)
        return out

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def transposed_view(self, rows: int, cols: int, dtype: str) -> tuple[Any, Any]:
        base = self.poisoned(dtype, (cols, rows))
        return base, base.t()


class MindSporeKit:
    """The same for MindSpore, through NumPy (``Tensor.from_numpy`` / ``asnumpy``)."""

    name = "mindspore"

    def __init__(self) -> None:
        with warnings.catch_warnings():  # MindSpore's import warns (deprecations) in 2.10
            warnings.simplefilter("ignore")
            import mindspore
        self.ms = mindspore

    def dtype(self, name: str) -> Any:
        return getattr(self.ms, "bool_" if name == "bool" else name)

    def _np_dtype(self, dtype: str) -> Any:
        return np.dtype(self.ms.dtype_to_nptype(self.dtype(dtype)))

    def make(self, raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
        if dtype.startswith("float8"):
            # MindSpore has no NumPy float8: keep the bytes' count, values from a conversion.
            values = raw.astype(np.float32).reshape(shape) / 16 - 8
            return self.ms.Tensor(values, self.dtype(dtype))
        return self.ms.Tensor.from_numpy(raw.copy().view(self._np_dtype(dtype)).reshape(shape))

    def poisoned(self, dtype: str, shape: tuple[int, ...]) -> Any:
        if dtype.startswith("float8"):
            return self.ms.Tensor(np.full(shape, -448.0, np.float32), self.dtype(dtype))
        n = math.prod(shape) * ITEMSIZE[dtype]
        return self.make(np.full(n, POISON, np.uint8), dtype, shape)

    def data(self, raw: np.ndarray, dtype: str, shape: tuple[int, ...], seed: int) -> Any:
        return self.make(raw, dtype, shape)

    def bytes_of(self, t: Any) -> bytes:
        return t.asnumpy().reshape(-1).view(np.uint8).tobytes()

    def set_byte(self, raw_u8: Any, index: int, value: int) -> None:
        raw_u8.asnumpy()[index] = value  # asnumpy() aliases a tensor that owns its memory

    def queue_copy(self, dst: Any, src: Any) -> np.ndarray:
        """Start copying src into dst (PyNative queues it); return dst's memory as an array
        that waits on nothing (taken before the copy is queued)."""
        out = dst.asnumpy()
        dst.copy_(src)
        return out

    def copy(self, dst: Any, src: Any) -> None:
        dst.asnumpy().reshape(-1).view(np.uint8)[:] = src.asnumpy().reshape(-1).view(np.uint8)

    def transposed_view(self, rows: int, cols: int, dtype: str) -> tuple[Any, Any]:
        base = self.poisoned(dtype, (cols, rows))
        return base, base.t()


KITS = {"torch": TorchKit, "mindspore": MindSporeKit}


def _expect(errors: list[str], cond: bool, what: str) -> None:
    if not cond:
        errors.append(what)


def _raises(errors: list[str], exc: type[BaseException], what: str, fn: Any, *args: Any,
            match: str | None = None) -> None:
    try:
        fn(*args)
    except exc as e:
        if match is not None and match not in str(e):
            errors.append(f"{what}: {exc.__name__} without {match!r}: {e}")
    except Exception as e:  # any other error is a finding, reported with its type
        errors.append(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}")
    else:
        errors.append(f"{what}: expected {exc.__name__}, nothing raised")


def collective_cases(rank: int, world: int, backend: str) -> list[str]:
    """Backend-neutral checks: ranks, all-gather, async broadcast of every dtype/shape from
    every source with several in flight, the explicit world group, and groups as far as
    the backend's capabilities say it has them."""
    from dcp_platform import get_platform

    p = get_platform(backend)
    kit = KITS[backend]()
    errors: list[str] = []
    _expect(errors, p.rank() == rank, f"rank() = {p.rank()}, launched as {rank}")
    _expect(errors, p.world_size() == world, f"world_size() = {p.world_size()}, launched with {world}")
    _expect(errors, p.is_distributed() is (world > 1), f"is_distributed() = {p.is_distributed()}")

    gathered = p.all_gather_object({"rank": rank, "blob": "x" * (5 * rank + 1), "t": (rank, None)})
    want = [{"rank": r, "blob": "x" * (5 * r + 1), "t": (r, None)} for r in range(world)]
    _expect(errors, gathered == want, f"all_gather_object gave {gathered!r}")

    # Every dtype and shape, from rotating sources, all in flight before the first wait.
    pending = []
    for i, (dtype, shape) in enumerate(itertools.product(DTYPES, SHAPES)):
        src = i % world
        raw = pattern(dtype, shape, seed=i)
        expected = kit.bytes_of(kit.data(raw, dtype, shape, i))
        buf = kit.data(raw, dtype, shape, i) if rank == src else kit.poisoned(dtype, shape)
        group = p.world_group() if i % 2 else None
        pending.append((p.broadcast(buf, src, group=group), buf, expected, f"{dtype}{list(shape)} from {src}"))
    for handle, buf, expected, label in pending:
        if handle is not None:
            try:
                handle.wait()
            except Exception as e:  # report which dtype/shape broke, not just the first error
                errors.append(f"broadcast {label}: wait() raised {type(e).__name__}: {e}")
                continue
        got = kit.bytes_of(buf)
        _expect(errors, got == expected, f"broadcast {label}: got {got[:16].hex()}..., want {expected[:16].hex()}...")

    if p.capabilities.subgroups:
        last = world - 1
        g = p.new_group((0, last))
        buf = kit.data(pattern("float32", (4,), 99), "float32", (4,), 99) if rank == last \
            else kit.poisoned("float32", (4,))
        if rank in (0, last):
            h = p.broadcast(buf, last, group=g)
            if h is not None:
                h.wait()
            want_b = kit.bytes_of(kit.data(pattern("float32", (4,), 99), "float32", (4,), 99))
        else:
            want_b = kit.bytes_of(kit.poisoned("float32", (4,)))
        _expect(errors, kit.bytes_of(buf) == want_b, f"group (0, {last}) broadcast on rank {rank}")
        p.destroy_group(g)
    else:
        _raises(errors, NotImplementedError, "new_group without subgroups", p.new_group, (0,),
                match=repr(p.name))
        _raises(errors, NotImplementedError, "new_group of the whole world without subgroups",
                p.new_group, tuple(range(world)), match=repr(p.name))
    _raises(errors, ValueError, "destroy_group(world)", p.destroy_group, p.world_group())
    _raises(errors, ValueError, "new_group unsorted", p.new_group, (1, 0))
    p.synchronize()
    return errors


def torch_cases(rank: int, world: int) -> list[str]:
    """torch specifics: non-contiguous and 0-dim receivers, a non-contiguous subgroup with
    non-members untouched, create/destroy/reuse of groups, float8 through the byte view."""
    import torch

    errors = collective_cases(rank, world, "torch")
    from dcp_platform import get_platform

    p = get_platform("torch")
    _expect(errors, "float8_e4m3fn" not in p.capabilities.native_dtypes,
            "gloo capabilities claim float8 is native")

    # Non-contiguous tensors: a transposed receiver, sent from a transposed source.
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 1.5
    recv = full.t().contiguous().t() if rank == 0 else torch.full((6, 4), float("nan")).t()
    h = p.broadcast(recv, 0)
    if h is not None:
        h.wait()
    _expect(errors, not recv.is_contiguous() and torch.equal(recv, full), f"transposed receiver got {recv}")
    strided_base = torch.full((10,), -1, dtype=torch.int64)
    strided = strided_base[::2]
    if rank == 0:
        strided.copy_(torch.tensor([1 << 40, -(1 << 41), 3, 4, 5]))
    h = p.broadcast(strided, 0)
    if h is not None:
        h.wait()
    _expect(errors, strided.tolist() == [1 << 40, -(1 << 41), 3, 4, 5], f"strided receiver {strided.tolist()}")
    _expect(errors, strided_base[1::2].tolist() == [-1] * 5, "strided broadcast wrote between the strides")

    # float8 goes through the byte view on gloo: a 0-dim and a non-contiguous one.
    f8 = torch.tensor([0.5, -2.0, 448.0, 0.0], dtype=torch.float8_e4m3fn)
    zero_d = torch.tensor(3.25).to(torch.float8_e4m3fn) if rank == 1 else torch.full((), 1.0).to(torch.float8_e4m3fn)
    h = p.broadcast(zero_d, 1)
    if h is not None:
        h.wait()
    _expect(errors, zero_d.float().item() == 3.25, f"0-dim float8 got {zero_d.float().item()}")
    f8_base = torch.zeros(8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    if rank == 0:
        f8_base[::2] = f8
    else:
        f8_base.view(torch.uint8).fill_(POISON)
    view = f8_base[::2]
    h = p.broadcast(view, 0)
    if h is not None:
        h.wait()
    _expect(errors, torch.equal(view.view(torch.uint8), f8.view(torch.uint8)), "strided float8 receiver")

    if world >= 4:
        # Subgroup (0, 3): members receive, non-members are not touched.
        g03 = p.new_group((0, 3))
        buf = torch.full((5,), 7.0, dtype=torch.bfloat16) if rank == 3 else torch.full((5,), float("nan"), dtype=torch.bfloat16)
        if rank in (0, 3):
            h = p.broadcast(buf, 3, group=g03)
            if h is not None:
                h.wait()
            _expect(errors, bool((buf == 7.0).all()), f"(0, 3) member {rank} got {buf}")
        else:
            _expect(errors, bool(buf.isnan().all()), f"non-member {rank} was written: {buf}")
        # Reuse the same group, then destroy it; a destroyed group must not work any more.
        x = torch.tensor([rank], dtype=torch.int64)
        if rank in (0, 3):
            h = p.broadcast(x, 0, group=g03)
            if h is not None:
                h.wait()
        _expect(errors, x.item() == (0 if rank in (0, 3) else rank), f"reused group: rank {rank} has {x.item()}")
        p.destroy_group(g03)
        if rank in (0, 3):
            _raises(errors, Exception, "broadcast on a destroyed group", p.broadcast, x, 0, g03)
        # Create again (same ranks) and a second group at once; both work.
        g03b, g12 = p.new_group((0, 3)), p.new_group((1, 2))
        y = torch.tensor([float(rank)])
        if rank in (0, 3):
            p.broadcast(y, 3, group=g03b).wait()
        else:
            p.broadcast(y, 1, group=g12).wait()
        _expect(errors, y.item() == (3.0 if rank in (0, 3) else 1.0), f"recreated groups: rank {rank} has {y.item()}")
        p.destroy_group(g12)
        p.destroy_group(g03b)
    return errors


def mindspore_cases(rank: int, world: int) -> list[str]:
    """MindSpore specifics on CPU: the world group only, queued broadcasts that are in
    memory only after wait()/synchronize(), int64/bf16 bit-exact, views refused."""
    errors = collective_cases(rank, world, "mindspore")
    import mindspore as ms
    from dcp_platform import get_platform

    p = get_platform("mindspore")
    caps = p.capabilities
    _expect(errors, caps.subgroups is False, f"capabilities.subgroups = {caps.subgroups} on CPU")
    _expect(errors, caps.native_dtypes == frozenset({"float32", "int32"}), f"native dtypes {caps.native_dtypes}")
    _raises(errors, NotImplementedError, "broadcast on another group", p.broadcast,
            ms.Tensor(np.zeros(2, np.float32)), 0, "some_group", match="'mindspore'")

    # int64 values that need all 64 bits, and bfloat16, arriving bit-exact.
    big = np.array([1 << 40, -(1 << 62) + 5, 3, (1 << 63) - 1], dtype=np.int64)
    arr = big.copy() if rank == 1 else np.full(4, -1, np.int64)
    t = ms.Tensor.from_numpy(arr)
    h = p.broadcast(t, 1)
    if h is not None:
        h.wait()
    _expect(errors, t.asnumpy().tolist() == big.tolist(), f"int64 got {t.asnumpy().tolist()}")
    bf_bytes = np.array([0x3F80, 0xC2F7, 0x0001, 0x7F7F], dtype=np.uint16)  # 1, -123.5, tiny, max
    bf_np = np.dtype(ms.dtype_to_nptype(ms.bfloat16))
    bf = ms.Tensor.from_numpy((bf_bytes if rank == 0 else np.full(4, 0x7FC0, np.uint16)).view(bf_np))
    h = p.broadcast(bf, 0)
    if h is not None:
        h.wait()
    _expect(errors, bf.asnumpy().view(np.uint16).tolist() == bf_bytes.tolist(), "bfloat16 bits differ")

    # On the CPU a broadcast is completed before broadcast() returns (None): the memory
    # itself holds the data, read through a NumPy alias that waits on nothing.
    n = 4 << 20  # 16 MiB: ~0.1 s on MindSpore's CPU transport, long enough to catch a race
    host = np.arange(n, dtype=np.int32) if rank == 0 else np.full(n, -7, np.int32)
    h = p.broadcast(ms.Tensor.from_numpy(host), 0)
    _expect(errors, h is None, f"CPU broadcast returned a handle {h!r}, not None (completed)")
    _expect(errors, int(host[-1]) == n - 1 and int(host[0]) == 0,
            f"after broadcast() returned, rank {rank} memory holds {host[0]}..{host[-1]}")

    # A receiving view cannot be written on the CPU: refused on every rank, before sending.
    base = ms.Tensor(np.zeros((4, 4), np.float32))
    if rank != 0:
        _raises(errors, ValueError, "broadcast into a view", p.broadcast, base[1:3], 0, match="view")
    p.synchronize()
    return errors


def fail_on_odd_ranks(rank: int, world: int) -> int:
    """For the harness tests: odd ranks raise before any collective."""
    if rank % 2:
        raise RuntimeError(f"rank {rank} refuses")
    return rank


def fail_on_odd_ranks_after_init(rank: int, world: int) -> int:
    """For the MindSpore launcher test: odd ranks raise, rank 0 then waits in a broadcast
    that never completes, so the launcher must kill it."""
    if rank % 2:
        raise RuntimeError(f"rank {rank} refuses")
    import mindspore as ms
    from dcp_platform import get_platform

    p = get_platform("mindspore")
    p.broadcast(ms.Tensor(np.zeros(4, np.int32)), 1)
    return rank


class _RunsCode:
    """Unpickling this would create the file ``path``: a gather that unpickled is caught."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def gather_refusal_cases(rank: int, world: int, marker: str) -> list[str]:
    """``all_gather_object`` between real ranks: a value rank 1 cannot encode, and a pickle
    sent in place of the codec's bytes (as a foreign peer would), each raise the same typed
    error naming rank 1 on every rank, run no code, and the next gather works."""
    import pickle

    from dcp_platform import codec, get_platform

    p = get_platform("torch")
    errors: list[str] = []
    _raises(errors, codec.UnsendableValueError, "unencodable value",
            lambda: p.all_gather_object(object() if rank == 1 else "fine"),
            match="rank 1 could not send its value: TypeError: a builtins.object")
    real = codec.pack_or_refusal
    if rank == 1:
        codec.pack_or_refusal = lambda obj: pickle.dumps(_RunsCode(marker))
    try:
        _raises(errors, codec.ValueMessageError, "a pickle from rank 1",
                lambda: p.all_gather_object(("plain", rank)), match="from rank 1 is not one dcp sent")
    finally:
        codec.pack_or_refusal = real
    import os

    _expect(errors, not os.path.exists(marker), "a pickle received from a peer ran code")
    gathered = p.all_gather_object({"after": (rank, [True, None, 2.5, b"x"])})
    _expect(errors, gathered == [{"after": (r, [True, None, 2.5, b"x"])} for r in range(world)],
            f"the gather after the refusals gave {gathered!r}")
    return errors
