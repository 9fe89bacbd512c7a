"""Each stored byte is fetched once per job, measured at the block device: 4 real gloo
ranks on two simulated nodes (each reading its own copy of the files, page cache dropped
before each load), DP2 x TP2 DTensors with row-parallel ``Shard(1)`` halves (both halves
of a row share its pages), a torchtitan-like mix, and boxes that overlap partly. The
storage bytes summed over ranks (``/proc/self/io`` read_bytes) stay within 1.02 x the
unique bytes, in the default ``"auto"`` mode and with ``True``, with the row-parallel halves
copied out of memory maps (the default for short runs); every value is checked."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_read_once_cases as cases  # noqa: E402


def _io_counts_reads() -> bool:
    try:
        return cases.read_bytes() >= 0
    except (OSError, RuntimeError):
        return False


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    if not _io_counts_reads():
        pytest.skip("/proc/self/io read_bytes is not available here: storage reads cannot be counted")
    root = tmp_path_factory.mktemp("read_once")
    # Each node's copy keeps the checkpoint's directory name, as on a cluster: a different
    # name is a different checkpoint (the metadata digest every rank compares).
    first = str(root / "node0" / "ckpt")
    cases.write_checkpoint(first)
    second = str(root / "node1" / "ckpt")
    shutil.copytree(first, second)
    return [first, second]


@pytest.mark.parametrize("mode", ["auto", True])
def test_each_stored_byte_is_fetched_once_per_job(copies, mode):
    per_rank = run_ranks(cases.read_once_cases, 4, copies, mode, timeout=300, pg_timeout=240)
    for case in per_rank[0]:
        cases.assert_fetched_once(per_rank, case, mode)
        assert any(r[case]["received"] for r in per_rank), f"{case}: nothing was broadcast between nodes"
    # row-parallel halves (1 KiB runs) are copied out of memory maps by default: their page
    # faults are within the bound above
    assert all(sum(r[case]["mapped"] for r in per_rank) > 0 for case in ("row_parallel", "dp2_tp2")), per_rank
