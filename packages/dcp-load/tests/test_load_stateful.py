"""Stateful values (objects with ``state_dict`` and ``load_state_dict``) as torch DCP takes
them: ``save`` stores ``state_dict()``, ``load`` fills it and calls ``load_state_dict`` with
it, at the top level and nested in mappings and lists; the caller's containers keep their
objects and get the loaded non-tensor values; a ``state_dict()`` or ``load_state_dict()``
that raises is named (key and type) on every rank, nothing written for the first; side by
side with torch.distributed.checkpoint on the same files, both ways."""

from __future__ import annotations

import sys
from pathlib import Path

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import LoadError
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import load_unsupported_cases as cases  # noqa: E402


class Counter:
    """A Stateful with a tensor and a plain value; records each ``load_state_dict`` call."""

    def __init__(self, n: int = 0, t: torch.Tensor | None = None):
        self.n, self.t, self.calls = n, torch.zeros(3) if t is None else t, []

    def state_dict(self) -> dict:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.calls.append(dict(state))
        self.n, self.t = state["n"], state["t"]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _poison(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))


def test_module_optimizer_and_nested_stateful_round_trip(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "extra": {"counter": Counter(5, torch.arange(3.0))},
             "many": [Counter(1), Counter(2)], "step": 11}
    dcp_load.save(state, checkpoint_id=str(tmp_path), no_dist=True)

    fresh = _model(1)
    _poison(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.ones(2, 4)).sum().backward()
    fresh_opt.step()  # creates the state the checkpoint fills
    inner, many = Counter(), [Counter(), Counter()]
    extra = {"counter": inner}
    target = {"model": fresh, "optim": fresh_opt, "extra": extra, "many": many, "step": 0}
    dcp_load.load(target, checkpoint_id=str(tmp_path))
    # the caller's containers keep their objects; the objects hold the loaded state
    assert target["model"] is fresh and target["extra"] is extra and extra["counter"] is inner
    assert target["many"] is many and target["step"] == 11
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    saved, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg"], got[k]["exp_avg"]) for k in saved)
    assert inner.n == 5 and torch.equal(inner.t, torch.arange(3.0)) and len(inner.calls) == 1
    assert [c.n for c in many] == [1, 2]


def test_state_dict_that_raises_is_named_and_nothing_is_written(tmp_path):
    dcp_load.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(tmp_path), no_dist=True)
    w = torch.full((4,), float("nan"))
    with pytest.raises(LoadError, match="validate") as err:
        dcp_load.load({"model": cases.Broken("state_dict", w)}, checkpoint_id=str(tmp_path))
    assert "'model': load_unsupported_cases.Broken.state_dict() raised RuntimeError: no state here" in str(err.value)
    assert torch.isnan(w).all()


def test_load_state_dict_that_raises_is_named(tmp_path):
    dcp_load.save({"a": {"b": {"w": torch.ones(4)}}}, checkpoint_id=str(tmp_path), no_dist=True)
    obj = cases.Broken("load_state_dict", torch.zeros(4))
    with pytest.raises(LoadError) as err:
        dcp_load.load({"a": {"b": obj}}, checkpoint_id=str(tmp_path))
    assert "'a.b': load_unsupported_cases.Broken.load_state_dict() raised RuntimeError" in str(err.value)


def test_state_dict_returning_no_mapping_is_refused_by_save(tmp_path):
    class Odd(Counter):
        def state_dict(self):
            return [1, 2]

    with pytest.raises(ValueError, match=r"'odd': .*Odd.state_dict\(\) returned a list, not a mapping"):
        dcp_load.save({"odd": Odd()}, checkpoint_id=str(tmp_path), no_dist=True)
    assert not (tmp_path / "dcp-metadata.json").exists()


@pytest.mark.parametrize("fail_in", ["state_dict", "load_state_dict"])
def test_every_rank_raises_when_one_ranks_stateful_fails(tmp_path, fail_in):
    dcp_load.save({"model": {"w": torch.arange(4.0)}, "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    for rank, (raised, ok) in enumerate(run_ranks(cases.stateful_fails_on_rank_1, 2, str(tmp_path), fail_in,
                                                  timeout=120)):
        assert f"rank 1: 'model': load_unsupported_cases.Broken.{fail_in}() raised RuntimeError" in raised, raised
        assert "rank 0:" not in raised and ok, (rank, raised)


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Counter]:
    fresh = _model(1)
    _poison(fresh)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.7, momentum=0.9)
    fresh(torch.ones(2, 4)).sum().backward()
    fresh_opt.step()  # creates the momentum buffers the checkpoint fills
    return fresh, fresh_opt, Counter()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_side_by_side_with_torch_dcp_on_its_files(tmp_path):
    """torch DCP saves a module, an optimizer and a Stateful as values; dcp and torch DCP
    each load those files into fresh Stateful values: the same state either way."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    tdcp.save({"model": model, "optim": opt, "counter": Counter(4, torch.ones(3))},
              checkpoint_id=str(tmp_path), no_dist=True)
    loaded = []
    for loader in (dcp_load.load, tdcp.load):
        fresh, fresh_opt, counter = _fresh()
        state = {"model": fresh, "optim": fresh_opt, "counter": counter}
        kwargs = {"no_dist": True} if loader is tdcp.load else {}
        loader(state, checkpoint_id=str(tmp_path), **kwargs)
        loaded.append((fresh.state_dict(), fresh_opt.state_dict(), counter))
    (m1, o1, c1), (m2, o2, c2) = loaded
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in
               zip(m1.values(), m2.values(), model.state_dict().values(), strict=True))
    assert o1["param_groups"] == o2["param_groups"] and o1["param_groups"][0]["lr"] == 0.1
    assert all(torch.equal(o1["state"][k]["momentum_buffer"], o2["state"][k]["momentum_buffer"]) for k in o1["state"])
    assert c1.n == c2.n == 4 and torch.equal(c1.t, c2.t)
