"""framework="mindspore": MindSpore tensors (bf16 included) straight from the safetensors
bytes, never importing torch; NativeWriter taking MindSpore tensors; the data files it
writes load with mindspore.load_checkpoint(format="safetensors"). Needs MindSpore
(nox -s tests-mindspore, or /work/main/.venv-ms)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key, open_checkpoint

pytestmark = pytest.mark.mindspore


def _write(path):
    ms = pytest.importorskip("mindspore")
    from mindspore.common import np_dtype

    rng = np.random.default_rng(3)
    full = {
        "w": rng.standard_normal((6, 4)).astype(np.float32),
        "h": rng.standard_normal((4, 6)).astype(np_dtype.bfloat16),
        "i": np.arange(5, dtype=np.int32),
        "s": np.array(0.25, dtype=np.float32),
    }
    w = NativeWriter(path)
    w.write_file("rank-0.safetensors", {chunk_key("w", (0, 0)): ms.Tensor(full["w"][:3]),
                                        chunk_key("h", (0, 0)): full["h"][:, :3],
                                        chunk_key("s", ()): ms.Tensor(full["s"])})
    w.write_file("rank-1.safetensors", {chunk_key("w", (3, 0)): full["w"][3:],
                                        chunk_key("h", (0, 3)): ms.Tensor(full["h"][:, 3:]),
                                        chunk_key("i", (0,)): full["i"]})
    f0, f1 = "rank-0.safetensors", "rank-1.safetensors"
    w.commit(CheckpointMetadata(tensors={
        "w": TensorMeta("w", (6, 4), "float32", (ChunkMeta((0, 0), (3, 4), f0, "w@0,0"),
                                                 ChunkMeta((3, 0), (3, 4), f1, "w@3,0"))),
        "h": TensorMeta("h", (4, 6), "bfloat16", (ChunkMeta((0, 0), (4, 3), f0, "h@0,0"),
                                                  ChunkMeta((0, 3), (4, 3), f1, "h@0,3"))),
        "i": TensorMeta("i", (5,), "int32", (ChunkMeta((0,), (5,), f1, "i@0"),)),
        "s": TensorMeta("s", (), "float32", (ChunkMeta((), (), f0, "s@"),)),
    }, values={}, format="native"))
    return full


def test_mindspore_tensors_bf16_included(tmp_path):
    ms = pytest.importorskip("mindspore")
    full = _write(tmp_path)
    with open_checkpoint(tmp_path) as r:
        for name, t in r.metadata.tensors.items():
            for c in t.chunks:
                # a box strictly inside the chunk where it has room, else the whole chunk
                offs = tuple(o + (1 if s > 2 else 0) for o, s in zip(c.offsets, c.sizes, strict=True))
                sizes = tuple(s - (2 if s > 2 else 0) for s in c.sizes)
                out = r.read(name, c, offs, sizes, framework="mindspore")
                assert isinstance(out, ms.Tensor)
                want = full[name][tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
                got = out.asnumpy()
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert got.tobytes() == np.ascontiguousarray(want).tobytes(), name
        assert str(r.read("h", r.metadata.tensors["h"].chunks[0], (0, 0), (1, 1),
                          framework="mindspore").dtype) == "BFloat16"


def test_data_files_load_in_mindspore(tmp_path):
    ms = pytest.importorskip("mindspore")
    full = _write(tmp_path)
    params = ms.load_checkpoint(str(tmp_path / "rank-1.safetensors"), format="safetensors")
    assert np.array_equal(params["w@3,0"].asnumpy(), full["w"][3:])
    assert np.array_equal(params["i@0"].asnumpy(), full["i"])


def test_mindspore_path_never_imports_torch(tmp_path):
    pytest.importorskip("mindspore")
    _write(tmp_path)
    code = (
        "import sys, dcp_reader\n"
        f"r = dcp_reader.open_checkpoint({str(tmp_path)!r})\n"
        "for n, t in r.metadata.tensors.items():\n"
        "    for c in t.chunks:\n"
        "        r.read(n, c, c.offsets, c.sizes, framework='mindspore')\n"
        "r.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
