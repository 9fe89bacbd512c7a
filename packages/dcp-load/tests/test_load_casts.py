"""Loading into destinations of another dtype, as torch.distributed.checkpoint does:
bfloat16 files into float32 master weights and back, float8 and integers, from the native,
Hugging Face and torch DCP formats; values equal torch DCP's own load bit for bit; the
report lists the cast tensors; ``allow_dtype_cast=False`` refuses any difference."""

from __future__ import annotations

import os
import warnings

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import LoadError
from safetensors.torch import save_file

SAVED = {"w": torch.bfloat16, "v": torch.float32, "i": torch.int32, "f8": torch.float8_e4m3fn}
WANTED = {"w": torch.float32, "v": torch.bfloat16, "i": torch.int64, "f8": torch.float32}


def _saved() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, dtype in SAVED.items():
        t = torch.randn(16, 8, generator=g) * 3
        out[name] = t.round().to(dtype) if not dtype.is_floating_point else t.to(dtype)
    return out


def _poisoned() -> dict[str, torch.Tensor]:
    return {n: torch.full((16, 8), float("nan") if d.is_floating_point else -123).to(d)
            for n, d in WANTED.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module", params=["native", "hf", "torch-dcp"])
def checkpoint(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "native":
        dcp_load.save(_saved(), checkpoint_id=path)
    elif request.param == "hf":
        save_file(_saved(), os.path.join(path, "model.safetensors"))
    else:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            tdcp.save(_saved(), checkpoint_id=path, no_dist=True)
    return path


def test_casts_equal_torch_dcp_load(checkpoint):
    ours = _poisoned()
    report = dcp_load.load(ours, checkpoint_id=checkpoint)
    assert sorted(report.cast) == sorted(SAVED)
    if os.path.exists(os.path.join(checkpoint, ".metadata")):
        theirs = _poisoned()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tdcp.load(theirs, checkpoint_id=checkpoint, no_dist=True)
    else:  # torch DCP cannot read these formats with its default reader: torch's own copy_
        theirs = {n: torch.empty(16, 8, dtype=WANTED[n]).copy_(t) for n, t in _saved().items()}
    for name in SAVED:
        assert ours[name].dtype == WANTED[name]
        assert torch.equal(_bits(ours[name]), _bits(theirs[name])), name


def test_sub_boxes_cast_piece_by_piece(checkpoint):
    from dcp_load import Chunk

    half = torch.full((8, 8), float("nan"))
    dcp_load.load({"w": Chunk(half, (16, 8), (8, 0))}, checkpoint_id=checkpoint)
    assert torch.equal(half, _saved()["w"][8:].float())


def test_opt_out_refuses_casts_and_writes_nothing(checkpoint):
    ours = _poisoned()
    with pytest.raises(LoadError, match="allow_dtype_cast=False refuses casts") as info:
        dcp_load.load(ours, checkpoint_id=checkpoint, allow_dtype_cast=False)
    assert info.value.phase == "validate"
    for name in SAVED:
        assert f"'{name}'" in str(info.value)
        assert torch.equal(_bits(ours[name]), _bits(_poisoned()[name]))


def test_complex_and_real_never_mix(tmp_path):
    save_file({"c": torch.randn(4, dtype=torch.complex64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match="complex and real"):
        dcp_load.load({"c": torch.zeros(4)}, checkpoint_id=str(tmp_path))
