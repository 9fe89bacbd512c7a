"""Versions of ``transfer`` (``dcp_load.transferring._versions``), its ``on_synced`` hook and
``atomic=True``, on one process: records by memory (another object over the same bytes finds
them), torn and partly covered destinations read None, the group's count, arguments refused,
and the hook's names and exceptions. Between ranks: tests-integration/sync/test_integ_sync_versions.py."""

from __future__ import annotations

import pytest
import torch
from dcp_load import Chunk, synced_version, transfer
from dcp_load.transferring import _versions
from dcp_load.transferring._ledger import span


@pytest.fixture(autouse=True)
def _fresh_records():
    saved = dict(_versions._RECORDS), dict(_versions._LAST)
    _versions._RECORDS.clear()
    yield
    _versions._RECORDS.clear()
    _versions._RECORDS.update(saved[0])
    _versions._LAST.clear()
    _versions._LAST.update(saved[1])


def test_a_record_is_found_through_any_object_over_the_same_memory():
    t = torch.zeros(4, 8)
    assert synced_version(t) is None  # never filled by a transfer
    _versions.record({"t": span(t)}, 5)
    assert synced_version(t) == synced_version(t.data) == synced_version(Chunk(t, (8, 8), (4, 0))) == 5
    assert synced_version(t[1:3]) == 5  # rows of it hold what it holds
    assert synced_version(torch.zeros(4, 8)) is None  # other memory


def test_torn_and_partly_covered_destinations_read_none_until_filled_again():
    whole = torch.zeros(8, 8)
    top, bottom = whole[:4], whole[4:]
    _versions.record({"whole": span(whole)}, 1)
    _versions.record({"top": span(top)}, 2)
    assert synced_version(top) == 2 and synced_version(bottom) == 1
    assert synced_version(whole) is None  # a newer record covers part of it only
    _versions.tear([span(bottom)])
    assert synced_version(bottom) is None and synced_version({"top": top, "bottom": bottom}) is None
    _versions.record({"whole": span(whole)}, 3)
    assert synced_version({"top": top, "nested": {"bottom": bottom}}) == synced_version(whole) == 3


def test_a_mapping_reads_one_version_only_when_all_agree():
    a, b = torch.zeros(2), torch.zeros(3)
    _versions.record({"a": span(a)}, 4)
    assert synced_version({"a": a, "b": b}) is None
    _versions.record({"b": span(b)}, 4)
    assert synced_version({"a": a, "b": b}) == 4 and synced_version({}) is None
    with pytest.raises(TypeError, match="'x' is a int, not a tensor"):
        synced_version({"a": a, "x": 3})


def test_the_group_count_follows_the_last_committed_version():
    assert _versions.resolve(None, "g") == 1 and _versions.resolve(7, "g") == 7
    _versions.committed("g", 41)
    assert _versions.resolve(None, "g") == 42
    _versions.forget_group("g")
    assert _versions.resolve(None, "g") == 1


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 1 << 62])
def test_a_bad_version_is_refused(bad):
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        transfer({"w": torch.ones(2)}, {"w": torch.zeros(2)}, version=bad)


def test_a_hook_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="on_synced must be a callable"):
        transfer({"w": torch.ones(2)}, {"w": torch.zeros(2)}, on_synced="process_weights_after_loading")


def test_one_process_syncs_versions_and_calls_the_hook_once_with_the_names_written():
    src = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    dst = {"w": torch.full((4, 4), float("nan")), "b": torch.full((4,), float("nan"))}
    seen = []
    report = transfer(src, dst, version=7, atomic=True, on_synced=lambda names: seen.append((names,
                                                                                              synced_version(dst))))
    assert report.version == 7 and report.changed == ("w", "b") and seen == [(("w", "b"), 7)]
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"])
    assert transfer(src, dst).version == 8  # counted from the last version


def test_a_hook_that_raises_raises_with_a_note_after_the_sync_succeeded():
    src, dst = {"w": torch.randn(3)}, {"w": torch.zeros(3)}

    def hook(names):
        raise KeyError("no such layer")

    with pytest.raises(KeyError) as caught:
        transfer(src, dst, version=3, on_synced=hook)
    assert "on_synced raised on rank 0 after the transfer of version 3 succeeded" in caught.value.__notes__[0]
    assert synced_version(dst) == 3 and torch.equal(dst["w"], src["w"])
