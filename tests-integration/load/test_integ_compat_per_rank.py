"""Tensors under a key of each rank's own (``{"rng": {"dp_rank_<r>": tensor}}``) on 2 real gloo
ranks (integ_compat_per_rank_cases): saved by torch DCP or ``torch_compat``,
each rank loads its own into poisoned targets, as with torch DCP (load refused them, saying
each rank lacked the other's key); a key that no save holds is still refused by name."""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import integ_compat_per_rank_cases as cases  # noqa: E402


def test_each_rank_loads_its_own_per_rank_tensors(tmp_path):
    per_rank = run_ranks(cases.per_rank_tensors, 2, str(tmp_path), timeout=180, pg_timeout=90)
    for rank, r in enumerate(per_rank):
        want = cases._plain(cases._state(rank), rank)
        assert r["torch"] == want, r
        assert r["compat<-torch"] == r["compat"] == r["dcp"] == want, r


def test_a_key_no_rank_saved_is_still_refused(tmp_path):
    per_rank = run_ranks(cases.other_ranks_key, 2, str(tmp_path), timeout=180, pg_timeout=90)
    for message in per_rank:
        assert "rng.dp_rank_7" in message and "validate failed" in message, message


def test_per_rank_values_plain_or_not_reach_torch_and_dcp_loads(tmp_path):
    per_rank = run_ranks(cases.per_rank_values, 3, str(tmp_path), timeout=180, pg_timeout=90)
    for rank, r in enumerate(per_rank):
        assert r["want"][1] == {"epoch": rank, "order": (rank, rank + 1), "done": None}, r
        assert r["torch"] == r["want"], (rank, r)
        assert r["compat"] == r["want"], (rank, r)
        assert r["want"][4] == ["bytearray", b"r%d" % rank], r
    # torch's planner_data names each value's keys as its holder keeps them, whichever rank held it
    planner = per_rank[0]["planner_data"]
    for rank in range(3):
        assert planner[f"sampler.dp_rank_{rank}.epoch"] == ["sampler", f"dp_rank_{rank}", "epoch"], planner
        assert planner[f"np_rng.dp_rank_{rank}"] == ["np_rng", f"dp_rank_{rank}"], planner
