"""load and save in one process: argument errors, formats (native, HF), values and
optimizer state, strict/partial loads, validation before any write, Chunk targets,
dtypes, the report, and the ``dcp inspect`` command."""

from __future__ import annotations

import os

import dcp_load
import pytest
import torch
from dcp_load import Chunk, LoadError
from dcp_load.cli._main import main as cli
from safetensors.torch import save_file


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16(),
                  "f8": torch.randn(3, 2, generator=g).to(torch.float8_e4m3fn), "n": torch.tensor(7)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0], "name": "all"}]},
        "epoch": 2,
    }


def _poisoned() -> dict:
    s = _state()
    for t in (s["model"]["w"], s["model"]["b"], s["optim"]["state"][0]["exp_avg"], s["optim"]["state"][0]["step"]):
        t.fill_(float("nan"))
    s["model"]["f8"].view(torch.uint8).fill_(0x7F)
    s["model"]["n"].fill_(-123)
    s["optim"]["param_groups"][0].update(lr=None, params=None, name=None)
    s["epoch"] = None
    return s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("native"))
    report = dcp_load.save(_state(), checkpoint_id=path)
    assert report.chunks_written == 6 and report.bytes_written == report.job_bytes
    return path


def test_round_trip_native(native):
    state = _poisoned()
    report = dcp_load.load(state, checkpoint_id=native)
    _assert_same(state, _state())
    assert report.format == "native" and report.world_size == 1
    assert report.bytes_read == report.bytes_needed == report.job_unique_bytes
    assert report.read_amplification == 1.0 and report.values == 4 and report.tensors == 6
    assert report.broadcasts == 0 and report.bytes_received == 0
    assert set(report.seconds) == {"prepare", "plan", "validate", "execute", "finish", "total"}


def test_hf_and_chunk_targets(tmp_path):
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    save_file({"w": full, "v": full[0].clone()}, str(tmp_path / "model.safetensors"))
    piece = Chunk(torch.full((3, 4), float("nan")), (8, 6), (2, 1))
    v = torch.full((6,), float("nan"))
    report = dcp_load.load({"w": piece, "v": v}, checkpoint_id=tmp_path)
    assert torch.equal(piece.tensor, full[2:5, 1:5]) and torch.equal(v, full[0])
    assert report.format == "hf" and report.bytes_read == (12 + 6) * 4


def test_parameters_requiring_grad_load_in_place(native):
    w = torch.nn.Parameter(torch.full((6, 4), float("nan")))
    dcp_load.load({"model": {"w": w}}, checkpoint_id=native, strict=False)
    assert torch.equal(w.detach(), _state()["model"]["w"]) and w.requires_grad


def test_partial_load_with_strict_false(native):
    state = {"model": {"w": torch.full((6, 4), float("nan")), "extra": torch.zeros(2)}, "gone": 1}
    report = dcp_load.load(state, checkpoint_id=native, strict=False)
    assert report.missing == ("model.extra", "gone")
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["gone"] == 1


def test_every_problem_is_reported_before_any_write(native):
    state = _poisoned()
    state["model"]["w"] = torch.full((4, 6), float("nan"))  # shape
    state["model"]["b"] = torch.full((4,), float("nan"))  # dtype float32 vs bfloat16
    state["nope"] = torch.zeros(1)  # missing
    state["epoch"] = torch.zeros(1)  # a tensor where the checkpoint holds a value
    before = {k: v.clone() for k, v in state["optim"]["state"][0].items()}
    with pytest.raises(LoadError) as info:
        dcp_load.load(state, checkpoint_id=native, allow_dtype_cast=False)
    msg = str(info.value)
    for part in ("shape mismatch", "'model.w'", "(4, 6)", "dtype mismatch", "bfloat16", "'nope'",
                 "strict=False", "'epoch'", "No destination tensor was changed"):
        assert part in msg, part
    assert info.value.phase == "validate" and list(info.value.failures) == [0]
    for k, v in before.items():
        assert torch.equal(_bits(state["optim"]["state"][0][k]), _bits(v))
    assert state["optim"]["param_groups"][0]["lr"] is None


def test_missing_and_truncated_files_fail_before_writing(native, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(native, bad)
    (data,) = bad.glob("rank-00000.*.safetensors")
    os.truncate(data, os.path.getsize(data) - 8)
    state = _poisoned()
    with pytest.raises(LoadError, match=data.name):
        dcp_load.load(state, checkpoint_id=bad)
    assert torch.isnan(state["model"]["w"]).all()
    os.remove(data)
    with pytest.raises(LoadError, match=data.name):
        dcp_load.load(_poisoned(), checkpoint_id=bad)
    with pytest.raises(LoadError, match="dcp-metadata.json|not a checkpoint|no checkpoint|does not exist"):
        dcp_load.load(_poisoned(), checkpoint_id=tmp_path / "nothing-here")


@pytest.mark.parametrize("kwargs,match", [
    ({}, "give checkpoint_id= .* or storage_reader="),
    ({"checkpoint_id": "x", "broadcast_groups": {}, "broadcast_replicated_tensors": False},
     "drop broadcast_groups or set broadcast_replicated_tensors=True"),
    ({"checkpoint_id": "x", "broadcast_groups": {}, "no_dist": True}, "has no effect with no_dist"),
    ({"checkpoint_id": "x", "broadcast_batch_bytes": -1}, "broadcast_batch_bytes must be an int >= 0"),
    ({"checkpoint_id": "x", "broadcast_replicated_tensors": "always"}, "must be True, False or 'auto'"),
    ({"checkpoint_id": "x", "broadcast_replicated_tensors": 1}, "must be True, False or 'auto'"),
    ({"checkpoint_id": "x", "timeout": 0}, r"timeout must be a datetime.timedelta or a number of seconds > 0, got 0"),
    ({"checkpoint_id": "x", "timeout": True}, "timeout must be"),
    ({"checkpoint_id": "x", "timeout": "10m"}, "got '10m'"),
])
def test_argument_errors_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dcp_load.load({"w": torch.zeros(1)}, **kwargs)


def test_a_storage_reader_of_an_unknown_class_is_named(native):
    with pytest.raises(TypeError, match="storage_reader= of class builtins.object cannot be served"):
        dcp_load.load({"w": torch.zeros(1)}, checkpoint_id="x", storage_reader=object())
    from dcp_reader import open_checkpoint

    with open_checkpoint(native) as reader, pytest.raises(ValueError, match="not both"):
        dcp_load.load({"w": torch.zeros(1)}, checkpoint_id=native, storage_reader=reader)


def test_keywords_are_keyword_only():
    with pytest.raises(TypeError):
        dcp_load.load({}, "path")  # type: ignore[misc]


def test_storage_reader_is_left_open(native):
    from dcp_reader import open_checkpoint

    with open_checkpoint(native) as reader:
        state = _poisoned()
        dcp_load.load(state, storage_reader=reader)
        dcp_load.load(state, storage_reader=reader)
        assert reader.bytes_read > 0
    _assert_same(state, _state())


class Schedule:  # a value JSON cannot hold (module level, so that pickle can)
    def __eq__(self, other):
        return isinstance(other, Schedule)


def test_save_rejects_values_json_cannot_hold_without_pickle(tmp_path):
    with pytest.raises(LoadError, match="allow_pickle=True"):
        dcp_load.save({"w": torch.zeros(2), "sched": Schedule()}, checkpoint_id=tmp_path / "c")
    assert not (tmp_path / "c" / "dcp-metadata.json").exists()
    dcp_load.save({"w": torch.zeros(2), "sched": Schedule()}, checkpoint_id=tmp_path / "d", allow_pickle=True)
    state = {"w": torch.ones(2), "sched": None}
    with pytest.raises(LoadError, match="allow_pickle=True"):
        dcp_load.load(state, checkpoint_id=tmp_path / "d")
    assert state["sched"] is None and torch.equal(state["w"], torch.ones(2))
    dcp_load.load(state, checkpoint_id=tmp_path / "d", allow_pickle=True)
    assert state["sched"] == Schedule()


def test_a_real_optimizer_round_trips_without_pickle(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp_load.save(saved, checkpoint_id=tmp_path / "ckpt")

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, betas=(0.1, 0.2))
    model2(torch.randn(5, 4)).sum().backward()
    opt2.step()  # allocates the state tensors to load into
    target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    for t in [*target["model"].values(), *(v for s in target["optim"]["state"].values() for v in s.values())]:
        t.fill_(float("nan"))
    dcp_load.load(target, checkpoint_id=tmp_path / "ckpt")
    opt2.load_state_dict(target["optim"])
    model2.load_state_dict(target["model"])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95) and opt2.param_groups[0]["lr"] == 0.01
    _assert_same(target, {"model": model.state_dict(), "optim": opt.state_dict()})


def test_cli_inspect(native, capsys):
    assert cli(["inspect", native, "--chunks"]) == 0
    out = capsys.readouterr().out
    assert "format native, 6 tensors, 4 values" in out
    assert "model.w" in out and "(6, 4)" in out and "float8_e4m3fn" in out and "offsets=(0, 0)" in out
    assert cli(["inspect", native + "-missing"]) == 2


def test_save_refuses_chunks_that_do_not_cover_the_tensor(tmp_path):
    with pytest.raises(LoadError, match="do not tile"):
        dcp_load.save({"w": Chunk(torch.zeros(2, 4), (4, 4), (0, 0))}, checkpoint_id=tmp_path / "c")
    assert not (tmp_path / "c" / "dcp-metadata.json").exists()


def test_cli_inspect_shows_pickled_values_only_with_allow_pickle(tmp_path, capsys):
    import datetime

    path = str(tmp_path / "ckpt")
    dcp_load.save({"w": torch.ones(2), "when": datetime.date(2026, 12, 1), "n": 3},
                  checkpoint_id=path, allow_pickle=True)
    assert cli(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "(pickled in values." in out and ".pkl; --allow-pickle shows it" in out and "2026" not in out
    assert "n     value 3" in out
    assert cli(["inspect", path, "--allow-pickle"]) == 0
    out = capsys.readouterr().out
    assert "when  value datetime.date(2026, 12, 1)" in out and "pickled in" not in out


def test_cli_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file

    # ~4000 lines of output: far more than a pipe buffer holds, so the writer meets the closed pipe.
    save_file({f"layer.{i}.weight": np.zeros(2, np.float32) for i in range(2000)},
              str(tmp_path / "model.safetensors"))
    proc = subprocess.Popen([sys.executable, "-m", "dcp_load.cli._main", "inspect", "--chunks", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does after its line
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141
    assert b"format hf, 2000 tensors" in first
    assert stderr == "", stderr
