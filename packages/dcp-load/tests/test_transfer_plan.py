"""The transfer planner (``dcp_load.transferring._planner``), pure: random held and wanted
layouts (hypothesis) are replayed piece by piece on arrays against the truth; each rank
gets every element it wants exactly once, from a rank that holds it; a holder that wants
a piece sends it; replicas share the sending; ``sources=`` composes held boxes as load
composes saved chunks; uncovered and inconsistent layouts are named per rank."""

from __future__ import annotations

import math

import numpy as np
from dcp_load import Concat
from dcp_load.layouts._sources import SourceMap
from dcp_load.transferring._planner import plan_transfer
from hypothesis import given, settings
from hypothesis import strategies as st

WORLD = 4


def _grid(draw, shape):
    """Boxes tiling ``shape``: random cuts per dimension."""
    per_dim = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
        edges = [0, *cuts, n]
        per_dim.append([(a, b - a) for a, b in zip(edges, edges[1:], strict=False)])
    boxes = [((), ())]
    for segs in per_dim:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in segs]
    return boxes


@st.composite
def layouts(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    src = [[] for _ in range(WORLD)]
    dst = [[] for _ in range(WORLD)]
    for box in _grid(draw, shape):
        for r in draw(st.sets(st.integers(0, WORLD - 1), min_size=1, max_size=2)):
            src[r].append(box)
    for box in _grid(draw, shape):
        for r in draw(st.sets(st.integers(0, WORLD - 1), min_size=0, max_size=3)):
            dst[r].append(box)
    return shape, src, dst


def _entries(name, shape, dtype, per_rank):
    return [[(name, shape, dtype, tuple(boxes))] if boxes else [] for boxes in per_rank]


def _inside(box, boxes):
    off, sz = box
    return any(all(b <= o and o + n <= b + m for o, n, b, m in zip(off, sz, bo, bs, strict=True)) for bo, bs in boxes)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_random_layouts_replay_to_the_truth(case):
    shape, src, dst = case
    held = _entries("w", shape, "float32", src)
    wanted = _entries("w", shape, "float32", dst)
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True, batch_bytes=64,
                         stage_bytes=256)
    assert plan.errors == {}
    truth = np.arange(math.prod(shape)).reshape(shape)
    got = [np.full(shape, -1) for _ in range(WORLD)]
    count = [np.zeros(shape, dtype=int) for _ in range(WORLD)]
    for p in plan.pieces:
        assert _inside((p.src_offsets, p.src_sizes), src[p.holder]), p  # sent by a rank that holds it
        holders = [r for r in range(WORLD) if _inside((p.src_offsets, p.src_sizes), src[r])]
        assert (p.holder in p.receivers) == any(r in p.receivers for r in holders), p  # a local copy first
        # a receiver that holds the piece copies it itself: no broadcast reaches it
        assert all(r == p.holder or r not in holders for r in p.receivers), p
        index = tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes, strict=True))
        src_index = tuple(slice(o, o + n) for o, n in zip(p.src_offsets, p.src_sizes, strict=True))
        for r in p.receivers:
            assert _inside((p.offsets, p.sizes), dst[r]), p
            got[r][index] = truth[src_index]
            count[r][index] += 1
        assert p.ranks == tuple(sorted({p.holder, *p.receivers}))
    for r in range(WORLD):
        wanted_mask = np.zeros(shape, dtype=int)
        for off, sz in dst[r]:
            wanted_mask[tuple(slice(o, o + n) for o, n in zip(off, sz, strict=True))] = 1
        assert (count[r] == wanted_mask).all(), r  # every wanted element exactly once
        assert (got[r][wanted_mask == 1] == truth[wanted_mask == 1]).all(), r
    assert [a for a, _ in plan.rounds] == sorted(a for a, _ in plan.rounds)
    assert sum(b - a for a, b in plan.rounds) == len(plan.pieces)


def test_replicas_share_the_sending_and_a_wanting_holder_copies():
    shape = (8, 4)
    rows = [((0, 0), (4, 4)), ((4, 0), (4, 4))]
    # ranks 0 and 1 are replicas of the whole tensor (two boxes); rank 2 and 3 want halves
    held = _entries("w", shape, "bfloat16", [rows, rows, [], []])
    wanted = _entries("w", shape, "bfloat16", [[], [rows[1]], [rows[0]], [rows[1]]])
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True,
                         batch_bytes=0, stage_bytes=1 << 20)
    by_box = {p.offsets: p for p in plan.pieces}
    assert by_box[(4, 0)].holder == 1 and by_box[(4, 0)].ranks == (1, 3)  # rank 1 wants it: it sends it
    assert by_box[(0, 0)].holder == 0  # the other replica, which has sent nothing yet


def test_every_holder_that_wants_a_replicated_piece_copies_it():
    shape = (4, 4)
    whole = [((0, 0), shape)]
    # ranks 0-2 hold the whole tensor and want it, rank 3 wants it only
    held = _entries("w", shape, "float32", [whole, whole, whole, []])
    for wanting in ([0, 1, 2], [0, 1, 2, 3]):
        wanted = _entries("w", shape, "float32", [whole if r in wanting else [] for r in range(WORLD)])
        plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True,
                             batch_bytes=0, stage_bytes=1 << 20)
        local = sorted(p.holder for p in plan.pieces if p.ranks == (p.holder,))
        sent = [(p.holder, p.receivers) for p in plan.pieces if len(p.ranks) > 1]
        if 3 in wanting:  # one holder copies and sends to rank 3; the other two copy
            assert len(sent) == 1 and sent[0][1] == (sent[0][0], 3) and len(local) == 2, plan.pieces
        else:
            assert sent == [] and local == [0, 1, 2], plan.pieces


def test_sources_compose_held_boxes_and_casts_travel_narrow():
    q, k = (4, 3), (2, 3)
    held = [[("q", q, "bfloat16", (((0, 0), q),)), ("k", k, "bfloat16", (((0, 0), k),))], [], [], []]
    wanted = [[], [("qk", (6, 3), "float32", (((0, 0), (3, 3)),))], [("qk", (6, 3), "float32", (((3, 0), (3, 3)),))], []]
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=SourceMap({"qk": Concat(["q", "k"])}),
                         allow_cast=True, batch_bytes=64, stage_bytes=1 << 20)
    assert plan.errors == {} and plan.composed == {"qk": 2} and plan.cast == {"qk"}
    pieces = sorted((p.offsets, p.src, p.src_offsets, p.sizes, p.receivers, p.wire) for p in plan.pieces)
    assert pieces == [((0, 0), "q", (0, 0), (3, 3), (1,), "bfloat16"), ((3, 0), "q", (3, 0), (1, 3), (2,), "bfloat16"),
                      ((4, 0), "k", (0, 0), (2, 3), (2,), "bfloat16")]


def test_uncovered_and_overlapping_layouts_are_named_per_rank():
    held = _entries("w", (4,), "float32", [[((0,), (2,))], [], [], []])
    wanted = _entries("w", (4,), "float32", [[], [((0,), (4,))], [], []])
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True, batch_bytes=0,
                         stage_bytes=1 << 20)
    assert list(plan.errors) == [1] and "is not covered by the ranks' src (2 of 4 elements" in plan.errors[1][0]
    held = _entries("w", (4,), "float32", [[((0,), (3,))], [((2,), (2,))], [], []])
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True, batch_bytes=0,
                         stage_bytes=1 << 20)
    assert sorted(plan.errors) == [0, 1] and "overlaps the box" in plan.errors[0][0]


def test_large_pieces_are_cut_into_slabs_and_rounds_bound_staging():
    held = _entries("w", (64, 16), "float32", [[((0, 0), (64, 16))], [], [], []])
    wanted = _entries("w", (64, 16), "float64", [[], [((0, 0), (64, 16))], [], []])
    plan = plan_transfer(list(zip(held, wanted, strict=True)), source_map=None, allow_cast=True, batch_bytes=64,
                         stage_bytes=1024)
    assert all(p.nbytes <= 512 for p in plan.pieces) and sum(p.nbytes for p in plan.pieces) == 64 * 16 * 4
    for a, b in plan.rounds:  # cast pieces are staged: each round's staging within the bound
        assert sum(p.nbytes for p in plan.pieces[a:b]) <= 1024


def test_transfer_stays_the_function_after_its_modules_are_imported():
    import importlib

    import dcp_load

    importlib.import_module("dcp_load.transferring._move")
    importlib.import_module("dcp_load.transferring._layout")
    assert callable(dcp_load.transfer) and dcp_load.transfer.__module__ == "dcp_load.transferring._transfer"
    assert "transfer" in dcp_load.__all__ and "TransferReport" in dcp_load.__all__
