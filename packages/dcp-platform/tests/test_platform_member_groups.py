"""``new_member_group`` on 3 real gloo ranks: overlapping groups made by their members
alone in one sorted order carry broadcasts (twice, under new names), bad rank lists raise
``ValueError`` naming them; without a process group it is unsupported, not a no-op."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import platform_member_cases as cases  # noqa: E402


def test_member_groups_on_gloo_ranks():
    per_rank = run_ranks(cases.member_cases, 3, timeout=120, pg_timeout=60)
    for rank, r in enumerate(per_rank):
        assert r["capable"] and not r["errors"], r
        want = {f"{n}{s}": 100 * n + sum(s) for n in range(2)
                for s in [(0, 1), (0, 2), (1, 2), (0, 1, 2)] if rank in s}
        assert r["got"] == want
        assert "got [1, 0]" in r["messages"][0] and "only members call it" in r["messages"][3]


def test_member_groups_need_a_process_group():
    pytest.importorskip("torch")
    from dcp_platform._torch import TorchPlatform

    p = TorchPlatform()
    assert not p.capabilities.member_groups
    with pytest.raises(NotImplementedError, match="'torch' platform does not support groups created by their members"):
        p.new_member_group([0], "x")
