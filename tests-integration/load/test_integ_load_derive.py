"""Derived planning on 4 real gloo ranks (DP2 x TP2, LOCAL_WORLD_SIZE=2): [R,S(0)],
[R,S(1)] and [R,R] plus a plain tensor, resharded from TP4-on-columns and uneven 3-way row
checkpoints, load bit-exactly into poisoned targets while each rank sends only the digest
(at most 4 KiB of control payload; the collectives' share is the same for 8 or 96 extra
tensors, and the broadcast groups are made by their members with no list exchange; names
every rank holds put nothing in the store, others one count per name a rank leads); one Chunk
annotation on one rank makes every rank gather (and send more); hosts that cannot be
derived are gathered; ranks given different state-dict layouts all raise LoadError naming
the ranks that differ, without hanging and without writing any target.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_derive_cases as cases  # noqa: E402
import integ_load_cases as base  # noqa: E402

WORLD = 4
NAMES = ["layers.0.attn.wq", "layers.0.mlp.w1", "layers.1.mlp.w1", "embed.weight", "layers.0.norm", "odd.w"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("derive")
    ckpts = {k: str(root / k) for k in ("tp4", "uneven", "many")}
    base.write_native(ckpts["tp4"], NAMES, lambda n: (1, 4)[: len(base.SPECS[n][0])])
    base.write_native(ckpts["uneven"], NAMES, lambda n: (3, 1)[: len(base.SPECS[n][0])])
    Path(ckpts["many"]).mkdir()
    save_file({**{n: base.full(n) for n in NAMES}, **{f"many.{i}": cases.full_many(i) for i in range(cases.MANY)}},
              str(Path(ckpts["many"]) / "model.safetensors"))
    return run_ranks(cases.derive_cases, WORLD, ckpts, timeout=300, pg_timeout=60, env={"LOCAL_WORLD_SIZE": "2"})


def _case(results: list[dict], name: str) -> list:
    per_rank = [r[name] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    return [r["out"] for r in per_rank]


@pytest.mark.parametrize("placements", ["RS0", "RS1", "RR", "SS0"])
@pytest.mark.parametrize("src", ["tp4", "uneven"])
def test_derived_load_is_exact_and_sends_only_the_digest(results, placements, src):
    outs = _case(results, f"values_{placements}_{src}")
    for o in outs:
        assert o["sent"] + o["store_sent"] <= 4096, o
        assert "store_reduce" in o["calls"]  # 4 ranks: the digest goes through the store
        r = o["report"]
        assert r["bytes_needed"] == r["bytes_read"] + r["bytes_received"]
    assert len({o["report"]["job_unique_bytes"] for o in outs}) == 1
    assert sum(o["report"]["bytes_read"] for o in outs) >= outs[0]["report"]["job_unique_bytes"]


def test_control_bytes_do_not_grow_with_tensors(results):
    few, many = _case(results, "count_8"), _case(results, f"count_{cases.MANY}")
    for a, b in zip(few, many, strict=True):
        assert b["sent"] + b["store_sent"] <= 4096, b
        assert b["sent"] == a["sent"], (a["calls"], b["calls"])  # the collectives: fixed size
        # the store counts only names not held by every rank: here all 4 ranks hold each
        assert a["store_sent"] == b["store_sent"] == 0
    gathered = _case(results, "gathered")
    assert all(g["sent"] > 2 * m["sent"] for g, m in zip(gathered, many, strict=True))


def test_hosts_that_cannot_be_derived_are_gathered(results):
    derived = _case(results, "values_RS1_tp4")
    for o, d in zip(_case(results, "hosts_gathered"), derived, strict=True):
        # the host ids travel in one bounded object gather: two tensor all-gathers more
        assert o["sent"] <= 4096 and o["calls"].count("all_gather") == d["calls"].count("all_gather") + 2, o


def test_a_different_layout_raises_on_every_rank(results):
    outs = _case(results, "spec_differs")
    for o in outs:
        assert o["phase"] == "validate" and o["poisoned"]
        assert 3 in o["failures"] and "differs from other ranks'" in o["message"]


def test_a_plain_tensor_one_rank_alone_holds_is_loaded_by_that_rank(results):
    # torch DCP loads a key only some ranks hold (per-rank RNG or dataloader state) for each
    # holder; the values were checked against the checkpoint's inside the ranks.
    outs = _case(results, "extra_plain")
    assert [o["report"]["tensors"] for o in outs] == [4, 4, 5, 4]


@pytest.mark.parametrize("src", ["tp4", "uneven"])
def test_strided_shard_is_derived_not_gathered(results, src):
    # torchtitan's FSDP2 + TP rows ([_StridedShard(0, sf=2), Shard(0)]) send the same fixed-size
    # control payload as plain Shard(0), up to the width of the pickled byte counts of the
    # closing exchange: no wants are gathered.
    plain, strided = _case(results, f"values_RS0_{src}"), _case(results, f"values_SS0_{src}")
    for a, b in zip(plain, strided, strict=True):
        assert b["calls"] == a["calls"]
        assert abs(b["sent"] - a["sent"]) < 32, (a["sent"], b["sent"])
