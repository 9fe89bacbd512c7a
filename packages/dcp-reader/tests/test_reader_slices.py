"""Narrowed reads equal the same slice of the full tensor, for random chunkings and random
boxes inside a chunk (hypothesis), through framework torch and numpy, on native files
(several chunks per file) and on a Hugging Face file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key, open_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.float8_e5m2, torch.bool]
SHAPE = (7, 5, 3)
# split points per dim: chunk grid 2 x 2 x 1 written into 3 files
SPLITS = ((0, 3, 7), (0, 2, 5), (0, 3))


def _full(dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    t = torch.randn(SHAPE, generator=g) * 8
    return (t > 0) if dtype == torch.bool else t.to(dtype)


def _bits(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        t = np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    return t


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = tmp_path_factory.mktemp("native")
    w = NativeWriter(path)
    tensors, files = {}, {}
    for dt in DTYPES:
        name = str(dt)[6:]
        full = _full(dt)
        chunks = []
        i = 0
        for a0, a1 in zip(SPLITS[0], SPLITS[0][1:], strict=False):
            for b0, b1 in zip(SPLITS[1], SPLITS[1][1:], strict=False):
                offs, sizes = (a0, b0, 0), (a1 - a0, b1 - b0, 3)
                f = f"rank-{i % 3}.safetensors"
                i += 1
                key = chunk_key(name, offs)
                files.setdefault(f, {})[key] = full[a0:a1, b0:b1].clone()
                chunks.append(ChunkMeta(offs, sizes, f, key))
        tensors[name] = TensorMeta(name, SHAPE, name, tuple(chunks))
    for f, d in files.items():
        w.write_file(f, d)
    w.commit(CheckpointMetadata(tensors=tensors, values={}, format="native"))
    with open_checkpoint(path) as r:
        yield r


@st.composite
def boxes(draw):
    dt = draw(st.sampled_from(DTYPES))
    ci = draw(st.integers(0, 3))
    fw = draw(st.sampled_from(["torch", "numpy"]))
    return dt, ci, fw, draw(st.randoms(use_true_random=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=boxes())
def test_native_box_equals_slice_of_full(native, case):
    dt, ci, fw, rnd = case
    name = str(dt)[6:]
    c = native.metadata.tensors[name].chunks[ci]
    offs, sizes = [], []
    for co, cs in zip(c.offsets, c.sizes, strict=True):
        lo = rnd.randint(co, co + cs)
        hi = rnd.randint(lo, co + cs)
        offs.append(lo)
        sizes.append(hi - lo)
    before = native.bytes_read
    out = native.read(name, c, tuple(offs), tuple(sizes), framework=fw)
    want = _full(dt)[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
    assert tuple(out.shape) == tuple(sizes)
    assert np.array_equal(_bits(out), _bits(want))
    assert native.bytes_read - before == want.numel() * want.element_size()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_file({str(dt)[6:]: _full(dt) for dt in DTYPES}, str(path / "model.safetensors"))
    with open_checkpoint(path) as r:
        yield r


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dt=st.sampled_from(DTYPES), fw=st.sampled_from(["torch", "numpy"]),
       box=st.tuples(*[st.tuples(st.integers(0, n), st.integers(0, n)) for n in SHAPE]))
def test_hf_box_equals_slice_of_full(hf, dt, fw, box):
    name = str(dt)[6:]
    c = hf.metadata.tensors[name].chunks[0]
    offs = tuple(min(a, b) for a, b in box)
    sizes = tuple(abs(a - b) for a, b in box)
    out = hf.read(name, c, offs, sizes, framework=fw)
    want = _full(dt)[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
    assert np.array_equal(_bits(out), _bits(want))
