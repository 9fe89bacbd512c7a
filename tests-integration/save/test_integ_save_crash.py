"""A save never leaves a directory without a whole checkpoint. On 2 real gloo ranks, saves
that fail (boxes that overlap between the ranks, global shapes that differ, a disk that
fills on one rank) raise on every rank and leave the old checkpoint and its files as they
were. Then the CI subset of the save-crash trials (save_crash.py): savers SIGKILLed at
random points of saves and overwrites (``save``, and ``async_save`` whose savers change
every tensor once it returns), by one process and by 2 gloo ranks, after which the
directory holds the old checkpoint or the new one, whole and exact, or none when there was
none. The 200-kill run is benchmarks/save/save_crash.py."""

from __future__ import annotations

import os
import sys

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "_support"))  # helpers shared by several areas
sys.path.insert(0, os.path.dirname(__file__))

import integ_save_cases as cases  # noqa: E402
import save_crash as sc  # noqa: E402

KILLS = int(os.environ.get("DCP_SAVE_CRASH_KILLS", "8"))


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(cases.refused_saves, 2, str(tmp_path_factory.mktemp("refused")), timeout=200, pg_timeout=60)


@pytest.mark.parametrize(("case", "words"), [("overlap", "do not tile"), ("shapes", "global shape"),
                                             ("disk_full", "No space left on device")])
def test_a_failed_two_rank_save_keeps_the_old_checkpoint(refused, case, words):
    for out in refused:
        err = out[case]["error"]
        assert err is not None and err["type"] == "LoadError" and words in err["message"], err
        assert out[f"{case}_after"] == out["before"]  # nothing added, nothing removed
    assert refused[0]["check"] == ("old", "")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_saves_leave_one_whole_checkpoint(mode):
    result = sc.run_trials(KILLS, log=print, mode=mode)
    print(result["counts"])
    assert not result["failures"], "\n".join(result["failures"])
    assert result["counts"].get("killed", 0) >= KILLS // 2  # most kills land inside a save


def test_a_load_never_mixes_two_saves_of_values(tmp_path):
    outs = run_ranks(cases.load_during_overwrite, 2, str(tmp_path), timeout=200, pg_timeout=60)
    if all(o["error"] is None for o in outs):  # both read one save: fine
        assert outs[0]["dest"] == outs[1]["dest"], [o["dest"] for o in outs]
    else:  # or every rank refuses, saying why
        assert all(o["error"] and "metadata differs" in o["error"]["message"] for o in outs), outs


def test_ranks_that_name_different_directories_are_refused_before_writing(tmp_path):
    outs = run_ranks(cases.relative_from_two_cwds, 2, str(tmp_path), timeout=200, pg_timeout=60)
    for out in outs:
        err = out["error"]
        assert err is not None and "every rank must pass the same directory" in err["message"], err
        assert str(tmp_path / "cwd1" / "ckpt") in err["message"] and out["unchanged"]
    assert outs[1]["elsewhere"] == []  # no data file written into the other directory
