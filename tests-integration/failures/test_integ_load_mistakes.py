"""Tied weights on 2 real gloo ranks: one tensor under two keys ("embed.weight" and
"head.weight") is loaded once; a checkpoint whose two values differ fails on every rank
naming both keys, unless tied_weights names the winner; a checkpoint holding only one of
the keys fills both. Destinations are poisoned; one launch runs every scenario."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dcp_platform.testing import run_ranks
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import integ_mistakes_cases as cases  # noqa: E402

EMBED = torch.arange(12.0).reshape(4, 3)
HEAD = -EMBED - 1
OTHER = torch.tensor([7.0, 8.0])


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("tied")
    ckpts = {k: str(root / k) for k in ("differ", "agree", "only_embed")}
    for name, tensors in (("differ", {"embed.weight": EMBED, "head.weight": HEAD}),
                          ("agree", {"embed.weight": EMBED, "head.weight": EMBED.clone()}),
                          ("only_embed", {"embed.weight": EMBED})):
        Path(ckpts[name]).mkdir()
        save_file({**tensors, "other": OTHER}, str(Path(ckpts[name]) / "model.safetensors"))
    return run_ranks(cases.tied_cases, 2, ckpts, timeout=200, pg_timeout=60)


def _outs(results: list[dict], key: str) -> list[dict]:
    return [r[key] for r in results]


def test_disagreeing_tied_values_fail_on_every_rank_naming_the_keys(tied):
    for out in _outs(tied, "differ"):
        assert out.get("error") == "LoadError", out
        assert "'embed.weight'" in out["message"] and "'head.weight'" in out["message"]
        assert "tied_weights={'head.weight': 'embed.weight'}" in out["message"]
        assert "ranks 0-1:" in out["message"]


@pytest.mark.parametrize(("key", "want"), [("differ_head_wins", HEAD), ("differ_embed_wins", EMBED),
                                           ("agree", EMBED), ("only_embed", EMBED)])
def test_tied_keys_load_once_with_one_value(tied, key, want):
    for out in _outs(tied, key):
        assert "error" not in out, out.get("trace")
        ok = out["ok"]
        assert ok["w"] == want.tolist() and ok["other"] == OTHER.tolist() and ok["same_object"]
        assert ok["tensors"] == 2 and len(ok["tied"]) == 1


def test_tied_weights_argument_must_name_tied_keys(tied):
    for out in _outs(tied, "bad_argument"):
        assert out.get("error") == "LoadError" and "do not name two keys of one tensor" in out["message"]
