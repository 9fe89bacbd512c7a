"""Saves that agree on their layout without gathering (``dcp_load.saving._agreed``), on 4
real gloo ranks:

* a second and third save of the same state, sync or async, make no full exchange and copy
  once; the checkpoints load back exactly into poisoned targets;
* one rank changing what it holds makes every rank gather again, a rank whose boxes moved
  copies again, nothing is lost (the new tensor and every moved box load back);
* refusals still come on every rank after a remembered save: different directories, a
  lock held by another writer (at the call of async_save; the pool is free for the next);
* two kinds of save alternating (a rank holding the same in both) take the fast path after
  the first of each, and a rank keeps digests and its own items, not the others' holdings;
* a rank that gathers does not wait for the others' early copies: they stop.
"""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "_support"))  # helpers shared by several areas
sys.path.insert(0, os.path.dirname(__file__))

import integ_save_remembered_cases as cases  # noqa: E402


def test_a_remembered_layout_skips_the_gathering_until_a_rank_changes(tmp_path):
    outs = run_ranks(cases.remembered_then_changed, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["first"] == (1, 0), (rank, out)  # (full exchanges, staging copies)
        assert out["async_again"][0] == 0 and out["sync_again"] == (0, 0), (rank, out)
        assert out["async_again"][1] == (1 if out["written_2"] else 0), (rank, out)
        assert out["changed"][0] == 1 and out["changed_again"][0] == 0, (rank, out)
        assert out["staged_4"] == out["written_4"], (rank, out)
        assert out["holds_3"] and out["holds_4"] and out["holds_5"] and out["extra_5"], (rank, out)
    moved = [r for r, o in enumerate(outs) if o["written_4"] != o["written_2"]]
    assert 3 in moved and len(moved) >= 2, [(o["written_2"], o["written_4"]) for o in outs]
    # a rank whose boxes moved copied twice in save 4: its early copy was not this save's
    assert any(outs[r]["changed"][1] == 2 for r in moved if r != 3), [o["changed"] for o in outs]


def test_refusals_still_come_on_every_rank_after_a_remembered_save(tmp_path):
    outs = run_ranks(cases.refusals_after_remembering, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(outs):
        err = out["dirs"]["error"]
        assert err and err["type"] == "LoadError" and "every rank must pass the same directory" in err["message"], out
        err = out["locked"]["error"]
        assert err and err["type"] == "LoadError" and err["ranks"] == [0], (rank, out)
        assert out["holds_4"] and out["holds_5"], (rank, out)


def test_two_kinds_of_save_alternating_both_skip_the_gathering(tmp_path):
    outs = run_ranks(cases.alternating_kinds, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["exchanges"] == [1, 1, 0, 0, 0, 0], (rank, out)
        assert all(out["holds"]), (rank, out)
        assert out["kept"] == 2 and out["metadata_kept"] == [rank == 0] * 2, (rank, out)
        assert "holdings" not in out["fields"] and "gathered" not in out["fields"], out


def test_a_rank_that_gathers_does_not_wait_for_the_others_early_copies(tmp_path):
    outs = run_ranks(cases.slow_early_copy, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["error"] is None, (rank, out)
        assert out["took"] < 6, (rank, out)  # at most one slow box: all of them would take >= 7.5 s
        assert out["holds_2"] and out["extra_2"], (rank, out)
