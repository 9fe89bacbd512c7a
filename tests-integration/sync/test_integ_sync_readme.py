"""The weight-sync example of docs/transfer.md ("Weight sync between two jobs"),
run as written (with a free port for 29600): its trainer half in a 1-rank job, its engine
half in a 2-rank job, launched apart (integ_sync_readme_cases). The engine's TP shards (a
fused qkv with groups and a column-split o_proj) are poisoned with NaN before the transfer
and must hold exactly the trainer's values after it."""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_sync_readme_cases as cases  # noqa: E402


def test_the_readme_weight_sync_example_runs_on_two_launched_jobs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_ranks, cases.job, 1, "trainer", port, timeout=120)
        engine = pool.submit(run_ranks, cases.job, cases.TP, "engine", port, timeout=120)
        assert trainer.result() == [None]
        assert engine.result() == [[], []]  # every shard exact, on both engine ranks
