"""A rank that holds and wants a replicated piece copies it (integ_transfer_trust_cases,
real gloo ranks): Replicate DTensors and plain tensors passed as both src and dst move
with no broadcast, and a rank without them gets each once from one holder."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_transfer_trust_cases as cases  # noqa: E402


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
