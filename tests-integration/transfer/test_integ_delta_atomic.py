"""A ``delta=True`` transfer that fails part way on ranks that send and receive
(integ_delta_atomic_cases): neither the pieces received nor a rank's copies of its own
pieces are written, every destination keeps the previous step bit for bit, and a transfer
over a new process group sends everything and gives the next step exactly."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
sys.path.insert(0, str(Path(__file__).parent))
import integ_delta_atomic_cases as cases  # noqa: E402


def test_a_failed_delta_transfer_writes_neither_copies_nor_received_pieces():
    per_rank = run_ranks(cases.colocated_delta_fails, 2, timeout=180, pg_timeout=120)
    for rank, r in enumerate(per_rank):
        assert r["matches1"] == ["a", "b", "c"] and r["step1"]["copied"] > 0, (rank, r)
        assert "step2" not in r and "rank 1" in r["error2"] and "no destination was written" in r["error2"], r
        assert r["matches2"] == ["a", "b", "c"], (rank, r)  # own half ("a" copied) and the other's: step 1
        step3 = r["step3"]
        assert step3["copied"] + step3["received"] == step3["kept"] and r["matches3"] == ["a", "b", "c"], r
