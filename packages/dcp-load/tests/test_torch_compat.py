"""``dcp_load.torch_compat`` as a stand-in for ``torch.distributed.checkpoint`` in one
process (``no_dist=True``, as torch runs without a process group): its names resolve to
torch's, torch's writers, readers and planner are taken, an unknown reader is refused by
name, non-tensor values are pickled as torch DCP pickles them, ``async_save`` answers as
torch's does for each stager, and checkpoints cross between the two both ways."""

from __future__ import annotations

from concurrent.futures import Future

import dcp_load
import dcp_load.torch_compat as compat
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import LoadError, SaveReport

# torch DCP warns that it assumes one process when no process group is up
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

POISON = -999.0


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=gen), "b": torch.arange(5, dtype=torch.int64),
            "meta": {"step": 7, "tags": ["a", "b"], "lr": 0.25}}


def _poisoned() -> dict:
    return {"w": torch.full((4, 3), POISON), "b": torch.full((5,), -9, dtype=torch.int64),
            "meta": {"step": None, "tags": None, "lr": None}}


def _assert_equal(got: dict, want: dict) -> None:
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["meta"] == want["meta"]


def test_names_resolve_to_torch_dcp_and_dcp_functions():
    assert compat.FileSystemReader is tdcp.FileSystemReader
    assert compat.HuggingFaceStorageReader is tdcp.HuggingFaceStorageReader
    assert compat.DefaultLoadPlanner is tdcp.DefaultLoadPlanner
    assert compat.state_dict_saver.AsyncCheckpointerType is tdcp.state_dict_saver.AsyncCheckpointerType
    assert compat.state_dict_saver.AsyncSaveResponse is tdcp.state_dict_saver.AsyncSaveResponse
    assert compat.state_dict_saver.save is compat.save and compat.state_dict_saver.async_save is compat.async_save
    assert compat.state_dict_loader.load is compat.load
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'.*torch.distributed.checkpoint"):
        compat.NoSuchName  # noqa: B018


def test_save_load_with_torch_writer_reader_and_partial_planner(tmp_path):
    path = tmp_path / "ck"
    report = compat.save(_state(), storage_writer=compat.FileSystemWriter(str(path)), no_dist=True)
    assert isinstance(report, SaveReport) and report.tensors == 2  # torch returns Metadata
    got = _poisoned()
    assert compat.load(got, storage_reader=compat.FileSystemReader(str(path)), no_dist=True) is None
    _assert_equal(got, _state())

    extra = {**_poisoned(), "extra": torch.full((2,), POISON)}
    with pytest.raises(LoadError, match="extra"):
        compat.load(extra, checkpoint_id=str(path), no_dist=True)
    extra = {**_poisoned(), "extra": torch.full((2,), POISON)}
    compat.load(extra, checkpoint_id=str(path), planner=compat.DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True)
    _assert_equal(extra, _state())
    assert torch.equal(extra["extra"], torch.full((2,), POISON))  # not in the checkpoint: left alone


def test_unknown_reader_is_refused_by_name(tmp_path):
    path = tmp_path / "ck"
    compat.save(_state(), checkpoint_id=str(path), no_dist=True)

    class MyReader(tdcp.FileSystemReader):
        pass

    got = _poisoned()
    with pytest.raises(TypeError, match=r"storage_reader= of class .*MyReader cannot be served"):
        compat.load(got, storage_reader=MyReader(str(path)), no_dist=True)
    assert torch.equal(got["w"], torch.full((4, 3), POISON))


def test_torch_dcp_checkpoint_loads_through_compat_and_back(tmp_path):
    torch_path, dcp_path = tmp_path / "torch", tmp_path / "dcp"
    tdcp.save(_state(1), storage_writer=tdcp.FileSystemWriter(str(torch_path)), no_dist=True)
    theirs, ours = _poisoned(), _poisoned()
    tdcp.load(theirs, checkpoint_id=str(torch_path), no_dist=True)
    compat.load(ours, storage_reader=compat.FileSystemReader(str(torch_path)), no_dist=True)
    _assert_equal(ours, theirs)
    _assert_equal(ours, _state(1))

    compat.save(ours, checkpoint_id=str(dcp_path), no_dist=True)
    again = _poisoned()
    compat.load(again, checkpoint_id=str(dcp_path), no_dist=True)
    _assert_equal(again, theirs)


def test_values_beyond_json_are_pickled_as_torch_dcp_does(tmp_path):
    """torch DCP pickles every non-tensor value (torchtitan's dataloader state is bytes)."""
    state = {"w": torch.ones(2), "blob": b"\x00\x01state", "kinds": {3, 1}}
    with pytest.raises(LoadError, match="'blob': builtins.bytes"):
        dcp_load.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    compat.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    got = {"w": torch.zeros(2), "blob": None, "kinds": None}
    compat.load(got, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert got["blob"] == b"\x00\x01state" and got["kinds"] == {1, 3} and torch.equal(got["w"], torch.ones(2))


def test_async_save_answers_as_torch_for_each_stager(tmp_path):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    plain = compat.async_save(_state(2), checkpoint_id=str(tmp_path / "a"), no_dist=True,
                              async_checkpointer_type=compat.state_dict_saver.AsyncCheckpointerType.THREAD)
    assert isinstance(plain, Future) and plain.staging_completion.done()
    assert isinstance(plain.result(timeout=60), SaveReport)

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False))
    try:
        response = compat.async_save(_state(3), checkpoint_id=str(tmp_path / "b"), no_dist=True,
                                     async_stager=stager)
    finally:
        stager.close()
    # torch returns an AsyncSaveResponse for a stager that stages in the background
    assert isinstance(response, compat.state_dict_saver.AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    assert isinstance(response.upload_completion.result(timeout=60), SaveReport)
    for name, seed in (("a", 2), ("b", 3)):
        got = _poisoned()
        compat.load(got, checkpoint_id=str(tmp_path / name), no_dist=True)
        _assert_equal(got, _state(seed))
