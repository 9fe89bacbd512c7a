"""Each stored byte is fetched once per job when resharding torch DCP's own files: an
FSDP-style checkpoint (``Shard(0)`` over 4 ranks, saved by torch.distributed.checkpoint's
``FileSystemWriter``: every chunk a ``torch.save`` blob in a ``.distcp`` file) loaded by 4
real gloo ranks on two simulated nodes into DP2 x TP2 DTensors (row-parallel ``Shard(1)``
halves of every saved chunk, a torchtitan-like mix) and into partly overlapping boxes.
Storage bytes summed over ranks (``/proc/self/io`` read_bytes, page cache dropped before
each load) stay within 1.02 x the unique bytes, in the default ``"auto"`` mode and with
``True``, and so do the reader's own byte counts with ``True`` (one reader per box in the
job; ``"auto"`` re-reads within a host from the page cache): boxes are read narrowed
inside the blobs, not by loading whole blobs. Every value is checked
(integ_read_once_cases)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_read_once_cases as cases  # noqa: E402
import integ_read_once_torch_dcp_cases as saver  # noqa: E402


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    try:
        cases.read_bytes()
    except (OSError, RuntimeError):
        pytest.skip("/proc/self/io read_bytes is not available here: storage reads cannot be counted")
    root = tmp_path_factory.mktemp("read_once_torch_dcp")
    first = str(root / "node0" / "ckpt")  # each node's copy under one name, as ranks compare it
    run_ranks(saver.save_fsdp, 4, first, timeout=300, pg_timeout=240)
    assert sorted(f for f in os.listdir(first) if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    second = str(root / "node1" / "ckpt")
    shutil.copytree(first, second)
    return [first, second]


@pytest.mark.parametrize("mode", ["auto", True])
def test_fsdp_torch_dcp_files_are_fetched_once_per_job(copies, mode):
    per_rank = run_ranks(cases.read_once_cases, 4, copies, mode, timeout=300, pg_timeout=240)
    for case in per_rank[0]:
        unique, detail = cases.assert_fetched_once(per_rank, case, mode)
        reader = sum(r[case]["reader_bytes"] for r in per_rank)
        if mode is not True:
            continue  # "auto" re-reads within a host by design: the page cache serves those reads
        assert reader <= 1.02 * unique, (
            f"{case} ({mode}): the readers counted {reader} bytes for {unique} unique "
            f"({reader / unique:.3f} x): {detail}")
