"""``verify_checkpoint`` (and ``dcp verify``) on damaged checkpoints: every truncated or
missing data file is one problem line naming it, the other files are still checked, and
the counts are the checkpoint's own (was: a truncated file was "unreadable", exit 2, and a
missing one made an 80-tensor checkpoint "0 tensors, 0 chunks")."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from dcp_reader import verify_checkpoint
from safetensors.torch import save_file

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _hf(d):
    save_file({f"a{i}": torch.ones(100) for i in range(4)}, str(d / SHARDS[0]))
    save_file({f"b{i}": torch.ones(100) for i in range(4)}, str(d / SHARDS[1]))
    wm = {**{f"a{i}": SHARDS[0] for i in range(4)}, **{f"b{i}": SHARDS[1] for i in range(4)}}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _torch_dcp(d):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save({f"t{i}": torch.ones(100) for i in range(8)}, checkpoint_id=str(d))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 10)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_bad_hf_shard_is_one_problem_and_the_counts_are_the_checkpoints(tmp_path, damage):
    _hf(tmp_path)
    _truncate(tmp_path / SHARDS[1]) if damage == "truncate" else os.remove(tmp_path / SHARDS[1])
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and SHARDS[1] in report.problems[0]
    assert ("truncated" if damage == "truncate" else "'b0'; 'b1'; 'b2'; 'b3'") in report.problems[0]
    assert (report.format, report.tensors, report.chunks) == ("hf", 8, 8)


def test_the_other_shards_are_still_checked(tmp_path):
    _hf(tmp_path)
    _truncate(tmp_path / SHARDS[1])
    doc = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    doc["weight_map"]["extra"] = SHARDS[0]  # the first shard no longer holds what the index says
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(doc))
    report = verify_checkpoint(tmp_path)
    assert any(SHARDS[1] in p and "truncated" in p for p in report.problems)
    assert any("'extra'" in p and SHARDS[0] in p for p in report.problems), report.problems


def test_a_truncated_single_file(tmp_path):
    save_file({"w": torch.ones(100), "v": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    _truncate(tmp_path / "model.safetensors")
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and "truncated" in report.problems[0]
    assert (report.tensors, report.chunks) == (2, 2)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_bad_torch_dcp_file(tmp_path, damage):
    _torch_dcp(tmp_path)
    (data,) = [f for f in os.listdir(tmp_path) if f.endswith(".distcp")]
    _truncate(tmp_path / data) if damage == "truncate" else os.remove(tmp_path / data)
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and data in report.problems[0]
    assert (report.format, report.tensors, report.chunks) == ("torch-dcp", 8, 8)


def test_a_truncated_native_file_is_one_line_not_one_per_chunk(tmp_path):
    from dcp_reader import NativeWriter

    w = NativeWriter(tmp_path)
    w.write_file("rank-00000.safetensors", {f"t{i}@0": torch.full((64,), float(i)) for i in range(4)})
    w.write_file("rank-00001.safetensors", {"u@0": torch.ones(8)})
    from dcp_reader import CheckpointMetadata, ChunkMeta, TensorMeta

    tensors = {f"t{i}": TensorMeta(name=f"t{i}", shape=(64,), dtype="float32",
                                   chunks=(ChunkMeta(offsets=(0,), sizes=(64,), file="rank-00000.safetensors",
                                                     key=f"t{i}@0"),)) for i in range(4)}
    tensors["u"] = TensorMeta(name="u", shape=(8,), dtype="float32",
                              chunks=(ChunkMeta(offsets=(0,), sizes=(8,), file="rank-00001.safetensors",
                                                key="u@0"),))
    w.commit(CheckpointMetadata(tensors=tensors, values={}, format="native"))
    _truncate(tmp_path / "rank-00000.safetensors")
    with open(tmp_path / "rank-00001.safetensors", "r+b") as f:  # a flipped byte in the other file
        f.seek(-4, os.SEEK_END)
        f.write(b"\x7f")
    report = verify_checkpoint(tmp_path)
    assert sum("rank-00000" in p for p in report.problems) == 1
    assert len(report.problems) == 2 and "corrupt" in report.problems[1] and "'u'" in report.problems[1]
    assert (report.tensors, report.chunks) == (5, 5)


def test_dcp_verify_prints_problem_lines_and_exits_1(tmp_path, capsys):
    main = pytest.importorskip("dcp_load.cli._main").main
    _hf(tmp_path)
    _truncate(tmp_path / SHARDS[1])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("PROBLEM ") == 1 and SHARDS[1] in out
    assert "1 problem(s): format hf, 8 tensors, 8 chunks" in out
