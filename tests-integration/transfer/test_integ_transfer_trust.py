"""Kept transfer plans release their broadcast groups, and a rank that holds and wants a
replicated piece copies it (integ_transfer_trust_cases, real gloo ranks): a layout that
alternates on one rank leaves the process groups and file descriptors of every rank
bounded (both plans kept and reused); Replicate DTensors and plain tensors passed as both
src and dst move with no broadcast; random sequences of layouts per rank (hypothesis) keep
values exact and groups within the kept plans', and four later plans release them all."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import integ_transfer_trust_cases as cases  # noqa: E402

#: plans kept per process group (dcp_load/transferring/_kept.py MAX_PLANS)
KEPT = 4
#: groups one plan can hold on one rank of 4: the rank sets with it of 2 or 3 ranks (a set
#: of all 4 broadcasts over the default group)
GROUPS_PER_PLAN = 6
#: fds one gloo group of <= 3 ranks holds on each member (measured: a group of 3 of 4
#: ranks added 6 fds on each of its members)
FDS_PER_GROUP = 6


def test_alternating_layout_on_one_rank_keeps_groups_and_fds_bounded():
    calls = 12
    per_rank = run_ranks(cases.alternating, 4, calls, timeout=300, pg_timeout=120)
    for rank, steps in enumerate(per_rank):
        assert all(not s["wrong"] for s in steps), (rank, [s["wrong"] for s in steps])
        settled = steps[1]
        assert all(s["groups"] == settled["groups"] for s in steps[2:]), (rank, [s["groups"] for s in steps])
        assert all(s["fds"] <= settled["fds"] + 2 for s in steps[2:]), (rank, [s["fds"] for s in steps])
        # both layouts' plans are kept on every rank, so from the third call on each is reused
        assert [s["reused"] for s in steps] == [False, False] + [True] * (calls - 2), (rank, steps)


def test_replicated_piece_held_and_wanted_is_copied_not_broadcast():
    mib = 1 << 20
    for rank, steps in enumerate(run_ranks(cases.replicated_both_sides, 2, 2, timeout=300, pg_timeout=120)):
        for s in steps:
            assert not s["wrong"], (rank, s)
            assert (s["received"], s["sent"], s["broadcasts"], s["copied"]) == (0, 0, 0, 2 * mib), (rank, s)
        assert [s["reused"] for s in steps] == [False, True]


def test_replicated_piece_copied_by_holders_and_sent_once_to_the_rank_without_it():
    mib = 1 << 20
    per_rank = run_ranks(cases.replicated_both_sides, 3, 2, timeout=300, pg_timeout=120)
    for step in range(2):
        holders, wanting = [r[step] for r in per_rank[:2]], per_rank[2][step]
        assert all(not s["wrong"] for s in [*holders, wanting]), (step, per_rank)
        assert all(s["copied"] == 2 * mib and s["received"] == 0 for s in holders), (step, holders)
        assert sum(s["sent"] for s in holders) == 2 * mib, (step, holders)  # each tensor once
        assert (wanting["received"], wanting["copied"]) == (2 * mib, 0), (step, wanting)


def _codes(draw_lists):
    """Per step, each rank's layout: rank r alternates (by the drawn bits) between its two
    drawn layouts, so that sequences both reuse and replace plans."""
    pools, picks = draw_lists
    return [[pools[r][bit] for r, bit in enumerate(step)] for step in picks]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.tuples(st.lists(st.lists(st.integers(0, cases.LAYOUTS - 1), min_size=2, max_size=2), min_size=4,
                          max_size=4),
                 st.lists(st.lists(st.integers(0, 1), min_size=4, max_size=4), min_size=4, max_size=10)))
def test_random_layout_sequences_keep_values_exact_and_groups_bounded(drawn):
    codes = _codes(drawn)
    per_rank = run_ranks(cases.sequence, 4, codes, KEPT, timeout=600, pg_timeout=120)
    for rank, r in enumerate(per_rank):
        base_groups, base_fds = r["base"]
        for k, s in enumerate(r["steps"]):
            assert not s["wrong"], (rank, k, codes, s)
            assert s["groups"] <= base_groups + KEPT * GROUPS_PER_PLAN, (rank, k, codes, r)
            assert s["fds"] <= base_fds + (s["groups"] - base_groups) * FDS_PER_GROUP + 4, (rank, k, codes, r)
        # four plans with no subgroup evicted every earlier plan: their groups are all gone
        assert r["end"][0] == base_groups, (rank, codes, r)
        assert r["end"][1] <= base_fds + 4, (rank, codes, r)
