"""``transfer``'s ``sources=`` on real gloo ranks: the same mapping built in another key
order on each rank is the same setting (the ranks transfer), while a mapping that differs
is refused on every rank, naming the rank and ``sources``."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_sources_order_cases as cases  # noqa: E402


def test_the_same_sources_in_another_key_order_transfer() -> None:
    orders = [[("x", "a"), ("y", "b")], [("y", "b"), ("x", "a")]]
    per_rank = run_ranks(cases.transfer_with, 2, orders, timeout=240, pg_timeout=120)
    assert per_rank == [{"filled": {"x": "a", "y": "b"}}] * 2, per_rank


def test_sources_that_differ_are_refused_on_every_rank() -> None:
    orders = [[("x", "a"), ("y", "b")], [("y", "a"), ("x", "b")]]
    per_rank = run_ranks(cases.transfer_with, 2, orders, timeout=240, pg_timeout=120)
    for out in per_rank:
        err = out.get("error", "")
        assert err.startswith("LoadError") and "rank 1" in err and "sources" in err, out
        assert "sources={'x': 'b', 'y': 'a'} (rank 0: {'x': 'a', 'y': 'b'})" in err, out
        assert "every rank must pass the same settings" in err, out
