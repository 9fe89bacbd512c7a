"""Tensor-parallel reads on 2 real gloo ranks (integ_tp_reads_cases): row-parallel
``Shard(1)`` weights and a conv kernel's ``Shard(3)``, from Hugging Face and torch DCP
files, into the saved dtype and through a cast. Short runs are read as covering ranges
(``plan._read_cost``) and copied out of staging; the values must be exactly the saved
ones, and each rank still reads only the bytes it holds (read once across ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_tp_reads_cases as cases  # noqa: E402

WORLD = 2
SCENARIOS = [f"{fmt}/torch.{dtype}" for fmt in ("hf", "dcp") for dtype in ("bfloat16", "float32")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("tp_reads"))
    cases.write(root)
    return run_ranks(cases.tp_reads_cases, WORLD, root, timeout=300, pg_timeout=120)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tp_shards_load_the_saved_values(results: list[dict], scenario: str) -> None:
    errors = [e for r in results for e in r[scenario]["errors"]]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_rank_reads_only_what_it_holds(results: list[dict], scenario: str) -> None:
    for r in results:
        if scenario.startswith("hf"):
            assert r[scenario]["bytes_read"] == r[scenario]["held"]
        else:  # torch DCP: plus the blob headers parsed to find each tensor
            assert r[scenario]["held"] <= r[scenario]["bytes_read"] <= r[scenario]["held"] + 64 * 1024
