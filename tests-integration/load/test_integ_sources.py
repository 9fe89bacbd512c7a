"""``load(sources=...)`` on 4 real gloo ranks (DP2 x TP2 on two simulated nodes): a
Llama-like Hugging Face checkpoint with experts loaded into fused grouped QKV, fused
gate/up, experts stacked and sharded over both mesh dims, and renames, as DTensors (a plan
derived from the mesh) and as Chunk targets (gathered wants); a Phi-3-like fused checkpoint
split back into q, k, v, gate and up. Every value is exact, and with
``broadcast_replicated_tensors=True`` the ranks together fetch each stored byte once
(``/proc/self/io`` with the page cache dropped, as in test_integ_read_once). Ranks that
pass different ``sources=``, and a bad mapping on one rank, fail on every rank before any
write."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_read_once_cases as once  # noqa: E402
import integ_sources_cases as cases  # noqa: E402


def _copies(root: Path, name: str, tensors: dict) -> list[str]:
    # Each node's copy under the same directory name: ranks compare the checkpoint's name
    first = str(root / "node0" / name)
    cases.write_hf(first, tensors)
    second = str(root / "node1" / name)
    shutil.copytree(first, second)
    return [first, second]


def test_hf_into_fused_layouts_and_back_read_once(tmp_path):
    try:
        once.read_bytes()
    except (OSError, RuntimeError):
        pytest.skip("/proc/self/io read_bytes is not available here: storage reads cannot be counted")
    llama = _copies(tmp_path, "llama", cases.llama())
    phi = _copies(tmp_path, "phi3", cases.phi3())
    per_rank = run_ranks(cases.sources_cases, 4, llama, phi, timeout=300, pg_timeout=240)
    for case in [c for c in per_rank[0] if c != "errors"]:
        unique, detail = once.assert_fetched_once(per_rank, case, True)
        assert unique == per_rank[0][case]["needed"], (case, detail)
        assert per_rank[0][case]["job_read"] == unique, (case, detail)  # the reader's count: 1.00 x
        assert any(r[case]["received"] for r in per_rank), f"{case}: nothing was broadcast between nodes"
    assert per_rank[0]["llama_dtensor"]["composed"] == {
        "tok_embeddings.weight": 1, "norm.weight": 1,
        **{f"layers.{i}.{k}": n for i in range(cases.LAYERS) for k, n in (
            ("attention.wqkv.weight", 3), ("attention.wo.weight", 1), ("feed_forward.w13.weight", 2),
            ("moe.experts.w1", cases.E))}}
    assert set(per_rank[3]["phi3_dtensor"]["composed"].values()) == {1}
    for r in per_rank:
        message, untouched = r["errors"]["other_sources"]
        assert untouched and ("with the same sources=" in message or "or different sources=" in message), message
        message, untouched = r["errors"]["missing_on_rank0"]
        assert untouched and "rank 0: destination 'extra.0' (sources['extra.{i}']): source(s) " \
            "'model.layers.0.self_attn.q_proj.weigth'" in message and "nearest checkpoint keys" in message, message


def test_a_bad_sources_argument_on_one_rank_fails_every_rank_at_once(tmp_path):
    cases.write_hf(str(tmp_path), {"model.norm.weight": cases._rand("norm", cases.D)})
    for message, untouched, seconds in run_ranks(cases.bad_argument_case, 2, str(tmp_path), timeout=180):
        assert untouched and seconds < 30, (message, seconds)
        assert "rank 1: ValueError: load: sources['w.{i}']: placeholder(s) {i} of the key appear in no source " \
            "name of 'model.norm.weight'" in message, message
