"""``process_group=`` on 4 real gloo ranks (integ_groups_cases): load, save, async_save and
transfer within a sub-group whose ranks are not 0..n-1, while two other ranks load on a
group of their own and nothing touches the default group; a separate gloo checkpoint group
with a training all-reduce on the default group during the commit; a sub-group load reads
each byte once within the group; bad input (a group without this rank, a reader dcp cannot
serve, a Stateful whose state_dict() raises) fails every rank at once, naming it."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
sys.path.insert(0, str(Path(__file__).parent))
import integ_groups_cases as cases  # noqa: E402


def test_sub_group_operations_stay_within_it(tmp_path):
    per_rank = run_ranks(cases.sub_group, 4, str(tmp_path), timeout=300, pg_timeout=240)
    for rank in (1, 3):
        r = per_rank[rank]
        assert r["first_bad"] == r["second_bad"] == r["transfer_bad"] == [], r
        first = r["first"]
        assert (first["rank"], first["world"]) == ((0, 2) if rank == 1 else (1, 2)), first
        assert first["job_fetched"] == first["unique"], first  # each byte once within the group
        assert r["saved"]["world"] == 2 and r["transfer"] == {"world": 2, "rank": first["rank"]}
    assert per_rank[1]["first"]["received"] + per_rank[3]["first"]["received"] > 0  # replicas travelled
    assert per_rank[0]["other_ok"] and per_rank[2]["other_ok"]
    assert all(r["world_ok"] for r in per_rank)


def test_separate_checkpoint_group(tmp_path):
    per_rank = run_ranks(cases.checkpoint_group, 4, str(tmp_path), timeout=300, pg_timeout=240)
    for rank, r in enumerate(per_rank):
        assert r["bad"] == [] and r["allreduce"] == [4.0] * 4 and r["rank"] == rank, r
        assert r["fetched"] == r["unique"], r


def test_bad_input_fails_every_rank_at_once(tmp_path):
    per_rank = run_ranks(cases.bad_inputs, 4, str(tmp_path), timeout=300, pg_timeout=240)
    for rank, r in enumerate(per_rank):
        if rank in (2, 3):
            assert f"(global rank {rank}) is not a member of the group" in r["not_member"], r
        kind, text, seconds = r["reader"]
        assert "QuantizedHuggingFaceStorageReader cannot be served" in text and seconds < 30, r
        assert kind == ("TypeError" if rank == 1 else "LoadError") and r["reader_untouched"]
        kind, text, seconds = r["stateful"]
        assert "'extra': " in text and "Raises.state_dict() raised KeyError" in text and seconds < 30, r
        assert r["nothing_written"] and r["next_ok"], r
