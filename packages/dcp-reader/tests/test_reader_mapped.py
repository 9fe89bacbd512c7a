"""Short runs of strided boxes copied out of a memory map (``storage/_mapped.py``): equal
to safetensors' own slices for any box of any dtype (hypothesis), through the map when the
runs are short and through ``preadv`` when they are long; a file shorter than its header
says raises TruncatedFileError naming it (never SIGBUS). The path is opt-in
(``DCP_MAPPED_READS=1``, set for this module); without it nothing is mapped."""

from __future__ import annotations

import os

import numpy as np
import pytest
from dcp_reader import TruncatedFileError, open_checkpoint
from dcp_reader.formats import _safetensors_file
from dcp_reader.storage import _mapped
from dcp_reader.storage._mapped import MAPPED_RUN_MAX, map_runs
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _mapped_reads_on():
    old = os.environ.get("DCP_MAPPED_READS")
    os.environ["DCP_MAPPED_READS"] = "1"
    yield
    if old is None:
        del os.environ["DCP_MAPPED_READS"]
    else:
        os.environ["DCP_MAPPED_READS"] = old


def test_nothing_is_mapped_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("DCP_MAPPED_READS")
    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 64)
    out = bytearray(8 * 16)
    with open(p, "rb") as f:
        assert not map_runs(f.fileno(), out, 0, 0, 8 * 64, (8, 16), (64, 1), path=str(p), key="k")


@pytest.fixture
def mapped_calls(monkeypatch):
    calls = []

    def spy(*a, **k):
        done = _mapped.map_runs(*a, **k)
        calls.append(done)
        return done

    monkeypatch.setattr(_safetensors_file, "map_runs", spy)
    return calls


@st.composite
def _boxes(draw):
    ndim = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, shape, strict=True)]
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64,
                                  torch.int64]))
    return shape, tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)), dtype


@settings(max_examples=150, deadline=None)
@given(_boxes())
def test_any_box_equals_the_safetensors_slice(tmp_path_factory, box):
    shape, offsets, sizes, dtype = box
    root = tmp_path_factory.mktemp("ck")
    full = (torch.arange(int(np.prod(shape)), dtype=torch.float64) * 1.5 - 7).reshape(shape).to(dtype)
    safetensors_torch.save_file({"pad": torch.ones(3, dtype=torch.int8), "w": full}, str(root / "model.safetensors"))
    sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        want = f.get_slice("w")[sl]
    calls = []
    real = _safetensors_file.map_runs
    _safetensors_file.map_runs = lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    try:
        with open_checkpoint(str(root)) as reader:
            chunk = reader.metadata.tensors["w"].chunks[0]
            out = torch.full(sizes, 99, dtype=dtype)
            reader.read_into("w", chunk, offsets, sizes, out)
    finally:
        _safetensors_file.map_runs = real
    assert torch.equal(out, want)
    assert calls == ([] if full[sl].is_contiguous() else [True])  # a strided box of short runs went through the map


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 300), st.integers(0, 200), st.integers(0, 9000), st.integers(0, 7))
def test_map_runs_equals_the_runs_at_any_alignment(tmp_path_factory, run, count, gap, base, shift):
    data = np.random.default_rng(run * 31 + count).integers(0, 256, base + count * (run + gap), dtype=np.uint8)
    p = tmp_path_factory.mktemp("m") / "blob"
    p.write_bytes(data.tobytes())
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.zeros(count * run + shift, dtype=np.uint8)
        out = buf[shift:]  # destinations at any alignment
        hi = (count - 1) * (run + gap) + run
        assert map_runs(fd, out, base, 0, hi, (count, run), (run + gap, 1), path=str(p), key="k")
    finally:
        os.close(fd)
    want = np.concatenate([data[base + i * (run + gap):base + i * (run + gap) + run] for i in range(count)])
    assert bytes(out) == want.tobytes()


def test_long_runs_are_read_with_preadv(tmp_path, mapped_calls):
    cols = MAPPED_RUN_MAX // 2  # bf16: a half row of MAPPED_RUN_MAX bytes is short, a whole one long
    full = torch.arange(4 * 2 * cols, dtype=torch.float32).reshape(4, 2 * cols).to(torch.bfloat16)
    safetensors_torch.save_file({"w": full}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(str(tmp_path)) as reader:
        chunk = reader.metadata.tensors["w"].chunks[0]
        short = torch.empty(4, cols, dtype=torch.bfloat16)
        reader.read_into("w", chunk, (0, cols), (4, cols), short)
        assert mapped_calls == [True]
        long = torch.empty(2, 2 * cols - 1, dtype=torch.bfloat16)
        reader.read_into("w", chunk, (1, 1), (2, 2 * cols - 1), long)
        assert mapped_calls == [True, False]  # runs past MAPPED_RUN_MAX: scattered preadv
    assert torch.equal(short, full[:, cols:]) and torch.equal(long, full[1:3, 1:])


def test_a_file_shorter_than_its_header_says_names_the_file(tmp_path):
    # the size is checked before mapping: touching a mapped page past the end is SIGBUS
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": full}, str(path))
    with open_checkpoint(str(tmp_path)) as reader:
        chunk = reader.metadata.tensors["w"].chunks[0]
        reader.read_into("w", chunk, (0, 0), (1, 1), torch.empty(1, 1))  # the file is open, its header read
        os.truncate(path, os.path.getsize(path) - 4 * 32 * 8)  # the last 8 rows gone
        with pytest.raises(TruncatedFileError, match="model.safetensors") as err:
            reader.read_into("w", chunk, (0, 16), (64, 16), torch.empty(64, 16))
    assert err.value.key == "w" and "truncated" in str(err.value)
