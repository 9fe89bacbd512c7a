"""``dcp_load.torch_compat`` where callers rely on torch.distributed.checkpoint's behaviour, in
one process (``no_dist=True``): ``load`` writes every non-Stateful top-level value back with
``state_dict[key] = ...`` in sorted key order, as torch's does; Statefuls are called in
sorted key order; a failing ``load`` or ``save`` raises an error that ``except
CheckpointException`` and ``except LoadError`` both catch, with LoadError's attributes and
message, and that pickles as such."""

from __future__ import annotations

import pickle
from collections.abc import MutableMapping

import dcp_load.torch_compat as compat
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import LoadError
from torch.distributed.checkpoint.api import CheckpointException

# torch DCP warns that it assumes one process when no process group is up
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

POISON = -999.0


class Recording(MutableMapping):
    """A state dict that records every ``__setitem__``."""

    def __init__(self, items: dict) -> None:
        self.items_, self.sets = dict(items), []

    def __getitem__(self, key):
        return self.items_[key]

    def __setitem__(self, key, value):
        self.sets.append(key)
        self.items_[key] = value

    def __delitem__(self, key):
        del self.items_[key]

    def __iter__(self):
        return iter(self.items_)

    def __len__(self):
        return len(self.items_)


class Logged:
    """A Stateful that logs its calls into a shared list."""

    def __init__(self, name: str, log: list, value: float = 0.0) -> None:
        self.name, self.log, self.t = name, log, torch.full((2,), value)

    def state_dict(self):
        self.log.append(("state_dict", self.name))
        return {"t": self.t}

    def load_state_dict(self, state):
        self.log.append(("load_state_dict", self.name))
        self.t = state["t"]


def _state(log: list, value: float) -> dict:
    return {"zeta": 7, "name": "run-a", "t": torch.full((3,), value), "b": Logged("b", log, value),
            "a": Logged("a", log, value)}


@pytest.mark.parametrize("load", [tdcp.load, compat.load], ids=["torch", "dcp"])
def test_load_writes_top_level_values_back_in_sorted_order(tmp_path, load):
    log: list = []
    tdcp.save(_state(log, 1.0), checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    log.clear()
    got = Recording({"zeta": 0, "name": "", "t": torch.full((3,), POISON), "b": Logged("b", log, POISON),
                     "a": Logged("a", log, POISON)})
    t = got["t"]
    load(got, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert got.sets == ["name", "t", "zeta"]  # torch: every non-Stateful key, sorted; tensors too
    assert got["zeta"] == 7 and got["name"] == "run-a" and got["t"] is t and torch.equal(t, torch.ones(3))
    assert log == [("state_dict", "a"), ("state_dict", "b"), ("load_state_dict", "a"), ("load_state_dict", "b")]
    assert torch.equal(got["a"].t, torch.ones(2)) and torch.equal(got["b"].t, torch.ones(2))


def test_save_calls_state_dict_in_sorted_key_order_at_every_depth(tmp_path):
    log: list = []
    state = {"z": Logged("z", log), "m": {"y": Logged("m.y", log), "x": [Logged("m.x.0", log)]},
             "a": Logged("a", log)}
    compat.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert [name for _, name in log] == ["a", "m.x.0", "m.y", "z"]


def _failing_load(tmp_path):
    compat.save({"t": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    compat.load({"t": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)


def test_a_failing_load_is_a_checkpoint_exception_and_a_load_error(tmp_path):
    with pytest.raises(CheckpointException) as caught:
        _failing_load(tmp_path)
    error = caught.value
    assert isinstance(error, LoadError) and isinstance(error, Exception)
    assert error.phase == "validate" and list(error.failures) == [0]
    assert "shape mismatch" in error.failures[0][0] and "'t'" in str(error)
    assert str(error).startswith("validate failed on 1 rank(s) (rank 0):")
    with pytest.raises(LoadError, match="shape mismatch"):
        _failing_load(tmp_path / "again")
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, CheckpointException) and isinstance(back, LoadError)
    assert (str(back), back.failures, back.phase, back.advice) == (str(error), error.failures, error.phase,
                                                                    error.advice)


def test_a_failing_save_is_a_checkpoint_exception_and_a_load_error(tmp_path):
    state = {"t": torch.ones(2), "f": {"g": lambda: 1}}  # a lambda cannot be pickled
    with pytest.raises(CheckpointException, match=r"cannot be pickled: 'f\.g'") as caught:
        compat.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert isinstance(caught.value, LoadError) and caught.value.phase == "save"
    with pytest.raises(LoadError, match=r"'f\.g'"):
        compat.save(state, checkpoint_id=str(tmp_path / "ck2"), no_dist=True)


def test_dcp_load_alone_raises_a_plain_load_error(tmp_path):
    import dcp_load

    dcp_load.save({"t": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(LoadError) as caught:
        dcp_load.load({"t": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert not isinstance(caught.value, CheckpointException)


def test_a_failed_async_save_future_raises_a_checkpoint_exception_and_a_load_error(tmp_path, monkeypatch):
    import dcp_load
    from dcp_load.saving._future import SaveFuture
    from dcp_load.torch_compat import _fails_with_checkpoint_exception
    from dcp_reader.write import TorchDcpWriter

    def fill_disk(self, name, tensors):  # the directory's disk fills while the background writes
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TorchDcpWriter, "write_file", fill_disk)
    future = compat.async_save({"t": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(CheckpointException, match="No space left on device") as caught:
        future.result(timeout=60)
    assert isinstance(caught.value, LoadError) and caught.value.phase == "save"
    assert isinstance(future.exception(), CheckpointException)
    with pytest.raises(LoadError) as plain:  # dcp_load's own async_save keeps its plain LoadError
        dcp_load.async_save({"t": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck2"), no_dist=True,
                            format="torch_dcp").result(timeout=60)
    assert not isinstance(plain.value, CheckpointException)
    monkeypatch.undo()
    failed = SaveFuture(str(tmp_path / "early"))  # a save that failed before async_save returned
    failed.set_exception(LoadError({0: ["OSError: disk full"]}, "save"))
    _fails_with_checkpoint_exception(failed)
    with pytest.raises(CheckpointException, match="disk full"):
        failed.result()
