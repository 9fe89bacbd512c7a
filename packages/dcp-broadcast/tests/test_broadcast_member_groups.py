"""GroupManager.ensure(own=True) on 4 real gloo ranks, each passing only the overlapping
rank sets it belongs to: every group is made by its members alone (no all-gather and no
world-wide new_group while ensuring), in one sorted order that cannot deadlock, with and
without a Watch (whose store barrier members meet at before connecting), and each group
carries a broadcast from its highest rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import broadcast_member_cases as cases  # noqa: E402

WORLD = 4


@pytest.mark.parametrize("with_watch", [False, True], ids=["plain", "watched"])
def test_groups_are_made_by_their_members_alone(with_watch):
    results = run_ranks(cases.member_cases, WORLD, with_watch, timeout=120, pg_timeout=60)
    for rank, r in enumerate(results):
        mine = [s for s in cases.SETS if rank in s]
        assert r["capable"]
        assert r["ensured"] == {"gather": 0, "new_group": 0, "new_member_group": len(mine)}, r
        assert r["created"] == [list(s) for s in sorted(mine)]
        assert r["got"] == {repr(s): s[-1] * 10 + len(s) for s in mine}
        assert r["closed"]["gather"] == 1  # close() syncs every rank once before destroying
