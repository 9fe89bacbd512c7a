"""broadcast_items on 4 real gloo ranks: threshold edges, every dtype (bf16, float8...),
interleaved groups and sources, non-contiguous views, the in-flight cap, receivers left
untouched until their wait, prepare(), supplied/built/reused groups (destroyed on failure
too) and the world-group fallback. All scenarios run in one launch (see broadcast_rank_cases.main_cases); each test
asserts on one scenario's per-rank results. Receivers are poisoned before every scenario.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_broadcast._plan import ALIGN
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import broadcast_rank_cases as cases  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(cases.main_cases, WORLD, timeout=240)


def _scenario(results: list[dict], name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    return per_rank


def test_broadcast_threshold_edges(results):
    per_rank = _scenario(results, "threshold")
    for r in per_rank:
        assert r["stats"]["broadcasts"] == 6
        assert r["stats"]["items"] == 6
        assert r["stats"]["items_batched"] == 2
    assert per_rank[1]["stats"]["bytes_sent"] == 1023 + 1024 + 1025 + 1020 + 1024 + 1028
    assert per_rank[0]["stats"]["bytes_received"] == per_rank[1]["stats"]["bytes_sent"]


def test_broadcast_every_dtype_batched_and_alone(results):
    batched = _scenario(results, "dtypes")
    alone = _scenario(results, "dtypes_unbatched")
    for b, a in zip(batched, alone, strict=True):
        assert a["stats"]["items_batched"] == 0
        assert a["stats"]["broadcasts"] == a["stats"]["items"]
        assert b["stats"]["items"] == a["stats"]["items"]
        # Everything is far below 6 MiB: one batch per (group, source) this rank is in.
        assert b["stats"]["items_batched"] == b["stats"]["items"]
        assert b["stats"]["broadcasts"] < a["stats"]["broadcasts"]


def test_broadcast_interleaved_groups_and_sources(results):
    per_rank = _scenario(results, "interleaved")
    sent = sum(r["stats"]["bytes_sent"] for r in per_rank)
    assert sent > 0 and all(r["stats"]["max_in_flight_seen"] <= 4 for r in per_rank)
    spec_items = cases.interleaved_specs(7, 150)
    for rank, r in enumerate(per_rank):
        assert r["stats"]["items"] == sum(rank in s.ranks for s in spec_items)


def test_broadcast_noncontiguous_direct(results):
    for r in _scenario(results, "noncontig_direct"):
        assert r["stats"]["items_batched"] == 0


def test_broadcast_in_flight_cap(results):
    for r in _scenario(results, "cap"):
        assert r["stats"]["broadcasts"] > 3
        assert r["stats"]["max_in_flight_seen"] == 3
        assert r["max_outstanding"] == 3
        assert r["outstanding_at_end"] == 0
        assert r["max_staging"] <= 4096 * 3
        # Staging buffers are reused once their transfer retired: however many batches the
        # rank takes part in (about 10 here), it allocates at most one per broadcast in
        # flight, besides the two tiny buffers of the byte-range probe (supports_byte_ranges).
        assert r["allocations"] <= 3 + 2 and r["allocated"] <= 4096 * 3 + 3 * ALIGN
    batching = [r for r in _scenario(results, "cap") if r["stats"]["items_batched"]]
    assert batching and all(r["max_staging"] > 0 and r["stats"]["items_batched"] > 3 * 4096 // 200
                            for r in batching)


def test_broadcast_noncontiguous_temporaries_one_at_a_time(results):
    for r in _scenario(results, "noncontig_cap"):
        assert r["stats"]["broadcasts"] == 12
        assert r["max_noncontig"] == 1
        assert r["max_outstanding"] == 4  # the contiguous ones still overlap up to the cap


def test_broadcast_receivers_untouched_until_wait(results):
    per_rank = _scenario(results, "untouched")
    for r in per_rank:
        assert r["stats"]["broadcasts"] == 10 and r["events"] == 20


def test_broadcast_prepare_called_on_source_before_read(results):
    _scenario(results, "prepare")


def test_broadcast_built_groups(results):
    for r in (res["groups"] for res in results):
        built = r["built"]
        assert not built["errors"]
        assert sorted(built["created"]) == built["needed"] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 2, 3), (2, 3)]
        assert built["destroyed"] == len(built["needed"])


def test_broadcast_supplied_groups(results):
    for rank, r in enumerate(res["groups"] for res in results):
        assert not r["supplied"]["errors"]
        assert r["supplied"]["created"] == [] and r["supplied"]["destroyed"] == 0
        assert r["supplied"]["only_supplied"]
        partly = r["partly_supplied"]
        assert not partly["errors"]
        assert partly["created"] == [(0, 3)] and partly["destroyed"] == 1, rank


def test_broadcast_group_manager_reused_and_closed(results):
    for r in (res["groups"] for res in results):
        m = r["manager"]
        assert not m["errors"]
        assert m["created_first"] == m["needed"]
        assert sorted(m["created_total"]) == m["needed_both"]
        assert m["destroyed_inside"] == 0 and m["destroyed"] == len(m["needed_both"])
        failed = r["manager_failure"]
        assert failed["created"] == [(0, 3), (1, 2)] and failed["destroyed"] == 2


def test_broadcast_destroys_built_groups_when_a_broadcast_fails(results):
    for r in (res["groups"]["run_failure"] for res in results):
        assert "injected failure at broadcast 3" in r["failed"]
        assert r["created"] == [(0, 3), (1, 2)] and r["destroyed"] == 2


def test_broadcast_world_group_fallback(results):
    per_rank = _scenario(results, "fallback")
    specs = cases.interleaved_specs(11, 60)
    for rank, r in enumerate(per_rank):
        assert r["new_groups"] == 0 and r["all_world"]
        # Every rank joins every broadcast; it counts only the items it is a member of.
        assert r["broadcasts_seen"] == r["stats"]["broadcasts"] == per_rank[0]["stats"]["broadcasts"]
        assert r["stats"]["items"] == sum(rank in s.ranks for s in specs)
