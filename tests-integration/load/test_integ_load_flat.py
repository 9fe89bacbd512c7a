"""Flat (ZeRO-style) destinations on real gloo ranks: a Hugging Face file, a torch DCP
checkpoint saved from DP2 x TP2, and the seed's ragged checkpoint (each rank's flat
interval saved as several ``__dcp_chunk_{i}`` boxes of one key per file) loaded into
ZeRO-4 partitions of the per-dtype flat spaces (uneven cuts inside rows and across
tensors), each byte read once; DP2 x ZeRO-2, whose replicas read once and broadcast; the
ragged checkpoint into DP2 x TP2 DTensors; and a ZeRO-4 save (one chunk per box, native
format) loaded back into DP2 x TP2 DTensors, into whole tensors in one process, and into
ZeRO-2 partitions on 2 ranks; a ZeRO-4 partition cut at tensor edges (each rank holds
whole tensors, different ones); the gathered plan for Flats next to DTensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "packages" / "dcp-reader" / "tests"))
import hyper_writer as hw  # noqa: E402
import integ_flat_cases as cases  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flat")
    out = {k: str(root / k) for k in ("hf", "tdcp", "ragged", "zero4")}
    cases.write_hf(out["hf"])
    hw.write_checkpoint(out["ragged"], cases.ragged_ranks(WORLD), {n: s for n, (s, _) in cases.SPECS.items()})
    run_ranks(cases.save_torch_dcp_dp2tp2, WORLD, out["tdcp"], timeout=300, pg_timeout=240)
    return out


@pytest.fixture(scope="module")
def results(ckpts: dict[str, str]) -> list[dict]:
    return run_ranks(cases.flat4_cases, WORLD, ckpts, timeout=300, pg_timeout=240)


def _case(results: list[dict], name: str) -> list:
    per_rank = [r[name] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    return [r["out"] for r in per_rank]


def _own(part: int, parts: int) -> int:
    return sum(numel * torch.empty((), dtype=d).element_size()
               for d in cases.DTYPES for numel in [cases.cuts(d, parts)[part][1]])


def test_ragged_checkpoint_has_several_chunks_of_one_key_per_file(ckpts):
    from safetensors import safe_open

    with safe_open(str(Path(ckpts["ragged"]) / "_rank1_.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".__dcp_chunk_1" in k for k in keys), keys


@pytest.mark.parametrize("src", ["hf", "tdcp", "ragged"])
def test_zero4_partitions_load_exactly_each_byte_read_once(results, src):
    reports = _case(results, f"zero4_{src}")
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()
    for rank, r in enumerate(reports):
        assert r["bytes_needed"] == _own(rank, 4)  # its own interval of each dtype space
        assert r["bytes_read"] + r["bytes_received"] == r["bytes_needed"]
        assert r["job_unique_bytes"] == cases.model_bytes()


@pytest.mark.parametrize("case", ["dp2_zero2", "dp2_zero2_unpacked"])
def test_dp2_zero2_replicas_read_once_and_broadcast(results, case):
    reports = _case(results, case)
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()
    assert all(r["broadcasts"] > 0 and r["bytes_needed"] == _own(rank % 2, 2) for rank, r in enumerate(reports))
    for pair in ((0, 2), (1, 3)):  # the two replicas of one partition share its bytes
        assert sum(reports[p]["bytes_read"] for p in pair) == _own(pair[0], 2)


def test_ragged_checkpoint_into_dtensors(results):
    reports = _case(results, "ragged_boxes")
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()


def test_zero4_save_writes_one_chunk_per_box_and_loads_into_dtensors(results, ckpts):
    from dcp_load.layouts._flat import flat_boxes
    from dcp_reader import open_checkpoint

    saved = _case(results, "save_zero4")
    assert sum(s["bytes_written"] for s in saved) == saved[0]["job_bytes"] == cases.model_bytes()
    boxes = 0
    for dtype in cases.DTYPES:
        begin = 0
        for _, shape in cases.space(dtype):
            n = torch.Size(shape).numel()
            for offset, numel in cases.cuts(dtype, 4):
                lo, hi = max(begin, offset), min(begin + n, offset + numel)
                boxes += len(flat_boxes(shape, lo - begin, hi - lo)) if hi > lo else 0
            begin += n
    assert sum(s["chunks_written"] for s in saved) == boxes
    with open_checkpoint(ckpts["zero4"]) as reader:
        assert reader.format == "native"
        assert sum(len(t.chunks) for t in reader.metadata.tensors.values()) == boxes
    reports = _case(results, "zero4_to_dp2tp2")
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()


def test_zero4_save_loads_whole_in_one_process(results, ckpts):
    import dcp_load

    _case(results, "save_zero4")
    state = {n: cases.poison_like(cases.full(n)) for n in cases.SPECS}
    r = dcp_load.load(state, checkpoint_id=ckpts["zero4"], no_dist=True)
    assert all(cases.same(state[n], cases.full(n)) for n in cases.SPECS)
    assert r.bytes_read == cases.model_bytes()


def test_zero4_save_loads_into_zero2_on_two_ranks(results, ckpts):
    _case(results, "save_zero4")
    reports = _case(run_ranks(cases.zero2_cases, 2, ckpts["zero4"], timeout=300, pg_timeout=240), "zero2")
    assert [r["bytes_needed"] for r in reports] == [_own(0, 2), _own(1, 2)]
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()


def test_flats_next_to_dtensors_use_the_gathered_plan(results):
    assert [r["derived"] for r in _case(results, "planning_whole")] == [False] * WORLD
    assert [r["derived"] for r in _case(results, "planning_part")] == [False] * WORLD


def test_zero4_cut_at_tensor_boundaries_loads_each_whole_tensor_on_its_rank(results):
    """Every rank holds whole tensors, different ones per rank: no rank's wants follow from
    another's, so the load must not plan them as plain tensors every rank holds."""
    reports = _case(results, "zero4_at_tensor_edges")
    assert sum(r["bytes_read"] for r in reports) == cases.model_bytes()

