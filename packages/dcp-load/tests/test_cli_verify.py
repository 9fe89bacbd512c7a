"""``dcp verify DIR`` and ``dcp_reader.verify_checkpoint``: exit 0 for a good checkpoint
(native with checksums, Hugging Face and torch DCP without), 1 with one line per problem
(a flipped bit names file, tensor and block; a truncated or missing file), 2 when unreadable."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from dcp_load import save
from dcp_load.cli._main import main
from dcp_reader import verify_checkpoint
from safetensors.torch import save_file


def _native(path):
    sd = {"a": torch.randn(300, 1024), "b": torch.arange(10), "step": 3}
    save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def test_good_native_checkpoint(tmp_path, capsys):
    _native(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "2 with checksums" in out
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.bytes_verified == 300 * 1024 * 4 + 10 * 8


def test_flipped_bit_is_reported_with_file_tensor_and_block(tmp_path, capsys):
    _native(tmp_path)
    data = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")][0]
    with open(tmp_path / data, "r+b") as f:
        f.seek(-200, os.SEEK_END)
        f.write(b"\x7f\x7f")
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "block 0" in out and data in out and "1 problem(s)" in out


def test_truncated_file_is_a_problem(tmp_path, capsys):
    save_file({"w": torch.ones(100)}, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 10)
    assert main(["verify", str(tmp_path)]) == 1  # a problem found, not "unreadable"
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "truncated" in out and "1 tensors, 1 chunks" in out


def test_torch_dcp_without_checksums(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(tmp_path))
    assert main(["verify", str(tmp_path)]) == 0
    assert "no checksums" in capsys.readouterr().out


def test_unreadable(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "unreadable" in capsys.readouterr().err


def test_a_changed_value_is_reported_by_verify_and_refused_by_load(tmp_path, capsys):
    import json

    import pytest
    from dcp_load import LoadError, load

    _native(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "1 values (1 with checksums)" in capsys.readouterr().out
    meta = tmp_path / "dcp-metadata.json"
    doc = json.loads(meta.read_text())
    doc["values"]["step"]["value"] = 4
    meta.write_text(json.dumps(doc))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and "value 'step'" in out and "1 problem(s)" in out
    state = {"a": torch.full((300, 1024), float("nan")), "b": torch.full((10,), -123), "step": 0}
    with pytest.raises(LoadError, match="ChecksumError.*value 'step'"):
        load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert state["a"].isnan().all() and (state["b"] == -123).all() and state["step"] == 0


def test_a_missing_shard_of_an_index_is_a_problem(tmp_path, capsys):
    import json

    save_file({"a": torch.ones(3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors"}}))
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    assert main(["verify", str(tmp_path)]) == 1  # a problem found, not "unreadable"
    out = capsys.readouterr().out
    assert "PROBLEM missing file 'model-00002-of-00002.safetensors'" in out and "1 problem(s)" in out
