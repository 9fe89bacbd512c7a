"""FSDP2 + TP state dicts (torchtitan's layout) on 4 real gloo ranks: a decoder sharded with
``parallelize_module`` over tp and ``fully_shard`` over dp, with AdamW state, saved by
torch.distributed.checkpoint and by dcp_load.save, loaded into the same layout, TP only,
FSDP only and one process. Every value, model and optimizer, must equal what
torch.distributed.checkpoint.load gives for the same poisoned destination. Also DTensor
edge cases: a _StridedShard whose rows are not contiguous (several boxes per rank), a
Partial placement (clear error on every rank), a mesh that leaves out ranks 2 and 3 (they
skip it and report it). One launch runs every scenario (integ_fsdp2_tp_cases).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_fsdp2_tp_cases as cases  # noqa: E402

WORLD = 4
SCENARIOS = [f"{layout}<-{source}" for source in ("torch", "native") for layout in ("fsdp_tp", "tp", "fsdp", "single")]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(cases.fsdp2_tp_cases, WORLD, str(tmp_path_factory.mktemp("fsdp2tp")), timeout=300, pg_timeout=120)


def _ok(results: list[dict], key: str) -> None:
    errors = [f"rank {r}: {e}" for r, res in enumerate(results) for e in res[key]["errors"]]
    assert not errors, "\n".join(errors)


def test_the_layout_is_torchtitans_strided_shard(results: list[dict]) -> None:
    placements = results[0]["placements"]
    assert placements["model.layers.0.wq.weight"] == "[_StridedShard(dim=0, sf=2), Shard(dim=0)]"
    assert placements["model.layers.0.wo.weight"] == "[Shard(dim=0), Shard(dim=1)]"


def test_both_savers_save(results: list[dict]) -> None:
    _ok(results, "save")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_load_equals_torch_dcp(results: list[dict], scenario: str) -> None:
    _ok(results, scenario)


@pytest.mark.parametrize("scenario", ["strided_1d", "partial", "not_in_mesh"])
def test_dtensor_edge_cases(results: list[dict], scenario: str) -> None:
    _ok(results, scenario)
