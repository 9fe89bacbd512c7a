"""Every Platform method in one process, parametrized over the torch and MindSpore backends
(the collectives are in test_platform_torch_ranks.py / test_platform_mindspore.py, Ascend
in test_platform_ascend.py).

Covered: the non-distributed answers (rank 0 of 1, all_gather_object, no world group),
neutral dtype names both ways, as_bytes/from_bytes as aliases that round-trip every dtype
and shape (0-dim included) and refuse what they cannot alias, fused_copy against a
pair-by-pair copy into poisoned destinations, empty, nbytes, capabilities, synchronize.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from dcp_platform import Capabilities, get_platform

sys.path.insert(0, str(Path(__file__).parent))
import platform_rank_cases as cases  # noqa: E402

BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("mindspore", id="mindspore", marks=pytest.mark.mindspore)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    try:
        kit = cases.KITS[request.param]()
    except ImportError as e:
        pytest.skip(f"{request.param} is not installed here: {e}")
    return get_platform(request.param), kit


CASES = [(d, s) for d in cases.DTYPES for s in cases.SHAPES]


def test_not_distributed_in_a_plain_process(backend):
    p, _ = backend
    assert (p.rank(), p.world_size(), p.is_distributed()) == (0, 1, False)
    assert p.all_gather_object({"x": [1, 2]}) == [{"x": [1, 2]}]
    with pytest.raises(RuntimeError, match=repr(p.name)):
        p.world_group()


def test_dtype_names_both_ways(backend):
    p, kit = backend
    for name in cases.DTYPES:
        dtype = p.dtype_from_name(name)
        assert dtype == kit.dtype(name)
        assert p.dtype_name(dtype) == name
    with pytest.raises(ValueError, match="float7"):
        p.dtype_from_name("float7")


def test_capabilities_are_frozen_and_named(backend):
    p, _ = backend
    caps = p.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.device_type == "cpu" and caps.host_collectives is True
    assert {"float32", "int32"} <= caps.native_dtypes
    assert "float8_e4m3fn" not in caps.native_dtypes  # neither gloo nor MindSpore-CPU sends it
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.subgroups = True


@pytest.mark.parametrize("dtype,shape", CASES, ids=[f"{d}-{list(s)}" for d, s in CASES])
def test_as_bytes_and_from_bytes_alias_and_round_trip(backend, dtype, shape):
    p, kit = backend
    raw = cases.pattern(dtype, shape, seed=7)
    t = kit.data(raw, dtype, shape, 7)
    want = kit.bytes_of(t)
    b = p.as_bytes(t)
    assert tuple(b.shape) == (len(want),) and p.dtype_name(b.dtype) == "uint8"
    assert kit.bytes_of(b) == want
    kit.set_byte(b, 0, cases.POISON)  # a write through the bytes is a write to the tensor
    assert kit.bytes_of(t)[0] == cases.POISON
    if p.name == "mindspore" and dtype.startswith("float8"):
        with pytest.raises(TypeError, match="float8"):
            p.from_bytes(b, p.dtype_from_name(dtype), shape)
        return
    back = p.from_bytes(b, p.dtype_from_name(dtype), shape)
    assert tuple(back.shape) == shape and p.dtype_name(back.dtype) == dtype
    assert kit.bytes_of(back) == kit.bytes_of(t)
    if len(want) > 1:
        kit.set_byte(b, len(want) - 1, 0x01)  # and the view from bytes shares them too
        assert kit.bytes_of(back)[-1] == 0x01


def test_as_bytes_refuses_non_contiguous_and_from_bytes_non_uint8(backend):
    p, kit = backend
    _, view = kit.transposed_view(3, 4, "float32")
    with pytest.raises(ValueError, match="contiguous"):
        p.as_bytes(view)
    with pytest.raises(ValueError, match="uint8"):
        p.from_bytes(kit.poisoned("float32", (4,)), p.dtype_from_name("int32"), (4,))


def test_fused_copy_equals_pair_by_pair_copy(backend):
    p, kit = backend
    srcs = [kit.data(cases.pattern(d, s, seed=i), d, s, i) for i, (d, s) in enumerate(CASES)]
    pairwise = [kit.poisoned(d, s) for d, s in CASES]
    for dst, src in zip(pairwise, srcs, strict=True):
        kit.copy(dst, src)
    fused = [kit.poisoned(d, s) for d, s in CASES]
    p.fused_copy(fused, srcs)
    for (d, s), a, b in zip(CASES, fused, pairwise, strict=True):
        assert kit.bytes_of(a) == kit.bytes_of(b), f"{d}{list(s)}"
    p.fused_copy([], [])
    with pytest.raises(ValueError, match="2 destinations but 1 sources"):
        p.fused_copy(fused[:2], srcs[:1])


def test_fused_copy_into_a_transposed_view(backend):
    p, kit = backend
    base, view = kit.transposed_view(3, 4, "float32")
    src = kit.data(cases.pattern("float32", (3, 4), 3), "float32", (3, 4), 3)
    if p.name == "mindspore":
        # MindSpore's CPU in-place ops do not write through views: refused, never silent.
        with pytest.raises(ValueError, match="view"):
            p.fused_copy([view], [src])
        return
    p.fused_copy([view], [src])
    assert kit.bytes_of(view) == kit.bytes_of(src)
    assert kit.bytes_of(base) == kit.bytes_of(src.t())


@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_empty_and_nbytes(backend, shape):
    p, _ = backend
    for name in ("float32", "bfloat16", "int64", "bool"):
        t = p.empty(shape, p.dtype_from_name(name))
        assert tuple(t.shape) == shape and p.dtype_name(t.dtype) == name
        assert p.nbytes(t) == math.prod(shape) * cases.ITEMSIZE[name]


def test_synchronize_waits_for_queued_work(backend):
    p, kit = backend
    n = 1 << 24  # 64 MiB: a copy still queued when a no-op synchronize returns
    src = kit.data(np.arange(n, dtype=np.int32).view(np.uint8), "int32", (n,), 0)
    dst = kit.poisoned("int32", (n,))
    memory = kit.queue_copy(dst, src)
    p.synchronize()
    assert int(memory[-1]) == n - 1 and int(memory[n // 2]) == n // 2
