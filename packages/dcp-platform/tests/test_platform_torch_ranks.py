"""The torch backend on real gloo ranks (file:// store, explicit timeouts), 2 and 4 ranks.

One launch per world size runs every check in ``platform_rank_cases.torch_cases``: ranks
and world size, all_gather_object, asynchronous broadcast of every dtype (float32, bf16,
fp16, int64, bool, float8 through the byte view...) and shape (0-dim, odd byte counts)
from every source with several in flight, non-contiguous senders and receivers, the
non-contiguous subgroup (0, 3) with non-members untouched, creating, reusing, destroying
and re-creating groups. Receivers are poisoned before every receive.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import RanksFailed, run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import platform_rank_cases as cases  # noqa: E402


@pytest.mark.parametrize("world", [2, 4])
def test_torch_conformance_on_gloo_ranks(world):
    per_rank = run_ranks(cases.torch_cases, world, timeout=120, pg_timeout=60)
    problems = [f"rank {r}: {e}" for r, errors in enumerate(per_rank) for e in errors]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_refuses_what_is_not_plain_data_on_every_rank(world, tmp_path):
    marker = str(tmp_path / "code-ran")
    per_rank = run_ranks(cases.gather_refusal_cases, world, marker, timeout=120, pg_timeout=60)
    problems = [f"rank {r}: {e}" for r, errors in enumerate(per_rank) for e in errors]
    assert not problems, "\n".join(problems)


def test_run_ranks_reports_each_failing_rank():
    with pytest.raises(RanksFailed) as info:
        run_ranks(cases.fail_on_odd_ranks, 2, timeout=60)
    assert list(info.value.failures) == [1]
    assert "rank 1 refuses" in info.value.failures[1]
