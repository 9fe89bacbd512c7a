"""dcp_load.load on 8 real gloo ranks as pp2 x dp2 x tp2: the two pipeline stages hold
different keys, and the tied embedding is held by both stages; every byte needed is read
once (read amplification 1.00) and every value arrives (targets poisoned first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_load_cases as cases  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("pp8")
    names = cases.NAMES
    ckpts = {"hf": str(root / "hf"), "tp4": str(root / "tp4")}
    cases.write_hf(ckpts["hf"], names)
    cases.write_native(ckpts["tp4"], names, lambda n: (1, 4)[: len(cases.SPECS[n][0])] if len(cases.SPECS[n][0]) == 2
                       else (4,)[: len(cases.SPECS[n][0])])
    return run_ranks(cases.pp8_cases, 8, ckpts, timeout=300, pg_timeout=120)


@pytest.mark.parametrize("placements", ["RS0", "S0S1", "RR"])
@pytest.mark.parametrize("src", ["hf", "tp4"])
def test_pipeline_stages_and_tied_weight(results, placements, src):
    per_rank = [r[f"pp_{placements}_{src}"] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    reports = [r["out"] for r in per_rank]
    unique = sum(cases.full(n).numel() * cases.full(n).element_size()
                 for n in set(cases.STAGES[0]) | set(cases.STAGES[1]))
    assert all(r["job_unique_bytes"] == unique for r in reports)
    assert sum(r["bytes_read"] for r in reports) == unique  # the tied weight too is read once
    # the tied embedding is wanted by both stages: some rank of one stage receives from the other
    assert all(r["bytes_needed"] == r["bytes_read"] + r["bytes_received"] for r in reports)
