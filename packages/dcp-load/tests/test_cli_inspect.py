"""``dcp --version`` and ``dcp inspect``: every dcp package's version; counts in the
singular for one; values that load without unpickling (torch DCP optimizer state through
``torch.load(weights_only=True)``) shown, and only values that need code marked pickled."""

from __future__ import annotations

import warnings

import dcp_broadcast
import dcp_load
import dcp_platform
import dcp_reader
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_load.cli._main import main


def test_version_names_every_dcp_package(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.splitlines() == [
        f"dcp-load {dcp_load.__version__}", f"dcp-reader {dcp_reader.__version__}",
        f"dcp-broadcast {dcp_broadcast.__version__}", f"dcp-platform {dcp_platform.__version__}"]


def test_one_tensor_one_value_one_file_in_the_singular(tmp_path, capsys):
    dcp_load.save({"w": torch.ones(2), "step": 3}, checkpoint_id=tmp_path, no_dist=True)
    assert main(["inspect", str(tmp_path)]) == 0
    assert ": format native, 1 tensor, 1 value, 8 B in 1 data file" in capsys.readouterr().out


class Opaque:  # a value torch.load(weights_only=True) refuses (module level, so that pickle can)
    def __init__(self, n: int):
        self.n = n


def _adam_checkpoint(path) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save(state, checkpoint_id=str(path))
    return state


def test_torch_dcp_optimizer_state_is_shown_and_loads_without_allow_pickle(tmp_path, capsys):
    saved = _adam_checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pickled" not in out, out
    assert "optim.param_groups.0.lr" in out and " value 0.01" in out and " value False" in out, out
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp_load.load(state, checkpoint_id=str(tmp_path))  # no allow_pickle
    assert state["optim"]["param_groups"][0]["lr"] == 0.01
    for k, v in saved["optim"]["state"][0].items():
        assert torch.equal(state["optim"]["state"][0][k], v), k


def test_only_values_that_need_code_are_marked_pickled(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "obj": Opaque(5), "n": 3}, checkpoint_id=str(tmp_path))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "(pickled in __0_0.distcp; --allow-pickle shows it" in lines["obj"], out
    assert lines["n"].endswith("value 3"), out
    assert main(["inspect", str(tmp_path), "--allow-pickle"]) == 0
    assert "Opaque object" in capsys.readouterr().out
