"""A derived plan's reads are checked before the digest exchange, which then also carries
whether any rank's checks failed (2 real gloo ranks, replicated DTensors loaded read once,
so that each saved chunk is read by one rank):

* checks that pass (a Hugging Face checkpoint of two files): the load makes no validate exchange (the digest all-reduce and the
  finish one only) and loads every value;
* a torch DCP data file whose blobs cannot be parsed (found only by the checks of the rank
  that reads it): every rank raises the same ``LoadError`` in phase validate naming that
  rank, and nothing was written (the destinations stay poisoned);
* the digest all-reduce waits through the others' preparing and checking: its bound is
  two steps' (a rank taking 0.7 s for each under a 1 s bound still loads).
"""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "_support"))  # helpers shared by several areas
sys.path.insert(0, os.path.dirname(__file__))

import integ_checks_with_plan_cases as cases  # noqa: E402


def test_checks_that_pass_need_no_exchange_of_their_own(tmp_path):
    root = str(tmp_path / "hf")
    cases.write(root)
    for rank, out in enumerate(run_ranks(cases.load_counting, 2, root, timeout=120)):
        assert out["error"] is None, (rank, out)
        assert out["phases"] == ["execute"], (rank, out)  # the finish exchange only
        n = cases.SHAPE[0] * cases.SHAPE[1]
        assert out["values"] == {"a": (False, 1.0 * n), "b": (False, 2.0 * n)}, (rank, out)


def test_a_check_failing_on_one_rank_fails_every_rank_before_any_write(tmp_path):
    root = str(tmp_path / "dcp")
    run_ranks(cases.save_torch_dcp, 2, root, timeout=120)
    assert cases.break_blob_directories(os.path.join(root, "__1_0.distcp")) >= 1
    outs = run_ranks(cases.load_counting, 2, root, timeout=120)
    ranks = {tuple(o["error"]["ranks"]) for o in outs if o["error"]}
    for rank, out in enumerate(outs):
        err = out["error"]
        assert err and err["type"] == "LoadError" and err["phase"] == "validate", (rank, out)
        assert "__1_0.distcp" in err["message"], (rank, out)
        assert out["phases"] == ["validate"], (rank, out)  # the exchange that names the failure
        assert out["values"] == {"a": (True, 0.0), "b": (True, 0.0)}, (rank, out)  # nothing written
    assert len(ranks) == 1 and len(next(iter(ranks))) == 1, ranks  # the rank that reads that file


def test_the_digest_wait_is_bounded_per_step_not_for_both(tmp_path):
    root = str(tmp_path / "hf")
    cases.write(root)
    for rank, out in enumerate(run_ranks(cases.slow_prepare_and_checks, 2, root, timeout=120)):
        assert out["first"]["error"] is None and out["next"]["error"] is None, (rank, out)


def test_reads_are_checked_and_values_read_once_per_load(tmp_path):
    root = str(tmp_path / "native")
    run_ranks(cases.save_native, 2, root, timeout=120)
    for host_ids in (False, True):  # the guessed plan used, and not made (hosts named per rank)
        for rank, out in enumerate(run_ranks(cases.count_checks, 2, root, host_ids, timeout=120)):
            assert out["error"] is None and out["step"] == 7, (host_ids, rank, out)
            assert out["counts"]["read_value"] == 1, (host_ids, rank, out)
            assert out["counts"]["check_chunk"] <= 1, (host_ids, rank, out)  # read once: one chunk per rank
