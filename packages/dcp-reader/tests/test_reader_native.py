"""The native format end to end: NativeWriter (torch tensors, numpy arrays, several chunks
of one tensor in one file, JSON values, opt-in pickled values, atomic commit last), then
open_checkpoint/read with framework torch and numpy (bf16 and float8 as raw bits), the LRU
of open files, no stat per read, bytes_read, and a numpy read that never imports torch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from dcp_reader import (
    METADATA_FILE,
    CheckpointMetadata,
    ChunkMeta,
    MissingFileError,
    MissingMetadataError,
    NativeWriter,
    TensorMeta,
    UnsafePickleError,
    chunk_key,
    detect_format,
    open_checkpoint,
)


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(6, 4, generator=g),
        "cols": torch.randn(3, 8, generator=g).to(torch.bfloat16),
        "f8": torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn),
        "ids": torch.arange(10, dtype=torch.int64),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }


# (file, tensor name, offsets, sizes): rank 1 holds two chunks of "cols" in one file
_LAYOUT = [
    ("rank-0.safetensors", "rows", (0, 0), (3, 4)),
    ("rank-1.safetensors", "rows", (3, 0), (3, 4)),
    ("rank-0.safetensors", "cols", (0, 0), (3, 4)),
    ("rank-1.safetensors", "cols", (0, 4), (3, 2)),
    ("rank-1.safetensors", "cols", (0, 6), (3, 2)),
    ("rank-0.safetensors", "f8", (0, 0), (4, 2)),
    ("rank-0.safetensors", "ids", (0,), (10,)),
    ("rank-1.safetensors", "mask", (0,), (5,)),
    ("rank-0.safetensors", "scalar", (), ()),
    ("rank-1.safetensors", "empty", (0, 0), (0, 3)),
]


def _box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def write_native(path, full=None, *, values=None, allow_pickle=False, commit=True) -> CheckpointMetadata:
    full = full or _full()
    w = NativeWriter(path, allow_pickle=allow_pickle)
    per_file: dict[str, dict] = {}
    chunks: dict[str, list[ChunkMeta]] = {}
    for file, name, offs, sizes in _LAYOUT:
        key = chunk_key(name, offs)
        per_file.setdefault(file, {})[key] = _box(full[name], offs, sizes)
        chunks.setdefault(name, []).append(ChunkMeta(offs, sizes, file, key))
    for file, tensors in per_file.items():  # what each rank does
        w.write_file(file, tensors)
    vmeta = w.write_values(values or {})
    meta = CheckpointMetadata(
        tensors={n: TensorMeta(n, tuple(full[n].shape), str(full[n].dtype)[6:], tuple(cs))
                 for n, cs in chunks.items()},
        values=vmeta, format="native")
    if commit:
        w.commit(meta)
    return meta


def test_round_trip_torch(tmp_path):
    full = _full()
    write_native(tmp_path, full, values={"step": 3, "cfg": {"lr": 0.5, "names": ["a"]}})
    assert detect_format(tmp_path) == "native"
    with open_checkpoint(tmp_path) as r:
        assert r.format == "native" and set(r.metadata.tensors) == set(full)
        for name, t in r.metadata.tensors.items():
            out = torch.full(t.shape, 7, dtype=full[name].dtype) if full[name].dtype != torch.bool \
                else torch.zeros(t.shape, dtype=torch.bool)
            for c in t.chunks:
                _box(out, c.offsets, c.sizes).copy_(r.read(name, c, c.offsets, c.sizes))
            assert torch.equal(out.reshape(-1).view(torch.uint8), full[name].reshape(-1).view(torch.uint8)), name
        assert r.read_value("step") == 3 and r.read_value("cfg") == {"lr": 0.5, "names": ["a"]}
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    # the data files are standard safetensors: safetensors itself reads them
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "rank-1.safetensors"))
    assert torch.equal(sd[chunk_key("cols", (0, 6))], full["cols"][:, 6:8])
    assert torch.equal(sd[chunk_key("mask", (0,))], full["mask"])


def test_narrowed_read_and_bytes_read(tmp_path):
    full = _full()
    write_native(tmp_path, full)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["cols"].chunks[2]  # offsets (0, 6), sizes (3, 2)
        out = r.read("cols", c, (1, 7), (2, 1))
        assert torch.equal(out, full["cols"][1:3, 7:8])
        assert r.bytes_read == 2 * 1 * 2
        s = r.metadata.tensors["scalar"].chunks[0]
        assert r.read("scalar", s, (), ()).item() == 1.5
        assert r.bytes_read == 4 + 8
        with pytest.raises(ValueError, match="not inside the chunk"):
            r.read("cols", c, (0, 5), (1, 1))


def test_numpy_framework_including_bf16_and_float8_bits(tmp_path):
    full = _full()
    write_native(tmp_path, full)
    with open_checkpoint(tmp_path) as r:
        rows = r.metadata.tensors["rows"].chunks[1]
        a = r.read("rows", rows, (4, 1), (2, 3), framework="numpy")
        assert isinstance(a, np.ndarray) and np.array_equal(a, full["rows"][4:6, 1:4].numpy())
        cols = r.metadata.tensors["cols"].chunks[0]
        b = r.read("cols", cols, (0, 1), (3, 2), framework="numpy")
        assert b.dtype.itemsize == 2
        assert np.array_equal(b.view(np.uint16), full["cols"][:, 1:3].view(torch.int16).numpy().view(np.uint16))
        f8 = r.metadata.tensors["f8"].chunks[0]
        c = r.read("f8", f8, (1, 0), (2, 2), framework="numpy")
        assert np.array_equal(c.view(np.uint8), full["f8"][1:3].view(torch.uint8).numpy())
        s = r.metadata.tensors["scalar"].chunks[0]
        assert r.read("scalar", s, (), (), framework="numpy") == 1.5
        e = r.metadata.tensors["empty"].chunks[0]
        assert r.read("empty", e, (0, 1), (0, 2), framework="numpy").shape == (0, 2)
        m = r.metadata.tensors["mask"].chunks[0]
        assert np.array_equal(r.read("mask", m, (0,), (5,), framework="numpy"), full["mask"].numpy())


def test_numpy_arrays_as_input(tmp_path):
    arrays = {"a@0": np.arange(12, dtype=np.int8).reshape(3, 4), "b@": np.array(2.0, dtype=np.float32)}
    w = NativeWriter(tmp_path)
    w.write_file("data.safetensors", arrays)
    w.commit(CheckpointMetadata(tensors={
        "a": TensorMeta("a", (3, 4), "int8", (ChunkMeta((0, 0), (3, 4), "data.safetensors", "a@0"),)),
        "b": TensorMeta("b", (), "float32", (ChunkMeta((), (), "data.safetensors", "b@"),)),
    }, values={}, format="native"))
    with open_checkpoint(tmp_path) as r:
        a = r.metadata.tensors["a"].chunks[0]
        assert torch.equal(r.read("a", a, (1, 1), (2, 2)), torch.tensor([[5, 6], [9, 10]], dtype=torch.int8))
        assert r.read("b", r.metadata.tensors["b"].chunks[0], (), (), framework="numpy") == 2.0


class _Opaque:  # a value JSON cannot hold
    def __eq__(self, other):
        return isinstance(other, _Opaque)


def test_pickle_only_when_opted_in_on_save_and_load(tmp_path):
    with pytest.raises(TypeError, match="'opt'.*allow_pickle=True"):
        NativeWriter(tmp_path / "a").write_values({"opt": _Opaque(), "ok": 1})
    write_native(tmp_path / "b", values={"opt": _Opaque(), "step": 4, "betas": (0.9, 0.99)}, allow_pickle=True)
    with open_checkpoint(tmp_path / "b") as r:
        assert r.metadata.values["opt"].file == "values.pkl"
        assert r.metadata.values["betas"].file is None  # tuples are stored as tagged JSON
        assert r.read_value("step") == 4 and r.read_value("betas") == (0.9, 0.99)
        with pytest.raises(UnsafePickleError, match="'opt'.*allow_pickle=True"):
            r.read_value("opt")
    with open_checkpoint(tmp_path / "b", allow_pickle=True) as r:
        assert r.read_value("opt") == _Opaque()


def test_uncommitted_save_is_reported_incomplete(tmp_path):
    write_native(tmp_path, commit=False)
    with pytest.raises(MissingMetadataError, match="incomplete native checkpoint") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == METADATA_FILE
    with pytest.raises(MissingMetadataError, match="incomplete native checkpoint"):
        open_checkpoint(tmp_path, format="native")


def test_commit_checks_files_and_invalidate_removes_metadata(tmp_path):
    meta = write_native(tmp_path)
    os.unlink(tmp_path / "rank-1.safetensors")
    with pytest.raises(MissingFileError, match="rank-1.safetensors") as ei:
        NativeWriter(tmp_path).commit(meta)
    assert ei.value.offenders == ("rank-1.safetensors",)
    with pytest.raises(ValueError, match="'native'"):
        NativeWriter(tmp_path).commit(CheckpointMetadata(tensors={}, values={}, format="hf"))
    NativeWriter(tmp_path).invalidate()
    assert not (tmp_path / METADATA_FILE).exists()


def test_lru_bounds_open_files_and_reads_do_not_stat(tmp_path, monkeypatch):
    full = {f"t{i}": torch.full((4,), float(i)) for i in range(4)}
    w = NativeWriter(tmp_path)
    for i in range(4):
        w.write_file(f"f{i}.safetensors", {f"t{i}@0": full[f"t{i}"]})
    w.commit(CheckpointMetadata(tensors={
        f"t{i}": TensorMeta(f"t{i}", (4,), "float32", (ChunkMeta((0,), (4,), f"f{i}.safetensors", f"t{i}@0"),))
        for i in range(4)}, values={}, format="native"))
    with open_checkpoint(tmp_path, max_open_files=2) as r:
        evicted = r.read("t1", r.metadata.tensors["t1"].chunks[0], (0,), (4,), framework="numpy")
        for i in [0, 1, 2, 3, 0]:
            c = r.metadata.tensors[f"t{i}"].chunks[0]
            assert r.read(f"t{i}", c, (1,), (2,))[0].item() == i
            assert len(r._files) <= 2
        calls = []
        for fn in ("stat", "lstat", "fstat"):
            real = getattr(os, fn)
            monkeypatch.setattr(os, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
        c = r.metadata.tensors["t0"].chunks[0]
        for _ in range(50):
            r.read("t0", c, (0,), (4,))
            r.read("t0", c, (0,), (4,), framework="numpy")
        assert calls == []
        monkeypatch.undo()
        kept = r.read("t3", r.metadata.tensors["t3"].chunks[0], (0,), (4,))
        kept_np = r.read("t2", r.metadata.tensors["t2"].chunks[0], (0,), (4,), framework="numpy")
    assert r._files == {}
    # views handed out stay valid after their file was evicted or the reader closed
    assert kept.sum().item() == 12 and kept_np.sum() == 8 and evicted.sum() == 4


def test_numpy_reads_do_not_import_torch_or_mindspore(tmp_path):
    write_native(tmp_path)
    code = (
        "import sys, numpy as np, dcp_reader\n"
        f"r = dcp_reader.open_checkpoint({str(tmp_path)!r})\n"
        "for n, t in r.metadata.tensors.items():\n"
        "    for c in t.chunks:\n"
        "        r.read(n, c, c.offsets, c.sizes, framework='numpy')\n"
        "r.close()\n"
        "assert 'torch' not in sys.modules and 'mindspore' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
