"""Versions, atomic plain syncs and the ``on_synced`` hook between two jobs launched apart
(integ_sync_versions_cases: 2 trainer ranks, 2 engine ranks, real gloo):

* the version a sync carries (passed, or the group's count) is what ``TransferReport.version``
  and ``dcp_load.synced_version`` read on the engine, whole ``dst`` or per tensor;
* a rank passing another version is refused on every rank, naming it and both values,
  before any destination is written (they stay poisoned, their version unchanged);
* ``on_synced`` is called once per successful sync on each rank that passes it, with the
  names written (under ``delta=True`` the changed ones only), after the version is recorded,
  never after a failed sync; a hook that raises on one engine rank raises there with a note,
  the other ranks return, and the next sync works;
* a plain sync failing part way: with ``atomic=True`` every engine destination keeps the old
  version bit for bit; without, the error names exactly the destinations written before the
  failure (``LoadError.torn``: the first round's whole and the second's part), the others
  keep the old version, the torn ones read version None; the next sync repairs them all.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_sync_versions_cases as cases  # noqa: E402
from ports import free_ports  # noqa: E402

SIZES = (2, 2)
EVERY = ["a", "b", "c"]


def run_jobs(fn: Any, *args: Any, ports: int = 1) -> tuple[list[Any], list[Any]]:
    """``fn`` on a trainer job and an engine job launched apart, with ``ports`` free ports."""
    found = free_ports(ports)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_ranks, fn, n, side, found[0], SIZES, *found[1:], *args, timeout=240, pg_timeout=240)
                for side, n in zip(("trainer", "engine"), SIZES, strict=True)]
        return jobs[0].result(), jobs[1].result()


def test_versions_are_read_back_refused_when_they_differ_and_the_hook_follows_success_only():
    trainer, engine = run_jobs(cases.versions_and_hook)
    for side, per_rank in (("trainer", trainer), ("engine", engine)):
        for rank, r in enumerate(per_rank):
            who = (side, rank, r)
            assert r["passed"] == {"version": 7, "changed": EVERY if side == "engine" else []}, who
            error = r["mismatch"]["error"]
            assert r["mismatch"]["phase"] == "validate" and "rank 3: transfer: version=9" in error, who
            assert "ranks 0-2 have version=8" in error and "No destination tensor was changed" in error, who
            # the version the group counts on from: 7 (the refused call committed nothing)
            assert r["counted_first"] == {"version": 8, "changed": EVERY if side == "engine" else []}, who
            assert r["counted_delta"] == {"version": 9, "changed": ["a", "b"] if side == "engine" else []}, who
            assert r["after_raise"] == {"version": 50, "changed": EVERY if side == "engine" else []}, who
            hooked = [(label, names) for label, names, _ in r["calls"]]
            want = [(label, [] if side == "trainer" else names) for label, names in
                    (("passed", EVERY), ("counted_first", EVERY), ("counted_delta", ["a", "b"]), ("raises", EVERY),
                     ("after_raise", EVERY))]
            assert hooked == want, who  # once per successful sync, never for the refused one
            if side == "trainer":
                assert r["raises"] == {"version": 40, "changed": []}, who
    for rank, r in enumerate(engine):
        who = (rank, r)
        assert r["held_passed"] == EVERY and r["versions_passed"] == {"all": 7, "a": 7, "b": 7, "c": 7}, who
        assert r["poisoned"] and r["versions_mismatch"] == r["versions_passed"], who
        assert r["held_counted_first"] == EVERY and r["versions_counted_first"]["all"] == 8, who
        assert r["held_counted_delta"] == EVERY and r["versions_counted_delta"] == {"all": 9, "a": 9, "b": 9, "c": 9}, who
        # the hook sees the new version already recorded
        assert [v for _, _, v in r["calls"]] == [7, 8, 9, 40, 50], who
        assert r["held_raises"] == r["held_after_raise"] == EVERY, who
        if rank == 1:  # its hook raised: the hook's own error, with a note; the sync itself succeeded
            raised = r["raises"]
            assert raised["raised"] == "injected: the engine's post-processing failed", who
            assert "on_synced raised on rank 3 after the transfer of version 40 succeeded on every rank" in \
                raised["notes"][0], who
        else:
            assert r["raises"] == {"version": 40, "changed": EVERY}, who


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_a_plain_sync_failing_part_way(atomic):
    trainer, engine = run_jobs(cases.plain_fails_midway, atomic, ports=2)
    for side, per_rank in (("trainer", trainer), ("engine", engine)):
        for rank, r in enumerate(per_rank):
            who = (side, rank, r)
            assert r["step1"] == {"version": 1, "changed": EVERY if side == "engine" else []}, who
            error = r["step2"]["error"]
            assert r["step2"]["phase"] == "execute" and "rank 1" in error and "injected" in error, who
            assert r["hooked"] == [EVERY if side == "engine" else []], who  # step 1's only
            assert r["step3"] == {"version": 3, "changed": EVERY if side == "engine" else []}, who
            if atomic:
                assert "transfer(atomic=True): no destination was written" in error and not r["step2"]["torn"], who
    for rank, r in enumerate(engine):
        who = (rank, r)
        assert r["held1"] == EVERY and r["versions1"]["all"] == 1, who
        torn = r["step2"]["torn"]
        if atomic:
            assert r["held2"] == EVERY and r["versions2"] == {"all": 1, "a": 1, "b": 1, "c": 1}, who
        else:
            # round 1 ("a") ran whole, round 2 ("b") had started, round 3 ("c") never did
            assert torn == ["a", "b"], who
            assert "Torn on this rank (2 of 3 destinations" in r["step2"]["error"], who
            # "a" holds step 2 whole; "b" received part of it (trainer rank 0's rows, as the
            # failure came) and is named either way; "c" holds step 1
            assert "a" in r["new2"] and "c" in r["held2"] and "a" not in r["held2"], who
            assert r["versions2"] == {"all": None, "a": None, "b": None, "c": 1}, who
        # the next sync (delta=True, over a new group) sends everything: all repaired
        assert r["held3"] == EVERY and r["versions3"] == {"all": 3, "a": 3, "b": 3, "c": 3}, who
