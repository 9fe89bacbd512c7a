"""torchtitan's CheckpointManager with ``dcp_load.torch_compat`` swapped in for
torch.distributed.checkpoint (integ_torchtitan_cases): on 2 real gloo ranks with an FSDP2
model it saves (synchronously and with torchtitan's async mode) and loads Hugging Face files
through its storage reader; a new launch at another world size resumes each checkpoint into
poisoned targets. Every value equals what the same flow gives with torch DCP, and what was
saved. With torchtitan's dataloader (state under a key of each rank's own), each rank
resumes at its own next batch, as with torch DCP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpointer.dcp", reason="torchtitan is not installed "
                    "(nox -s tests-torchtitan installs it)")
pytest.importorskip("safetensors", reason="the Hugging Face files are written with safetensors")

import numpy as np  # noqa: E402
from dcp_platform.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import integ_torchtitan_cases as cases  # noqa: E402

pytestmark = pytest.mark.torchtitan


def _same(a, b, where: str = "") -> None:
    """Exact equality of nested dicts/lists of arrays and plain values."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    per_rank = run_ranks(cases.save_all, 2, str(root), timeout=300, pg_timeout=240)
    return root, per_rank


def test_saves_and_hf_initial_load_match_torch_dcp(saved):
    _, per_rank = saved
    for r in per_rank:
        for mode in cases.MODES:
            assert ".metadata" in r["files"][f"torch-{mode}"], r["files"]
            # torch_compat writes torch DCP's own format, with dcp's checksums beside it
            assert {".metadata", "dcp-checksums.json"} <= set(r["files"][f"dcp-{mode}"]), r["files"]
            assert "dcp-metadata.json" not in r["files"][f"dcp-{mode}"], r["files"]
        hf = r["hf"]
        assert hf["torch_loaded"] is True and hf["dcp_loaded"] is True
        _same(hf["torch"], hf["files"], "torch")
        _same(hf["dcp"], hf["files"], "dcp")
    _same(per_rank[0]["saved"], per_rank[1]["saved"])


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(saved, world):
    root, per_rank = saved
    truth = per_rank[0]["saved"]
    assert truth["train"] == {"step": 2, "ntokens_seen": 2000} and truth["lr"][0][0] == 2
    resumed = run_ranks(cases.resume, world, str(root), timeout=300, pg_timeout=240)
    for r in resumed:
        for mode in cases.MODES:
            _same(r[f"torch-{mode}"], truth, f"torch-{mode}")
            _same(r[f"dcp-{mode}"], r[f"torch-{mode}"], f"dcp-{mode}")
            # torchtitan finds the latest step by torch's ".metadata" file, which torch_compat
            # writes (torch DCP's format): load_step=-1 resumes from dcp's checkpoints too.
            assert r["latest"] == {"torch-disabled": 1, "torch-async": 1, "dcp-disabled": 1, "dcp-async": 1}


def test_per_rank_dataloader_state_resumes_as_with_torch_dcp(tmp_path):
    """torchtitan's dataloader keeps its state under a key of each rank's own: rank 1's is
    saved too (from rank 1), and each rank resumes at its own next batch (3 batches of 4
    were taken before the save)."""
    saved = run_ranks(cases.save_with_dataloader, 2, str(tmp_path), timeout=300, pg_timeout=240)
    resumed = run_ranks(cases.resume_with_dataloader, 2, str(tmp_path), timeout=300, pg_timeout=240)
    assert [r["rank"] for r in saved] == [0, 1]
    for rank, after in enumerate(resumed):
        for mode in cases.MODES:
            assert after[f"torch-{mode}"].tolist() == after[f"dcp-{mode}"].tolist() == [
                100 * rank + i for i in range(12, 16)], (rank, mode, after)
