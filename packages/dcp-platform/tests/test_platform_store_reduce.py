"""Watch.start_reduce / reduced on 3 real gloo ranks: sums and maxima equal gloo's all-reduce
of the same lanes (negatives, values past 2**40, sums that wrap around int64, 1 to 40 lanes)
and leave no key behind (a lane outside int64 is refused); a
failure published elsewhere and a rank that stays away (``stall_s``) end the wait, with no
collective left pending; ranks that reduce different numbers of lanes fail together; a world
above ``STORE_REDUCE_MAX`` and more lanes than ``STORE_LANES_MAX`` are declined (the caller
all-reduces on the process group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import platform_reduce_cases as cases  # noqa: E402

WORLD = 3


def test_reductions_equal_gloo_and_leave_no_keys():
    for r in run_ranks(cases.values_cases, WORLD, timeout=120, pg_timeout=600):
        assert r["store"] == r["gloo"] and len(r["store"]) == 5
        assert r["store"][-1] == [3 * ((1 << 63) - 2) - (1 << 64), -3 * ((1 << 63) - 2) + (1 << 64)]
        assert "lane 0 is 9223372036854775808, outside int64" in r["past_int64"]
        assert r["left"] == []


@pytest.fixture(scope="module")
def failures() -> list[dict]:
    return run_ranks(cases.failure_cases, WORLD, timeout=120, pg_timeout=600)


def test_a_published_failure_ends_the_wait(failures):
    for rank in (0, 2):
        got = failures[rank]["abort"]
        assert got["error"] == {1: ("boom on rank 1",)} and got["seconds"] < 2.0, got


def test_a_rank_that_stays_away_is_bounded_by_the_stall(failures):
    for rank in (0, 1):
        got = failures[rank]["stall"]
        assert got["error"] is not None and 0.9 < got["seconds"] < 3.0, got
        (causes,) = got["error"].values()
        assert "in a reduction of t/stall" in causes[0], causes
        assert failures[rank]["interrupted"] is False  # nothing pending in the process group
    assert failures[2]["stall"]["error"] is not None


def test_different_lane_counts_fail_every_rank(failures):
    texts = [str(r["widths"]["error"]) for r in failures]
    assert all(t != "None" for t in texts), texts
    assert sum("different numbers of lanes: [1, 2, 3]" in t for t in texts) == WORLD, texts


def test_a_large_world_is_declined():
    assert all(r["declined"] for r in run_ranks(cases.large_world_case, WORLD, timeout=60))


def test_ready_asks_the_store_at_most_once_per_pause():
    # async_save asks between the boxes it copies: thousands of asks, not thousands of round trips
    import time

    import torch.distributed as dist
    from dcp_platform._store_reduce import StoreReduction

    class Counting:
        def __init__(self) -> None:
            self.inner, self.checks = dist.HashStore(), 0

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def check(self, keys):
            self.checks += 1
            return self.inner.check(keys)

    store = Counting()
    reduction = StoreReduction(store, "t/ready/r/1", 0, 2, [1, 2], "sum", 0.0001)  # rank 1 has not come in
    start = time.monotonic()
    asks = sum(not reduction.ready() for _ in range(20000))
    took = time.monotonic() - start
    assert asks == 20000 and store.checks <= took / (2 * 0.00025) + 2, (store.checks, took)
    StoreReduction(store, "t/ready/r/1", 1, 2, [3, 4], "sum", 0.0001)  # rank 1 comes in, reduces
    time.sleep(0.001)
    assert reduction.ready() and reduction.result(lambda: None, lambda start: None) == [4, 6]
