"""``dcp_load.transfer`` on 4 real gloo ranks (integ_transfer_cases): 2 trainer ranks
(FSDP2 ``Shard(0)``) into 2 engine ranks (column- and row-parallel TP) with q/k/v fused
into a grouped qkv through ``sources=`` and a bf16 -> fp32 cast, the plan reused after an
optimizer step and made again after a layout change; colocated FSDP4 -> DP2 x TP2 with a
whole tensor, a ``Chunk`` and a ``Flat``; mistakes refused on every rank before any
write; random layouts (hypothesis) against the truth. Destinations are poisoned before
each transfer; sources are never written (values and version counters)."""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_platform.testing import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import integ_transfer_cases as cases  # noqa: E402


def test_trainer_to_engine_fused_cast_and_plan_reuse():
    per_rank = run_ranks(cases.trainer_to_engine, 4, timeout=300, pg_timeout=240)
    for rank, r in enumerate(per_rank):
        assert r["src_untouched"], rank
        assert r["first_bad"] == r["second_bad"] == r["third_bad"] == [], (rank, r)
        assert not r["first"]["plan_reused"] and r["second"]["plan_reused"] and not r["third"]["plan_reused"]
        # the plan check only: one all-reduce fewer than a planned transfer (no gather)
        assert r["second"]["collectives"] == r["first"]["collectives"] - 1, r
    for r in per_rank[2:]:
        first = r["first"]
        # bf16 travels and is cast on arrival: half of what the fp32 destination keeps
        assert first["bytes_received"] * 2 == first["bytes_kept"], first
        assert first["cast"] and first["composed"] == (("layers.0.qkv", 3),)
    sent = sum(r["first"]["bytes_sent"] for r in per_rank)
    # the replicated norm (bf16) is one broadcast that both engine ranks receive
    assert sent + cases.SHAPES["norm"][0] * 2 == sum(r["first"]["bytes_received"] for r in per_rank)
    assert per_rank[0]["first"]["bytes_sent"] and per_rank[1]["first"]["bytes_sent"]


def test_colocated_fsdp4_into_dp2_tp2():
    per_rank = run_ranks(cases.colocated, 4, timeout=300, pg_timeout=240)
    for rank, r in enumerate(per_rank):
        assert r["bad"] == [] and r["untouched"], (rank, r)
        report = r["report"]
        # each byte a rank keeps arrives once: from a peer or from its own src
        assert report["bytes_received"] + report["bytes_copied"] == report["bytes_kept"], (rank, report)


def test_mistakes_refused_everywhere_before_any_write():
    per_rank = run_ranks(cases.mistakes, 4, timeout=300, pg_timeout=240)
    for r in per_rank:
        for case, (message, untouched) in r.items():
            assert untouched and message.startswith("validate:"), (case, message)
        assert "rank 3: dst 'w' has shape (8, 7) here but (8, 6) on rank 0" in r["shape_on_rank3"][0]
        assert "rank 2: dst 'w2': no rank's src holds 'w2'" in r["missing"][0]
        assert "rank 1: transfer settings" in r["settings"][0] and "differ from rank 0's" in r["settings"][0]
        assert "allow_dtype_cast=False refuses casts" in r["cast_refused"][0]
    assert len({str(r) for r in per_rank}) == 1  # the same error on every rank


MESHES = st.sampled_from([("w4", 1), ("w22", 2), ("lo", 1), ("hi", 1)])


@st.composite
def layout(draw, ndim):
    mesh, dims = draw(MESHES)
    return mesh, [draw(st.integers(-1, ndim - 1)) for _ in range(dims)]


@st.composite
def tensor_case(draw):
    ndim = draw(st.integers(1, 3))
    return {"shape": [draw(st.integers(1, 7)) for _ in range(ndim)], "src": draw(layout(ndim)),
            "dst": draw(layout(ndim)), "src_dtype": draw(st.sampled_from(["float32", "bfloat16"])),
            "dst_dtype": draw(st.sampled_from(["float32", "bfloat16"]))}


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(tensor_case(), min_size=1, max_size=4), min_size=4, max_size=4))
def test_random_layouts_against_the_truth(layouts):
    specs = [{f"t{i}": spec for i, spec in enumerate(case)} for case in layouts]
    per_rank = run_ranks(cases.random_layouts, 4, specs, timeout=300, pg_timeout=240)
    for rank, results in enumerate(per_rank):
        for spec, (bad, received, kept, copied) in zip(specs, results, strict=True):
            assert bad == [], (rank, spec)
            assert received + copied <= kept, (rank, spec)  # never more than once (a cast may halve it)


def test_a_rank_that_never_arrives_is_named_within_the_bound():
    per_rank = run_ranks(cases.absent_rank, 4, timeout=300, pg_timeout=240)
    for r in per_rank[:3]:
        assert "rank 3" in r["message"] and r["untouched"], r
        assert r["seconds"] < 12, r  # the bound (3 s) and the store's polling, not the peer's return
