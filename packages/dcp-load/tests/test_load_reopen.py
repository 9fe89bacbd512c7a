"""Loading a checkpoint, overwriting it with other values (and another layout of its files),
then loading it again gives the new values in every format: the metadata open_checkpoint
keeps for a directory whose files did not change (``dcp_reader._opened``) is never served
for changed files. Every file counts as settled here, so that the first load's metadata is
kept."""

from __future__ import annotations

import time
import warnings

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_reader import _opened
from safetensors.torch import save_file


@pytest.fixture(autouse=True)
def settled(monkeypatch):
    _opened.forget()
    monkeypatch.setattr(_opened, "SETTLED_S", 0.0)
    yield
    _opened.forget()


def _hf(sd: dict[str, torch.Tensor], path) -> None:
    path.mkdir(exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))


def _torch_dcp(sd: dict[str, torch.Tensor], path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=str(path), no_dist=True)


def _native(sd: dict[str, torch.Tensor], path) -> None:
    dcp_load.save(sd, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("write", [_hf, _torch_dcp, _native])
def test_values_written_over_a_loaded_checkpoint_are_loaded(tmp_path, write):
    path = tmp_path / "ckpt"
    write({"w": torch.arange(12.0).reshape(3, 4)}, path)
    time.sleep(0.05)  # past the file system's timestamp granularity
    target = {"w": torch.zeros(3, 4)}
    dcp_load.load(target, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4))
    # other values in another dtype, and another tensor: the old metadata would read wrong bytes
    write({"a": torch.full((5,), 9.0), "w": -torch.arange(12.0, dtype=torch.float64).reshape(3, 4)}, path)
    time.sleep(0.05)
    dcp_load.load(target, checkpoint_id=str(path), no_dist=True, strict=False)
    assert torch.equal(target["w"], -torch.arange(12.0).reshape(3, 4))
