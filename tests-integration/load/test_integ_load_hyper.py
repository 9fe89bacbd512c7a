"""dcp_load.load of hyper-parallel checkpoints on 4 real gloo ranks, from checkpoints written
by packages/dcp-reader/tests/hyper_writer.py (the seed's format, built from its description):
saved as 4 ranks' Shard(0) chunks (ragged ``__dcp_chunk_`` keys, an uneven tensor, a 0-dim
tensor, pickled values), loaded into DP2 x TP2 DTensors ([R, S(1)], [S(0), S(1)],
[S(1), S(0)]) and into plain tensors, read once; files written the way MindSpore writes
them; and a save without collectives (``{rank}.metadata``), which each rank loads alone
(no collective), failing on its own when it asks for rows another rank saved. One launch
runs every scenario; ``dcp inspect`` shows the format."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "packages" / "dcp-reader" / "tests"))
import hyper_writer as hw  # noqa: E402
import integ_load_hyper_cases as cases  # noqa: E402

WORLD = 4


def build_checkpoints(root: Path) -> dict[str, str]:
    out = {k: str(root / k) for k in ("global", "ms_style", "rank_local")}
    ranks = {r: cases.saved_by(r, WORLD) for r in range(WORLD)}
    shapes = {n: s for n, (s, _) in cases.SPECS.items()}
    hw.write_checkpoint(out["global"], ranks, shapes)
    hw.write_checkpoint(out["rank_local"], ranks, shapes, per_rank=True)
    ms_names = ("embed.weight", "ints", "odd.w")
    hw.write_checkpoint(out["ms_style"], {r: {n: [(o, t.numpy()) for o, t in v] for n, v in items.items()
                                              if n in ms_names} for r, items in ranks.items()},
                        shapes, framework="numpy")
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_checkpoints(tmp_path_factory.mktemp("hyper"))


@pytest.fixture(scope="module")
def results(ckpts: dict[str, str]) -> list[dict]:
    return run_ranks(cases.hyper_cases, WORLD, ckpts, timeout=300, pg_timeout=120)


def _case(results: list[dict], name: str) -> list:
    per_rank = [r[name] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    return [r["out"] for r in per_rank]


def _unique(names) -> int:
    return sum(cases.full(n).numel() * cases.full(n).element_size() for n in names)


@pytest.mark.parametrize("layout", ["RS1", "S0S1", "S1S0"])
def test_dp2tp2_dtensors_reshard_and_read_every_byte_once(results, layout):
    reports = _case(results, f"dp2tp2_{layout}")
    assert all(r["format"] == "hyper-parallel" and r["world_size"] == WORLD for r in reports)
    assert all(r["values"] == 2 for r in reports)
    assert sum(r["bytes_read"] for r in reports) == reports[0]["job_unique_bytes"] == _unique(cases.SPECS)
    for r in reports:
        assert r["bytes_needed"] == r["bytes_read"] + r["bytes_received"]
    if layout == "RS1":  # every box is held by both dp replicas: read once, broadcast
        assert all(r["broadcasts"] > 0 for r in reports)


def test_plain_tensors_load_whole(results):
    reports = _case(results, "plain")
    assert sum(r["bytes_read"] for r in reports) == _unique(cases.SPECS)
    assert all(r["bytes_needed"] == _unique(cases.SPECS) for r in reports)


def test_mindspore_style_files(results):
    reports = _case(results, "ms_style")
    assert sum(r["bytes_read"] for r in reports) == _unique(("embed.weight", "ints", "odd.w"))


def test_rank_local_checkpoint_loads_without_collectives(results):
    reports = _case(results, "rank_local")
    assert all(r["world_size"] == 1 and r["broadcasts"] == 0 and r["bytes_received"] == 0 for r in reports)
    assert all(r["bytes_read"] == r["bytes_needed"] > 0 for r in reports)
    assert [r["values"] for r in reports] == [2, 0, 0, 0]


def test_rank_local_checkpoint_refuses_rows_another_rank_saved(results):
    outs = _case(results, "rank_local_foreign")
    for o in outs:
        assert "do not cover" in o["message"] and o["untouched"], o


def test_dcp_inspect_shows_the_format(ckpts, capsys):
    from dcp_load.cli._main import inspect, main

    out = io.StringIO()
    assert inspect(ckpts["global"], chunks=True, allow_pickle=False, out=out) == 0
    text = out.getvalue()
    assert "format hyper-parallel, 6 tensors, 2 values" in text
    assert "_rank0_.safetensors:embed.weight.__dcp_chunk_1" in text
    assert main(["inspect", ckpts["rank_local"]]) == 2
    assert "rank=" in capsys.readouterr().err
    assert main(["inspect", ckpts["rank_local"], "--rank", "1"]) == 0
    assert "format hyper-parallel, 5 tensors, 0 values" in capsys.readouterr().out
