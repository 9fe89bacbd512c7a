"""Reads go through preadv into memory the reader owns, never a memory map: a data file
truncated while the checkpoint is open gives TruncatedFileError instead of killing the
process with SIGBUS; ``read_into`` fills contiguous destinations directly and any other
destination through ``read``; every box of every dtype matches the saved tensor
(property-based)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, open_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _save(path, tensors):
    w = NativeWriter(path)
    w.write_file("a.safetensors", {f"{n}@{','.join('0' * len(t.shape))}" if t.dim() else f"{n}@": t
                                   for n, t in tensors.items()})
    w.commit(CheckpointMetadata(tensors={n: TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), (
        ChunkMeta((0,) * t.dim(), tuple(t.shape), "a.safetensors",
                  f"{n}@{','.join('0' * t.dim())}" if t.dim() else f"{n}@"),)) for n, t in tensors.items()},
        values={}, format="native"))


def test_file_truncated_while_open_is_an_error_not_sigbus(tmp_path):
    _save(tmp_path, {"w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)})
    script = textwrap.dedent(f"""
        import os, torch
        from dcp_reader import open_checkpoint, TruncatedFileError
        r = open_checkpoint({str(tmp_path)!r})
        c = r.metadata.tensors["w"].chunks[0]
        r.read("w", c, (0, 0), (1, 1))            # the file is open, its header checked
        os.truncate({str(tmp_path / "a.safetensors")!r}, 4096)
        dst = torch.empty(1024, 1024)
        try:
            dst.copy_(r.read("w", c, (0, 0), (1024, 1024)))
        except TruncatedFileError as e:
            print("typed:", e.key)
        try:
            r.read_into("w", c, (512, 0), (512, 1024), dst[512:])
        except TruncatedFileError as e:
            print("typed:", e.key)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7 is SIGBUS
    assert proc.stdout.split() == ["typed:", "w@0,0", "typed:", "w@0,0"]


def test_read_into_contiguous_and_strided_destinations(tmp_path):
    w = torch.randn(64, 48).to(torch.bfloat16)
    _save(tmp_path, {"w": w})
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        dst = torch.full((16, 48), float("nan"), dtype=torch.bfloat16)
        r.read_into("w", c, (8, 0), (16, 48), dst)
        assert torch.equal(dst, w[8:24])
        big = torch.full((64, 96), float("nan"), dtype=torch.bfloat16)
        r.read_into("w", c, (0, 8), (64, 40), big[:, 8:48])  # strided target, strided box
        assert torch.equal(big[:, 8:48], w[:, 8:48]) and big[:, :8].isnan().all()
        arr = np.zeros((4, 48), dtype=np.uint16)
        r.read_into("w", c, (0, 0), (4, 48), arr)
        assert np.array_equal(arr, w[:4].view(torch.uint16).numpy())
        assert r.bytes_read == (16 * 48 + 64 * 40 + 4 * 48) * 2
        with pytest.raises(ValueError, match="shape"):
            r.read_into("w", c, (0, 0), (4, 48), torch.empty(4, 47, dtype=torch.bfloat16))


DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.float8_e4m3fn]


@st.composite
def _cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    box = []
    for s in shape:
        lo = draw(st.integers(0, s))
        box.append((lo, draw(st.integers(0, s - lo))))
    return draw(st.sampled_from(DTYPES)), shape, box


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_every_box_matches(tmp_path_factory, case):
    dtype, shape, box = case
    t = (torch.randn(shape) * 8).to(dtype)
    path = tmp_path_factory.mktemp("ck")
    _save(path, {"t": t})
    offsets, sizes = tuple(b[0] for b in box), tuple(b[1] for b in box)
    want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    for verify in (True, False):
        with open_checkpoint(path, verify_checksums=verify) as r:
            c = r.metadata.tensors["t"].chunks[0]
            got = r.read("t", c, offsets, sizes)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(_bytes(got), _bytes(want))
            dst = torch.zeros(sizes, dtype=dtype)
            r.read_into("t", c, offsets, sizes, dst)
            assert torch.equal(_bytes(dst), _bytes(want))


def _bytes(t):
    return t.clone().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
