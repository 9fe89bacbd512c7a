"""The MindSpore backend on a real MindSpore cluster: a scheduler plus 2 CPU workers.

One launch (20-30 s here) runs every check in ``platform_rank_cases.mindspore_cases``:
ranks, all_gather_object, asynchronous broadcast over the world group of every dtype and
shape (int64 and bfloat16 bit-exact, 0-dim, odd byte counts as padded int32 words), data
in memory only after wait() / synchronize(), the world-group-only capabilities with
NotImplementedError for subgroups, and views refused as receivers. The launcher's own
failure reporting is checked too. Marked ``mindspore``: run in an environment with
MindSpore (``nox -s tests-mindspore`` or ``.venv-ms``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import RanksFailed, run_mindspore_workers

sys.path.insert(0, str(Path(__file__).parent))
import platform_rank_cases as cases  # noqa: E402

pytestmark = pytest.mark.mindspore


@pytest.fixture(scope="module", autouse=True)
def _needs_mindspore():
    pytest.importorskip("mindspore", reason="MindSpore is not installed in this environment")


def test_mindspore_conformance_on_two_workers():
    per_rank = run_mindspore_workers(cases.mindspore_cases, 2, timeout=240)
    problems = [f"rank {r}: {e}" for r, errors in enumerate(per_rank) for e in errors]
    assert not problems, "\n".join(problems)


def test_run_mindspore_workers_reports_the_failing_rank_and_does_not_hang():
    with pytest.raises(RanksFailed) as info:
        run_mindspore_workers(cases.fail_on_odd_ranks_after_init, 2, timeout=240)
    assert "rank 1 refuses" in info.value.failures[1]
    # rank 0 blocks in a broadcast that rank 1 never joins: it is killed, not waited on.
    assert 0 in info.value.failures
