"""open_checkpoint reuses a directory's parsed metadata while its files are unchanged
(``dcp_reader._opened``): parsed once while nothing changes; parsed again after a file is
rewritten in place (also at the same size), replaced, added or removed, in a subdirectory
too; never kept while its files are recent (the racy rule)."""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_reader import _opened, _reader, open_checkpoint
from safetensors.torch import save, save_file


@pytest.fixture
def parses(monkeypatch):
    """Every file counts as settled; the number of parses made so far, as a list's length."""
    _opened.forget()
    monkeypatch.setattr(_opened, "SETTLED_S", 0.0)
    calls: list[str] = []
    real = _reader._parse

    def counted(root, format, rank):
        calls.append(root)
        return real(root, format, rank)

    monkeypatch.setattr(_reader, "_parse", counted)
    yield calls
    _opened.forget()


def _later() -> None:
    """Past the file system's timestamp granularity (a clock tick) and the settled rule."""
    time.sleep(0.05)


def _values(path) -> dict[str, list[float]]:
    with open_checkpoint(path) as r:
        return {n: r.read(n, t.chunks[0], t.chunks[0].offsets, t.chunks[0].sizes).double().ravel().tolist()
                for n, t in r.metadata.tensors.items()}


def test_an_unchanged_checkpoint_is_parsed_once(tmp_path, parses):
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    _later()
    for _ in range(3):
        assert _values(tmp_path) == {"w": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert len(parses) == 1


def test_a_file_rewritten_in_place_at_the_same_size_is_parsed_again(tmp_path, parses):
    """Same size, same inode, another header: the dtypes of the two tensors swap."""
    path = str(tmp_path / "model.safetensors")
    save_file({"a": torch.ones(4, dtype=torch.float32), "b": torch.full((4,), 2, dtype=torch.int32)}, path)
    size, inode = os.stat(path).st_size, os.stat(path).st_ino
    _later()
    with open_checkpoint(tmp_path) as r:
        assert r.metadata.tensors["a"].dtype == "float32"
    with open(path, "r+b") as f:  # in place: save_file would make a new file
        f.write(save({"a": torch.full((4,), 3, dtype=torch.int32), "b": torch.full((4,), 4.0, dtype=torch.float32)}))
    assert (os.stat(path).st_size, os.stat(path).st_ino) == (size, inode)
    _later()
    assert _values(tmp_path) == {"a": [3.0] * 4, "b": [4.0] * 4}
    assert len(parses) == 2


def test_a_replaced_added_or_removed_file_is_parsed_again(tmp_path, parses):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    _later()
    assert _values(tmp_path) == {"x": [0.0, 0.0]}
    save_file({"x": torch.ones(3), "y": torch.ones(1)}, str(tmp_path / "new.tmp"))
    os.replace(tmp_path / "new.tmp", tmp_path / "a.safetensors")  # a new file under the old name
    _later()
    assert _values(tmp_path) == {"x": [1.0] * 3, "y": [1.0]}
    save_file({"z": torch.full((2,), 5.0)}, str(tmp_path / "b.safetensors"))  # added
    _later()
    assert _values(tmp_path) == {"x": [1.0] * 3, "y": [1.0], "z": [5.0, 5.0]}
    os.unlink(tmp_path / "b.safetensors")  # removed
    _later()
    assert _values(tmp_path) == {"x": [1.0] * 3, "y": [1.0]}
    assert len(parses) == 4


def test_a_shard_in_a_subdirectory_rewritten_is_parsed_again(tmp_path, parses):
    (tmp_path / "shards").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "shards" / "s.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shards/s.safetensors"}}))
    _later()
    assert _values(tmp_path) == {"w": [0.0, 0.0]}
    save_file({"w": torch.full((3,), 7.0)}, str(tmp_path / "shards" / "s.safetensors"))
    _later()
    assert _values(tmp_path) == {"w": [7.0] * 3}
    assert len(parses) == 2


def _dcp_save(sd: dict[str, torch.Tensor], path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def test_a_torch_dcp_checkpoint_saved_again_is_parsed_again(tmp_path, parses):
    _dcp_save({"w": torch.zeros(4)}, tmp_path)
    _later()
    assert _values(tmp_path) == {"w": [0.0] * 4}
    assert _values(tmp_path) == {"w": [0.0] * 4}
    _dcp_save({"w": torch.arange(6.0), "v": torch.ones(2)}, tmp_path)
    _later()
    assert _values(tmp_path) == {"w": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "v": [1.0, 1.0]}
    assert len(parses) == 2


def test_recent_files_are_not_kept(tmp_path, parses, monkeypatch):
    monkeypatch.setattr(_opened, "SETTLED_S", 60.0)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    for _ in range(2):
        _values(tmp_path)
    assert len(parses) == 2
