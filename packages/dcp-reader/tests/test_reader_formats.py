"""Round trips of the formats other tools write, each written by its own tool in the test:
Hugging Face safetensors (one file; index + shards) by safetensors, and
torch.distributed.checkpoint's default format and its HuggingFaceStorageWriter (rank-0,
sharded one file per rank, consolidated) by torch.distributed.checkpoint: single-process
(no_dist=True) and a 2-rank DTensor save on real gloo ranks (one launch for the module)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_platform.testing import run_ranks
from dcp_reader import detect_format, open_checkpoint
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import reader_rank_savers as savers  # noqa: E402


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(10, 6, generator=g),
        "layer.0.w": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(6, generator=g).to(torch.float16),
        "q": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "count": torch.tensor(3, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
    }


def _assemble(r, name: str, framework: str = "torch") -> torch.Tensor:
    """The whole tensor from its chunks, into a poisoned target."""
    t = r.metadata.tensors[name]
    dt = getattr(torch, t.dtype)
    out = torch.zeros(t.shape, dtype=dt) if dt == torch.bool else torch.full(t.shape, 77, dtype=dt)
    for c in t.chunks:
        part = r.read(name, c, c.offsets, c.sizes, framework=framework)
        if framework == "numpy":
            part = torch.from_numpy(np.array(part)).view(dt)
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = part
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _check_all(path, expected: dict[str, torch.Tensor], fmt: str) -> None:
    assert detect_format(path) == fmt
    with open_checkpoint(path) as r:
        assert r.format == fmt
        assert set(r.metadata.tensors) == set(expected)
        for name, want in expected.items():
            assert _same(_assemble(r, name), want), name
            assert _same(_assemble(r, name, "numpy"), want), name


def test_hf_single_file(tmp_path):
    sd = _state()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _check_all(tmp_path, sd, "hf")


def test_hf_index_and_shards(tmp_path):
    sd = _state()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    _check_all(tmp_path, sd, "hf")
    with open_checkpoint(tmp_path, format="hf") as r:  # explicit format, narrowed read
        c = r.metadata.tensors["embed.weight"].chunks[0]
        assert torch.equal(r.read("embed.weight", c, (2, 1), (5, 3)), sd["embed.weight"][2:7, 1:4])
        assert r.bytes_read == 5 * 3 * 4


def _no_dist_save(sd, **kw):
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, no_dist=True, **kw)


def test_torch_dcp_single_process(tmp_path):
    sd = _state()
    _no_dist_save({**sd, "step": 12, "extra": {"lr": 0.1}}, checkpoint_id=str(tmp_path))
    _check_all(tmp_path, sd, "torch-dcp")
    with open_checkpoint(tmp_path) as r:
        assert r.read_value("step") == 12 and r.read_value("extra.lr") == 0.1
        c = r.metadata.tensors["embed.weight"].chunks[0]
        before = r.bytes_read
        assert torch.equal(r.read("embed.weight", c, (1, 0), (2, 6)), sd["embed.weight"][1:3])
        # a blob under 2 KiB is read whole once for its index, then the box alone
        assert r.bytes_read - before == c.storage[1] + 2 * 6 * 4
        r.read("embed.weight", c, (3, 0), (2, 6))
        assert r.bytes_read - before == c.storage[1] + 4 * 6 * 4  # the index is kept
        assert r.torch_save_reads == {"narrowed": 2, "strided": 0, "whole": 0}


def test_torch_dcp_hf_rank0_writer(tmp_path):
    sd = _state()
    _no_dist_save(sd, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)))
    assert (tmp_path / "model.safetensors.index.json").exists()
    _check_all(tmp_path, sd, "torch-dcp-hf")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    run_ranks(savers.save_sharded, 2, str(out), timeout=240)
    return out


def test_torch_dcp_sharded_two_ranks(sharded):
    full = savers.full_tensors()
    _check_all(sharded / "dcp", full, "torch-dcp")
    with open_checkpoint(sharded / "dcp") as r:
        assert [c.offsets for c in r.metadata.tensors["cols"].chunks] == [(0, 0), (0, 4)]
        assert r.read_value("step") == 7


def test_torch_dcp_hf_sharded_two_ranks(sharded):
    full = savers.full_tensors()
    _check_all(sharded / "hf-sharded", full, "torch-dcp-hf")
    with open_checkpoint(sharded / "hf-sharded") as r:
        files = {c.file for c in r.metadata.tensors["rows"].chunks}
        assert len(files) == 2  # one file per rank, the same key in each


def test_torch_dcp_hf_consolidated(sharded):
    full = {k: v for k, v in savers.full_tensors().items() if k not in savers.CONSOLIDATION_SKIPS}
    _check_all(sharded / "hf-consolidated", full, "hf")
    with open_checkpoint(sharded / "hf-consolidated", format="torch-dcp-hf") as r:
        assert _same(_assemble(r, "cols"), full["cols"])
