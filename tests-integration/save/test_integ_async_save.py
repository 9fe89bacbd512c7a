"""``async_save`` on 4 real gloo ranks (DP2 x TP2 DTensors, a plain tensor, values):

* the snapshot: every tensor and value is changed right after the call returns, and the
  checkpoint holds the values at the call; each rank staged only the boxes it writes;
* the commit does not use the training loop's communicator: all-reduces on the default
  group run while the save commits (rank 1's write is slowed), and neither waits;
* a load of the same directory while the write runs loads the old or the new save, whole;
* a second async_save into the directory while the first writes waits for it; six saves in
  a row leave RSS within 48 MiB and no thread behind;
* a rank whose write fails makes every rank's future raise naming it; the old checkpoint
  loads; the next save works.
"""

from __future__ import annotations

import os
import sys

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "_support"))  # helpers shared by several areas
sys.path.insert(0, os.path.dirname(__file__))

import integ_async_save_cases as cases  # noqa: E402


def test_the_checkpoint_holds_the_values_at_the_call_while_training_goes_on(tmp_path):
    outs = run_ranks(cases.snapshot_while_training, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["holds_2"], rank
        assert not out["done_at_return"] and out["steps_while_saving"] >= 5, out
        rep = out["report"]
        assert rep["staged_bytes"] == rep["bytes_written"] < out["held"], out  # only what this rank writes
        assert out["threads"] == [], out
    job = sum(cases.full(2, n).nbytes for n in cases.NAMES) + cases.full(2, "bias").nbytes
    assert sum(o["report"]["bytes_written"] for o in outs) == job  # each replicated box written once


def test_a_load_while_the_save_writes_sees_one_whole_save(tmp_path):
    outs = run_ranks(cases.load_while_writing, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for out in outs:
        assert len(out["during"]) == 1 and out["during"] == outs[0]["during"], outs
        assert out["after"], out


def test_overlapping_saves_wait_in_call_order_and_repeated_saves_do_not_grow(tmp_path):
    outs = run_ranks(cases.overlapping_saves, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for out in outs:
        assert out["first_done_when_second_returned"], out  # the second waited for the first
        assert out["holds_2"] and out["holds_8"], out
        assert max(out["rss"]) - out["rss"][0] < 48 * 2**20, out["rss"]
        assert out["threads"] == [], out


def test_a_rank_that_fails_while_writing_fails_every_future_and_keeps_the_old_checkpoint(tmp_path):
    outs = run_ranks(cases.failing_rank, 4, str(tmp_path), timeout=300, pg_timeout=120)
    for out in outs:
        err = out["error"]
        assert err is not None and err["type"] == "LoadError" and err["ranks"] == [2], out
        assert "No space left on device" in err["message"] and "rank 2" in err["message"], err
        assert out["unchanged"] and out["holds_1"] and out["holds_3"], out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
