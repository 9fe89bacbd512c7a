"""Everyday mistakes get clear errors in one process: a ``meta``-device destination, a
launcher's WORLD_SIZE without a process group, keys that miss the checkpoint's by a prefix
(with ``strict=False`` too), and error messages that stay the same size at any world size."""

from __future__ import annotations

import re

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


def test_error_message_lists_each_cause_once_with_its_ranks():
    cause = "'w': shape mismatch (state dict (4, 4), checkpoint (8, 4)); build the model with the checkpoint's shapes"
    sizes = {}
    for world in (2, 4, 1000):
        err = LoadError({r: [cause] for r in range(world)}, "validate")
        assert str(err).count(cause) == 1
        assert f"ranks 0-{world - 1}: {cause}" in str(err)
        assert err.failures == {r: (cause,) for r in range(world)}
        sizes[world] = len(re.sub(r"\d+", "N", str(err)))  # numbers are the only part that names the world
    assert sizes[2] == sizes[4] == sizes[1000]
    assert len(str(err)) < 2 * len(cause) + 100


def test_error_message_groups_ranks_and_bounds_scattered_ones():
    err = LoadError({0: ["a"], 1: ["a", "b"], 2: ["a"], 3: ["a"], 5: ["a"], 7: ["b"]}, "execute")
    assert "  ranks 0-3, 5: a" in str(err) and "  ranks 1, 7: b" in str(err)
    scattered = LoadError({r: ["x"] for r in range(0, 2000, 2)}, "validate")
    assert len(str(scattered)) < 300 and "... and 992 more" in str(scattered)
    many = LoadError({r: [f"rank {r} holds a different shape"] for r in range(1000)}, "validate")
    assert len(str(many)) < 2000 and "980 more distinct cause(s)" in str(many)


def test_a_prefix_the_checkpoint_lacks_is_named_with_nearest_keys(ckpt):
    state = {"model": {"w": torch.zeros(6), "b": torch.zeros(2)}}
    with pytest.raises(LoadError, match=r"prefix 'model\.' the checkpoint's keys lack.*nearest checkpoint keys: "
                                        r"'model\.w' -> 'w'"):
        dcp_load.load(state, checkpoint_id=ckpt)
    # Following the old advice (strict=False) must not succeed with nothing loaded.
    with pytest.raises(LoadError, match=r"strict=False, but none of the state dict's 2 key\(s\) is in the "
                                        r"checkpoint.*prefix 'model\.'"):
        dcp_load.load(state, checkpoint_id=ckpt, strict=False)


def test_a_prefix_the_state_dict_lacks_is_named(tmp_path):
    path = str(tmp_path / "nested")
    dcp_load.save({"model": {"w": torch.arange(3.0)}}, checkpoint_id=path, no_dist=True)
    with pytest.raises(LoadError, match=r"the checkpoint's keys carry a prefix 'model\.' that 1 of the 1"):
        dcp_load.load({"w": torch.zeros(3)}, checkpoint_id=path)


def test_non_strict_load_that_leaves_keys_unloaded_warns(ckpt, caplog):
    w, extra = torch.zeros(6), torch.full((2,), 5.0)
    with caplog.at_level("WARNING", logger="dcp_load"):
        report = dcp_load.load({"w": w, "extra": extra}, checkpoint_id=ckpt, strict=False)
    assert report.missing == ("extra",) and w.tolist() == list(range(6)) and extra.tolist() == [5.0, 5.0]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "1 key(s)" in caplog.text and "'extra'" in caplog.text


def test_an_execute_failure_does_not_claim_nothing_changed():
    # Found only while reading (a corrupt torch DCP payload, a disk error): earlier pieces
    # may already sit in their destinations, and the message must say so.
    execute = str(LoadError({1: ["reading 'w' failed"]}, "execute"))
    assert "may have been partly written" in execute and "No destination tensor was changed" not in execute
    validate = str(LoadError({1: ["shape mismatch"]}, "validate"))
    assert "No destination tensor was changed" in validate and "partly written" not in validate
