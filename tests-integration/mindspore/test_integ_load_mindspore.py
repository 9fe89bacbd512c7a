"""dcp_load.load into MindSpore tensors (``Chunk``-annotated) on 2 real MindSpore CPU
workers, from a native checkpoint that torch saved: replicated tensors are read once and
broadcast on the world group (MindSpore's CPU collectives have no subgroups), hand-sharded
and straddling boxes are read locally, targets are poisoned first. Also a real ``nn.Cell``'s
``parameters_dict()`` (MindSpore ``Parameter`` objects) saved and loaded on the workers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore

sys.path.insert(0, str(Path(__file__).parent))


def test_mindspore_state_dict_loads_from_a_torch_saved_checkpoint(tmp_path):
    pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    torch = pytest.importorskip("torch", reason="the checkpoint is saved with torch")
    import dcp_load
    import integ_load_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers

    state, expected = {}, {}
    for i, (name, (shape, dtype, _)) in enumerate(cases.SPECS.items()):
        values = (torch.arange(int(np.prod(shape)), dtype=torch.float32) * (i + 1) % 97).reshape(shape)
        state[name] = values.to(getattr(torch, dtype))
        expected[name] = values.to(torch.float64).numpy()
    # saved as 3 row chunks (2 for small tensors), so the workers' boxes reshard
    saved = {}
    for name, t in state.items():
        if t.dim() == 0:
            saved[name] = t
            continue
        rows = 3 if t.shape[0] >= 6 else 1
        for k, piece in enumerate(torch.tensor_split(t, rows, dim=0)):
            off = sum(p.shape[0] for p in torch.tensor_split(t, rows, dim=0)[:k])
            saved.setdefault(name, []).append(dcp_load.Chunk(piece.clone(), tuple(t.shape), (off, 0)))
    path = tmp_path / "ckpt"
    _save_chunks(saved, path)
    results = run_mindspore_workers(cases.ms_load_case, 2, str(path), expected, timeout=300)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    reports = [r["report"] for r in results]
    assert all(r["world_size"] == 2 for r in reports)
    assert all(r["broadcasts"] > 0 and r["bytes_received"] > 0 for r in reports)
    # Replicated tensors are read once, also "w.rep", saved in 3 row chunks: its pieces are
    # sub-boxes, which MindSpore receives through staging tensors (no views on the CPU).
    assert sum(r["bytes_read"] for r in reports) == reports[0]["job_unique_bytes"]


def _save_chunks(saved: dict, path: Path) -> None:
    """Save several Chunks per name: one no_dist save per chunk index would overwrite, so
    lay the chunks out as the state dicts of separate 'ranks' through the native writer."""
    from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, ValueMeta, chunk_key

    writer = NativeWriter(str(path))
    tensors, files = {}, {}
    for name, value in saved.items():
        chunks = value if isinstance(value, list) else [dcp_load_chunk(value)]
        metas = []
        for k, c in enumerate(chunks):
            file = f"part-{k}.safetensors"
            key = chunk_key(name, c.offsets)
            files.setdefault(file, {})[key] = c.tensor
            metas.append(ChunkMeta(c.offsets, tuple(c.tensor.shape), file, key))
        first = chunks[0].tensor
        tensors[name] = TensorMeta(name, chunks[0].global_shape, str(first.dtype).removeprefix("torch."), tuple(metas))
    for file, data in files.items():
        writer.write_file(file, data)
    writer.commit(CheckpointMetadata(tensors=tensors, values={"meta.step": ValueMeta("meta.step", 11)},
                                     format="native"))


def dcp_load_chunk(t):
    import dcp_load

    return dcp_load.Chunk(t, tuple(t.shape), (0,) * t.dim())


def test_a_mindspore_cell_parameters_dict_saves_and_loads(tmp_path):
    pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    import integ_load_ms_cases as cases
    from dcp_platform.testing import run_mindspore_workers

    results = run_mindspore_workers(cases.ms_net_case, 2, str(tmp_path / "net"), timeout=300)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    assert results[0]["types"] == ["abc.Parameter"]  # the type whose module name misled the old check
    assert [r["tensors"] for r in results] == [4, 4]
