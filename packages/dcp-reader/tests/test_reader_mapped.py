"""Short runs of strided boxes copied out of a memory map (``storage/_mapped.py``): equal
to safetensors' own slices for any box of any dtype (hypothesis), through the map when the
runs are short and through ``preadv`` when they are long; a file shorter than its header
says raises TruncatedFileError naming it (never SIGBUS), also when it is cut between two
slabs of one copy. On a cold cache only the pages the runs lie on are fetched (measured by
``/proc/self/io`` read_bytes). The path is the default; ``DCP_MAPPED_READS=0`` turns it off."""

from __future__ import annotations

import mmap
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


@pytest.fixture(autouse=True)
def _mapped_reads_default(monkeypatch):
    monkeypatch.delenv("DCP_MAPPED_READS", raising=False)  # the default: mapped


@pytest.mark.parametrize(("value", "mapped"), [(None, True), ("1", True), ("0", False)])
def test_short_runs_are_mapped_unless_turned_off(tmp_path, monkeypatch, value, mapped):
    if value is not None:
        monkeypatch.setenv("DCP_MAPPED_READS", value)
    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 64)
    out = bytearray(8 * 16)
    with open(p, "rb") as f:
        assert map_runs(f.fileno(), out, 0, 0, 7 * 64 + 16, (8, 16), (64, 1), path=str(p), key="k") is mapped
    assert out == (b"".join(bytes(range(i * 64 % 256, i * 64 % 256 + 16)) for i in range(8)) if mapped
                   else bytearray(8 * 16))


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


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def _drop(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.fixture
def cold_fd(tmp_path):
    """A 32 MiB file of random bytes, open, on storage whose reads ``/proc/self/io`` counts
    (a cold 1 MiB ``pread`` registers at least 1 MiB; else skipped: tmpfs counts nothing)."""
    path = tmp_path / "blob"
    np.random.default_rng(7).integers(0, 256, 32 * 2**20, dtype=np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop(fd)
        before = _read_bytes()
        os.pread(fd, 2**20, 8 * 2**20)
        if _read_bytes() - before < 2**20:
            pytest.skip("this storage's reads are not counted in /proc/self/io read_bytes")
    except (OSError, RuntimeError, AttributeError):
        os.close(fd)
        pytest.skip("/proc/self/io read_bytes or posix_fadvise is not available here")
    yield fd, path
    os.close(fd)


def _cold_map(fd, path, base, count, run, stride):
    """``map_runs`` of ``count`` runs of ``run`` bytes ``stride`` apart from ``base`` on a cold
    cache: the bytes the kernel fetched, after checking the runs' values."""
    data = np.fromfile(path, dtype=np.uint8)
    _drop(fd)
    out = np.zeros(count * run, dtype=np.uint8)
    before = _read_bytes()
    assert map_runs(fd, out, base, 0, (count - 1) * stride + run, (count, run), (stride, 1), path=str(path), key="k")
    fetched = _read_bytes() - before
    want = np.lib.stride_tricks.as_strided(data[base:], (count, run), (stride, 1))
    assert np.array_equal(out.reshape(count, run), want)
    return fetched


@pytest.mark.parametrize("rows", [2048, 6144])
def test_a_cold_dense_box_fetches_only_the_pages_of_its_range(cold_fd, rows):
    # runs of 1 KiB, 2 KiB apart (a row-parallel half of a float32 (rows, 512) weight) in
    # the middle of the file: their 4 MiB range (12 MiB: two slabs), not the kernel's
    # read-ahead around it
    fd, path = cold_fd
    page = mmap.PAGESIZE
    base = 12 * 2**20 + 3 * page
    fetched = _cold_map(fd, path, base, rows, 1024, 2048)
    span = ((rows - 1) * 2048 + 1024 + page - 1) // page * page
    assert span <= fetched <= span + page, f"fetched {fetched} bytes for a {span}-byte range"


def test_a_cold_sparse_box_fetches_only_the_pages_its_runs_touch(cold_fd):
    # 64 runs of 64 B, 64 KiB apart: 64 pages, where the range spans 1,009 of them
    fd, path = cold_fd
    page = mmap.PAGESIZE
    fetched = _cold_map(fd, path, 5 * 2**20, 64, 64, 64 * 1024)
    assert fetched <= 64 * page, f"fetched {fetched} bytes for 64 runs of 64 B ({64 * page} bytes of pages)"


_CUT_BETWEEN_SLABS = """
import os, sys
import numpy as np
from dcp_reader import TruncatedFileError
from dcp_reader.storage import _mapped

path, rows = sys.argv[1], int(sys.argv[2])
checks = []

def cut_after_the_first_slab(address, offsets):
    checks.append(offsets)
    if len(checks) == 3:  # slabs 0 and 1 asked for before slab 0's copy; slab 2 after it
        os.truncate(path, _mapped.SLAB + 4096)
    return True

_mapped.resident = cut_after_the_first_slab
fd = os.open(path, os.O_RDONLY)
out = np.zeros(rows * 1024, dtype=np.uint8)
try:
    _mapped.map_runs(fd, out, 0, 0, (rows - 1) * 2048 + 1024, (rows, 1024), (2048, 1), path=path, key="w")
except TruncatedFileError as e:
    print("raised:", e)
"""


def test_a_file_cut_between_two_slabs_of_a_copy_names_the_file(tmp_path):
    # another process truncates the file while a box spanning three slabs is copied: the
    # next slab's size check raises (a page past the new end would be SIGBUS, killing the
    # process: so the copy runs in a child process)
    import subprocess
    import sys

    rows = 3 * _mapped.SLAB // 2048
    path = tmp_path / "model.bin"
    np.arange(rows * 2048 // 8, dtype=np.int64).tofile(path)
    done = subprocess.run([sys.executable, "-c", _CUT_BETWEEN_SLABS, str(path), str(rows)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"the copy died (rc {done.returncode}): {done.stderr[-2000:]}"
    assert "raised:" in done.stdout and "model.bin" in done.stdout and "'w'" in done.stdout, done.stdout
