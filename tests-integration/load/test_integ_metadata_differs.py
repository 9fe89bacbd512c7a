"""Ranks that planned from different checkpoint metadata fail together: rank 1 of 4 real
gloo ranks loads a copy of the checkpoint saved in other chunks (a checkpoint re-saved
during a load, or nodes with different copies). Before the check, gloo aborted the process
on the broadcast size mismatch (SIGABRT). Now every rank raises LoadError in the validate
phase, naming rank 1, with every target untouched; for plain tensors (derived planning,
the metadata digest) and for Chunk-annotated ones (gathered planning)."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_metadata_cases as cases  # noqa: E402


def test_different_metadata_on_one_rank_fails_everywhere(tmp_path):
    copies = {"one": str(tmp_path / "one"), "two": str(tmp_path / "two")}
    cases.write(copies["one"], 1)
    cases.write(copies["two"], 2)
    per_rank = run_ranks(cases.differs_cases, 4, copies, timeout=240, pg_timeout=600)
    for rank, out in enumerate(per_rank):
        for case in ("plain", "chunk"):
            got = out[case]
            assert got["raised"] is not None, f"rank {rank} {case}: loaded without noticing"
            assert got["phase"] == "validate" and got["untouched"], (rank, case, got)
            assert 1 in got["ranks"] and got["seconds"] < 30, (rank, case, got)
