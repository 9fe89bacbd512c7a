"""Scattering reads of strided boxes (``_scatter.pread_runs``) straight into the caller's
buffer: equal to slicing the saved tensor for any box of any shape (hypothesis), across
call boundaries (more runs than one ``preadv`` takes, gaps wider than the scratch), and a
file truncated under the reader gives TruncatedFileError naming the file."""

from __future__ import annotations

import os

import numpy as np
import pytest
from dcp_reader import TruncatedFileError, open_checkpoint
from dcp_reader.storage._scatter import _IOV_MAX, MAX_GAP, pread_runs
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _file(tmp_path, data: bytes):
    p = tmp_path / "blob"
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY), str(p)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 3 * _IOV_MAX), st.integers(0, 2 * MAX_GAP), st.integers(0, 100))
def test_runs_land_in_order(tmp_path_factory, run, count, gap, base):
    data = np.random.default_rng(run * 7 + count).integers(0, 256, base + count * (run + gap), dtype=np.uint8)
    fd, path = _file(tmp_path_factory.mktemp("s"), data.tobytes())
    try:
        out = bytearray(count * run)
        offsets = range(0, count * (run + gap), run + gap)
        pread_runs(fd, out, base, offsets, run, path=path, key="k")
        want = b"".join(data[base + o:base + o + run].tobytes() for o in offsets)
        assert bytes(out) == want
    finally:
        os.close(fd)


def test_truncated_file_names_it(tmp_path):
    fd, path = _file(tmp_path, bytes(range(256)) * 4)
    try:
        with pytest.raises(TruncatedFileError, match="blob"):
            pread_runs(fd, bytearray(80), 0, range(0, 2000, 100), 4, path=path, key="w")
    finally:
        os.close(fd)


@st.composite
def _boxes(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, shape, strict=True)]
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float64]))
    return shape, tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)), dtype


@settings(max_examples=150, deadline=None)
@given(_boxes())
def test_read_into_any_box_equals_the_slice(tmp_path_factory, box):
    shape, offsets, sizes, dtype = box
    root = tmp_path_factory.mktemp("ck")
    full = (torch.arange(int(np.prod(shape)), dtype=torch.float64) * 1.5 - 7).reshape(shape).to(dtype)
    safetensors_torch.save_file({"w": full}, str(root / "model.safetensors"))
    with open_checkpoint(str(root)) as reader:
        chunk = reader.metadata.tensors["w"].chunks[0]
        out = torch.full(sizes, 99, dtype=dtype)
        reader.read_into("w", chunk, offsets, sizes, out)
    assert torch.equal(out, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])


def test_rows_one_stride_apart_are_read_natively(tmp_path, monkeypatch):
    # Rows of a 2-D box (a range of offsets, gaps within MAX_GAP): iovecs built by NumPy, no
    # Python call per run; equal to the slices. Offsets that are no range go the portable way.
    from dcp_reader.storage import _scatter

    data = np.random.default_rng(3).integers(0, 256, 4096 * 96, dtype=np.uint8)
    fd, path = _file(tmp_path, data.tobytes())
    calls = []
    monkeypatch.setattr(_scatter, "_read_group", lambda *a, **k: calls.append(a) or 0)
    try:
        out = bytearray(4096 * 32)
        offsets = range(16, 4096 * 96, 96)
        pread_runs(fd, out, 0, offsets, 32, path=path, key="k")
        assert not calls
        assert bytes(out) == b"".join(data[o:o + 32].tobytes() for o in offsets)
        with pytest.raises(ValueError):  # the portable path ran (and, stubbed, filled nothing)
            pread_runs(fd, bytearray(64), 0, iter([0, 96]), 32, path=path, key="k")
        assert calls
    finally:
        os.close(fd)
