"""broadcast_items on 4 real gloo ranks, repeated and misused: no threads, OS threads or
process groups leak over 20 repetitions, and ranks whose schedules differ (an item's size,
an extra item, batch_bytes, an invalid tensor on one rank) raise ScheduleMismatchError on
every rank, naming the first differing item, instead of hanging. One launch for all.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import broadcast_rank_cases as cases  # noqa: E402

WORLD = 4
REPETITIONS = 20


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # Generous bounds for a loaded 2-core machine; a hang would still end at the timeout.
    return run_ranks(cases.lifecycle_cases, WORLD, REPETITIONS, timeout=240, pg_timeout=120)


def test_broadcast_no_leaks_after_repetitions(results):
    for r in (res["leaks"] for res in results):
        assert not r["errors"]
        python_threads, os_threads, groups = r["before"]
        assert r["after"] == (python_threads, os_threads, groups), r
        assert r["platform_groups"] == 0


@pytest.mark.parametrize("name, index", [("nbytes", 5), ("extra_item", 12), ("batch_bytes", None)])
def test_broadcast_schedule_mismatch_raises_on_every_rank(results, name, index):
    per_rank = [res["mismatch"][name] for res in results]
    assert all(r is not None for r in per_rank), f"{name}: some rank did not raise"
    assert {r["index"] for r in per_rank} == {index}
    assert len({r["message"] for r in per_rank}) == 1
    message = per_rank[0]["message"]
    if name == "nbytes":
        assert "item 5" in message and "nbytes=396" in message and "nbytes=60" in message
    if name == "extra_item":
        assert "item 12" in message and "shorter" in message
    if name == "batch_bytes":
        assert "(1024, 8)" in message and "(2048, 8)" in message


def test_broadcast_invalid_item_fails_every_rank(results):
    per_rank = [res["mismatch"]["invalid"] for res in results]
    assert all(r is not None for r in per_rank)
    for r in per_rank:
        assert list(r["errors"]) == [0]
        assert "item 0" in r["message"] and "4000 bytes" in r["message"]


def test_broadcast_ranks_in_step_after_mismatch(results):
    for res in results:
        assert not res["mismatch"]["after"]["errors"]
