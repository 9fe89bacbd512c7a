"""Planning as pure functions: intersections (resharding), replica groups, owners per
holder set (heaviest first, fewest bytes, ties by rank), page-sharing boxes read once per
host, flags, and scale."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
from dcp_load import GreedyPlanner, ReadItem, build_global_plan
from dcp_load.plan._plan import BROADCASTABLE, VIEWS, intersect
from hypothesis import given, settings
from hypothesis import strategies as st

BOTH = BROADCASTABLE | VIEWS


@dataclass(frozen=True)
class C:  # the fields of dcp_reader.ChunkMeta the planner uses
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = "f0"


@dataclass(frozen=True)
class T:  # the fields of dcp_reader.TensorMeta the planner uses
    shape: tuple[int, ...]
    chunks: tuple[C, ...]
    itemsize: int = 4


def rows(shape: tuple[int, int], parts: int, file: str = "f0") -> T:
    step = shape[0] // parts
    return T(shape, tuple(C((i * step, 0), (step, shape[1]), f"{file}-{i}") for i in range(parts)))


def test_intersect_reshards() -> None:
    t = rows((8, 4), 4)  # saved TP4 on rows
    assert intersect(t.chunks, (0, 0), (4, 4)) == [(0, (0, 0), (2, 4)), (1, (2, 0), (2, 4))]
    assert intersect(t.chunks, (3, 1), (2, 2)) == [(1, (3, 1), (1, 2)), (2, (4, 1), (1, 2))]
    assert intersect(t.chunks, (0, 0), (0, 4)) == []  # empty box
    assert intersect((C((), ()),), (), ()) == [(0, (), ())]  # 0-dim


def test_replicas_form_groups_and_each_box_is_read_once() -> None:
    tensors = {"w": rows((8, 4), 2), "b": T((4,), (C((0,), (4,)),))}
    want_all = [("w", (0, 0), (8, 4), BOTH), ("b", (0,), (4,), BOTH)]
    plan = build_global_plan(tensors, [want_all] * 4)
    assert plan.local == ()
    assert {(i.name, i.offsets) for i in plan.broadcasts} == {("w", (0, 0)), ("w", (4, 0)), ("b", (0,))}
    assert all(i.ranks == (0, 1, 2, 3) for i in plan.broadcasts)
    # heaviest first to the least loaded, ties to the lower rank: w0 -> 0, w1 -> 1, b -> 2
    readers = {(i.name, i.offsets): i.reader for i in plan.broadcasts}
    assert readers == {("w", (0, 0)): 0, ("w", (4, 0)): 1, ("b", (0,)): 2}
    assert sum(plan.loads) == plan.unique_bytes == 8 * 4 * 4 + 4 * 4
    assert [i.reader for i in plan.reads_for(0)] == [0]


def test_no_broadcast_means_every_rank_reads() -> None:
    tensors = {"w": rows((8, 4), 2)}
    wants = [[("w", (0, 0), (8, 4), BOTH)]] * 3
    plan = build_global_plan(tensors, wants, broadcast=False)
    assert plan.broadcasts == ()
    assert plan.loads == (128, 128, 128)
    assert len(plan.reads_for(2)) == 2


def test_hosts_keep_one_host_replicas_local_and_broadcast_across_hosts() -> None:
    tensors = {"w": rows((8, 4), 2)}
    # ranks 0,1 want rows 0-3 (both on host a); ranks 2,3 want rows 4-7 (hosts a and b)
    wants = [[("w", (0, 0), (4, 4), BOTH)]] * 2 + [[("w", (4, 0), (4, 4), BOTH)]] * 2
    plan = build_global_plan(tensors, wants, hosts=["a", "a", "a", "b"])
    # one of the host's holders fetches (and verifies) rows 0-3; the other re-reads its page cache
    assert [(i.offsets, i.ranks, i.cached) for i in plan.local] == [((0, 0), (0,), False), ((0, 0), (1,), True)]
    assert [(i.offsets, i.ranks) for i in plan.broadcasts] == [((4, 0), (2, 3))]
    assert plan.loads == (64, 64, 64, 0)
    # without hosts, both boxes are read once and broadcast
    assert len(build_global_plan(tensors, wants).broadcasts) == 2
    with pytest.raises(ValueError, match="3 hosts for 4 ranks"):
        build_global_plan(tensors, wants, hosts=["a", "a", "b"])


def test_flags_decide_from_gathered_data() -> None:
    tensors = {"w": rows((8, 4), 2)}
    # rank 1's destination cannot take broadcasts: nobody broadcasts the box to it.
    wants = [[("w", (0, 0), (8, 4), BOTH)], [("w", (0, 0), (8, 4), VIEWS)]]
    plan = build_global_plan(tensors, wants)
    assert plan.broadcasts == () and plan.loads == (128, 128)
    # no sub-box views (MindSpore): sub-box pieces are still broadcast (through staging)
    wants = [[("w", (0, 0), (4, 4), BROADCASTABLE), ("v", (0, 0), (8, 4), BROADCASTABLE)]] * 2
    tensors["v"] = rows((8, 4), 2)
    plan = build_global_plan(tensors, wants)
    assert sorted(i.name for i in plan.broadcasts) == ["v", "v", "w"] and plan.local == ()


def test_dp2_tp2_from_tp4_groups_per_tp_rank() -> None:
    tensors = {"w": T((8, 8), tuple(C((0, 2 * i), (8, 2), f"r{i}") for i in range(4)))}  # TP4 on cols
    # dp2 x tp2 on cols: ranks 0,2 hold cols 0-3, ranks 1,3 hold cols 4-7
    wants = [[("w", (0, 4 * (r % 2)), (8, 4), BOTH)] for r in range(4)]
    plan = build_global_plan(tensors, wants)
    assert plan.local == ()
    assert sorted((i.offsets, i.ranks) for i in plan.broadcasts) == [
        ((0, 0), (0, 2)), ((0, 2), (0, 2)), ((0, 4), (1, 3)), ((0, 6), (1, 3))]
    assert plan.loads == (64, 64, 64, 64)


def test_large_replicated_pieces_are_dealt_in_equal_stripes() -> None:
    tensors = {"emb": T((10, 8), (C((0, 0), (10, 8)),)), "small": T((2,), (C((0,), (2,)),))}
    wants = [[("emb", (0, 0), (10, 8), BOTH), ("small", (0,), (2,), BOTH)]] * 3
    # 328 bytes, 109 per rank: at least the smallest slab (512 / 8 for one box per row), so
    # the set is one stream (emb, then small) cut into 3 equal stripes at the nearest rows
    # (bytes 110 and 219: rows 3 and 7 of 32 bytes), stripe j read by rank j.
    plan = build_global_plan(tensors, wants, split_bytes=512)
    assert sorted((i.name, i.offsets, i.sizes, i.reader) for i in plan.broadcasts) == [
        ("emb", (0, 0), (3, 8), 0), ("emb", (3, 0), (4, 8), 1), ("emb", (7, 0), (3, 8), 2), ("small", (0,), (2,), 2)]
    assert plan.unique_bytes == 320 + 8 and plan.loads == (96, 128, 104)
    # smaller slabs allowed: up to STRIPES_PER_UNIT stripes per rank, one row at least
    fine = build_global_plan(tensors, wants, split_bytes=64)
    assert len([i for i in fine.broadcasts if i.name == "emb"]) == 10 and sum(fine.loads) == 328
    # under a slab per rank: whole intervals, heaviest first to the least loaded
    for split in (4096, 0):
        unsplit = build_global_plan(tensors, wants, split_bytes=split)
        assert [(i.name, i.reader) for i in unsplit.broadcasts] == [("emb", 0), ("small", 1)]
        assert unsplit.loads == (320, 8, 0)


def test_stripes_cut_at_the_nearest_row_and_cover_every_row_once() -> None:
    from dcp_load.plan._segments import stripe_rows

    # 10 rows of 32 bytes at byte 0 of a 328-byte stream in 3 stripes: cuts at rows 3 and 7
    assert stripe_rows(0, 320, 0, 10, 32, 328, 3) == [(0, 3, 0), (3, 7, 1), (7, 10, 2)]
    assert stripe_rows(320, 8, 0, 2, 4, 328, 3) == [(0, 2, 2)]  # inside the last stripe
    assert stripe_rows(5, 1, 0, 1, 0, 10, 4) == [(0, 1, 2)]  # a 0-dim item: one piece
    for start, rows, rb, total, stripes in [(0, 7, 3, 21, 5), (13, 50, 8, 1000, 9), (0, 3, 100, 300, 12)]:
        pieces = stripe_rows(start, rows * rb, 0, rows, rb, total, stripes)
        assert [a for a, _, _ in pieces] == [0, *[b for _, b, _ in pieces[:-1]]] and pieces[-1][1] == rows
        assert all(b > a and 0 <= j < stripes for a, b, j in pieces)


def test_owners_depend_only_on_the_holder_set() -> None:
    # "big" is held by rank 0 alone, "rep" by ranks 0 and 1: rep's owner is chosen among
    # {0, 1} from rep's holder set only, so a rank can plan it without knowing "big".
    tensors = {"big": T((100,), (C((0,), (100,)),)), "rep": T((10,), (C((0,), (10,)),))}
    wants = [[("big", (0,), (100,), BOTH), ("rep", (0,), (10,), BOTH)], [("rep", (0,), (10,), BOTH)]]
    plan = build_global_plan(tensors, wants)
    alone = build_global_plan({"rep": tensors["rep"]}, wants)
    assert plan.broadcasts == alone.broadcasts


def test_plan_is_deterministic_and_in_agreed_order() -> None:
    tensors = {f"t{i}": rows((16, 4), 4, file=f"f{i % 3}") for i in range(20)}
    wants = [[(n, (4 * (r % 4), 0), (4, 4), BOTH) for n in tensors] for r in range(8)]
    a = build_global_plan(tensors, wants)
    b = build_global_plan(dict(reversed(tensors.items())), wants)
    assert a == b
    keys = [(tensors[i.name].chunks[i.chunk].file, i.name, i.offsets) for i in a.broadcasts]
    assert keys == sorted(keys)
    assert max(a.loads) - min(a.loads) <= 64


def test_missing_names_are_skipped() -> None:
    plan = build_global_plan({}, [[("nope", (0,), (1,), BOTH)]])
    assert plan.broadcasts == () and plan.local == ()


def test_custom_planner_is_the_seam() -> None:
    class Last:
        def assign(self, groups, loads):
            return [g.ranks[-1] for g in groups]

    tensors = {"w": rows((8, 4), 2)}
    plan = build_global_plan(tensors, [[("w", (0, 0), (8, 4), BOTH)]] * 3, planner=Last())
    assert {i.reader for i in plan.broadcasts} == {2}

    class Bad:
        def assign(self, groups, loads):
            return [99 for _ in groups]

    with pytest.raises(ValueError, match="outside its ranks"):
        build_global_plan(tensors, [[("w", (0, 0), (8, 4), BOTH)]] * 3, planner=Bad())


def test_read_item_invariants() -> None:
    with pytest.raises(ValueError, match="reader 5"):
        ReadItem("w", 0, (0,), (1,), 4, (0, 1), reader=5)
    with pytest.raises(ValueError, match="differ in rank"):
        ReadItem("w", 0, (0,), (1, 1), 4, (0,))


def test_greedy_balances_overlapping_rank_sets() -> None:
    groups = [ReadItem("a", 0, (i,), (1,), 10, (0, 1)) for i in range(4)]
    groups += [ReadItem("b", 0, (i,), (1,), 10, (1, 2)) for i in range(4)]
    groups.sort(key=lambda g: (-g.nbytes, g.name, g.offsets))
    loads = [0, 0, 0]
    readers = GreedyPlanner().assign(groups, loads)
    assert readers == [0, 1, 0, 1, 2, 2, 1, 2]
    assert loads == [20, 30, 30]
    assert sum(loads) == 80


def test_scales_to_thousands_of_ranks() -> None:
    # 1024 ranks = dp128 x tp8, 200 tensors saved tp8: linear in (rank, piece) wants.
    world, tp = 1024, 8
    tensors = {f"layer{i}.w": T((4096, 512), tuple(C((0, 64 * j), (4096, 64), f"r{j}") for j in range(tp)), 2)
               for i in range(200)}
    wants = [[(n, (0, 64 * (r % tp)), (4096, 64), BOTH) for n in tensors] for r in range(world)]
    t0 = time.perf_counter()
    plan = build_global_plan(tensors, wants)
    elapsed = time.perf_counter() - t0
    # each TP rank's 128 replicas share 200 x 512 KiB: dealt in 128 equal stripes, cut at
    # rows (128 bytes), so a stripe boundary adds at most one piece
    assert 200 * tp <= len(plan.broadcasts) <= (200 + 128) * tp and plan.local == ()
    assert sum(plan.loads) == plan.unique_bytes == 200 * math.prod((4096, 512)) * 2
    assert max(plan.loads) - min(plan.loads) <= 2 * 64 * 2
    assert elapsed < 20, elapsed


# -- property: any saved tiling x any wanted tiling -> every element read exactly once ----


def _cuts(draw, n: int) -> list[tuple[int, int]]:
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    edges = [0, *points, n]
    return [(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


@st.composite
def _tilings(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    saved = [_cuts(draw, n) for n in shape]
    wanted = [_cuts(draw, n) for n in shape]
    replicas = draw(st.integers(1, 3))
    return shape, saved, wanted, replicas, draw(st.booleans())


def _boxes(cuts):
    import itertools

    for combo in itertools.product(*cuts):
        yield tuple(o for o, _ in combo), tuple(s for _, s in combo)


@settings(max_examples=60, deadline=None)
@given(_tilings())
def test_any_resharding_reads_each_wanted_element_once(case):
    shape, saved, wanted, replicas, relay = case
    tensors = {"t": T(shape, tuple(C(o, s, f"f{i}") for i, (o, s) in enumerate(_boxes(saved))), 1)}
    wanted_boxes = list(_boxes(wanted))
    # ranks r*k .. hold wanted box k (each box held by `replicas` ranks)
    wants = [[("t", o, s, BOTH)] for o, s in wanted_boxes for _ in range(replicas)]
    plan = build_global_plan(tensors, wants, relay=relay)
    for rank, (want,) in enumerate(wants):  # each rank gets each element of its box once, nothing else
        cells = [[(o + i, 1) for i in range(n)] for o, n in zip(want[1], want[2], strict=True)]
        assert _received(plan, rank) == {("t", idx[0]): 1 for idx in _boxes(cells)}
    seen = {}
    for item in plan.broadcasts + plan.local:
        for idx in _boxes([[(o + i, 1) for i in range(s)] for o, s in zip(item.offsets, item.sizes, strict=True)]):
            seen[idx[0]] = seen.get(idx[0], 0) + 1
    assert len(seen) == math.prod(shape) and set(seen.values()) == {1}
    assert sum(plan.loads) == plan.unique_bytes == math.prod(shape)
    if replicas > 1:
        assert plan.local == ()


# -- read once by bytes: page-sharing boxes are read on one host --------------------------


def _rows_read_by_host(plan, tensors, hosts):
    """{(name, chunk, row): set of hosts whose ranks read that stored row from storage}."""
    out: dict[tuple[str, int, int], set[str]] = {}
    for item in plan.broadcasts + plan.local:
        readers = [item.reader] if item.reader is not None else list(item.ranks)
        rows = range(item.offsets[0], item.offsets[0] + item.sizes[0]) if item.sizes else [0]
        for row in rows:
            out.setdefault((item.name, item.chunk, row), set()).update(hosts[r] for r in readers)
    return out


def _received(plan, rank):
    """Every (name, element index) that ``rank`` gets: read itself or received (not what
    it only relays)."""
    got: dict[tuple[str, tuple[int, ...]], int] = {}
    for item in plan.broadcasts + plan.local:
        if rank not in item.wanting:
            continue
        cells = [[(o + i, 1) for i in range(s)] for o, s in zip(item.offsets, item.sizes, strict=True)]
        for idx in _boxes(cells):
            got[(item.name, idx[0])] = got.get((item.name, idx[0]), 0) + 1
    return got


def test_row_parallel_halves_are_read_on_one_host() -> None:
    # DP2 x TP2, nodes = TP groups: ranks 0, 2 hold columns 0-3, ranks 1, 3 columns 4-7 of a
    # weight saved whole. Both halves of every row share pages: one host reads each row.
    tensors = {"w": T((64, 8), (C((0, 0), (64, 8)),), 4)}
    wants = [[("w", (0, 4 * (r % 2)), (64, 4), BOTH)] for r in range(4)]
    hosts = ["a", "a", "b", "b"]
    for same_host in (True, False):
        plan = build_global_plan(tensors, wants, hosts=hosts, split_bytes=256, same_host_reads=same_host)
        by_row = _rows_read_by_host(plan, tensors, hosts)
        assert len(by_row) == 64 and all(len(h) == 1 for h in by_row.values())
        assert {h for hs in by_row.values() for h in hs} == {"a", "b"}  # both hosts share the work
        for r in range(4):
            assert sorted(_received(plan, r).values()) == [1] * 64 * 4


def test_partial_overlaps_are_read_once() -> None:
    # rank 0 (host a) wants rows 0-99, rank 1 (host b) rows 50-149: rows 50-99 read once.
    tensors = {"w": T((150, 4), (C((0, 0), (150, 4)),), 4)}
    wants = [[("w", (0, 0), (100, 4), BOTH)], [("w", (50, 0), (100, 4), BOTH)]]
    plan = build_global_plan(tensors, wants, hosts=["a", "b"])
    by_row = _rows_read_by_host(plan, tensors, ["a", "b"])
    assert len(by_row) == 150 and all(len(h) == 1 for h in by_row.values())
    assert sum(plan.loads) == plan.unique_bytes == 150 * 4 * 4
    assert [(i.offsets, i.sizes, i.ranks) for i in plan.broadcasts] == [((50, 0), (50, 4), (0, 1))]
    for r in range(2):
        assert set(_received(plan, r).values()) == {1} and len(_received(plan, r)) == 400


def test_casts_travel_in_the_destination_dtype() -> None:
    # float32 destinations of a bfloat16 tensor: broadcast bytes are float32 bytes, storage
    # bytes bfloat16; ranks whose destinations differ in dtype never share a broadcast.
    tensors = {"w": T((4, 4), (C((0, 0), (4, 4)),), 2)}
    wants = [[("w", (0, 0), (4, 4), BOTH, "float32")]] * 2 + [[("w", (0, 0), (4, 4), BOTH, "bfloat16")]] * 2
    plan = build_global_plan(tensors, wants)
    assert sorted((i.dtype, i.nbytes, i.ranks) for i in plan.broadcasts) == [
        ("bfloat16", 32, (2, 3)), ("float32", 64, (0, 1))]
    assert plan.unique_bytes == 2 * 32 and sum(plan.loads) == 64


@st.composite
def _host_layouts(draw):
    shape, saved, wanted, _, _ = draw(_tilings())
    hosts = draw(st.integers(1, 3))
    same_host = draw(st.booleans())
    split = draw(st.sampled_from([0, 4, 16, 1 << 20]))
    return shape, saved, wanted, hosts, same_host, split


@settings(max_examples=80, deadline=None)
@given(_host_layouts())
def test_each_stored_row_is_read_by_one_host(case):
    """Random saved chunking x random wanted tiling, held in full by every host (data
    parallel across hosts, any tiling inside a host): every rank gets each wanted element
    exactly once, and each stored row is read by exactly one host."""
    shape, saved, wanted, n_hosts, same_host, split = case
    tensors = {"t": T(shape, tuple(C(o, s, f"f{i}") for i, (o, s) in enumerate(_boxes(saved))), 1)}
    boxes = list(_boxes(wanted))
    wants = [[("t", o, s, BOTH)] for _ in range(n_hosts) for o, s in boxes]
    hosts = [f"h{h}" for h in range(n_hosts) for _ in boxes]
    plan = build_global_plan(tensors, wants, hosts=hosts, same_host_reads=same_host, split_bytes=split)
    for rank, (_, s) in enumerate(boxes * n_hosts):
        got = _received(plan, rank)
        assert set(got.values()) == {1} and len(got) == math.prod(s)
    by_row = _rows_read_by_host(plan, tensors, hosts)
    assert all(len(h) == 1 for h in by_row.values())
    assert sum(plan.loads) >= plan.unique_bytes == math.prod(shape)


# -- object storage: whole rows read by one rank, the other columns relayed ---------------


def test_relayed_columns_make_each_slab_one_rank_s_whole_rows() -> None:
    # DP2 x TP2 of a (64, 8) weight saved whole, column halves: ranks 0, 2 hold columns 0-3,
    # ranks 1, 3 columns 4-7. With relay every row slab is read by one rank, both halves,
    # and the half it does not hold is relayed to its holders.
    from dcp_load.run._together import row_groups

    tensors = {"w": T((64, 8), (C((0, 0), (64, 8)),), 4)}
    wants = [[("w", (0, 4 * (r % 2)), (64, 4), BOTH)] for r in range(4)]
    plan = build_global_plan(tensors, wants, split_bytes=256, relay=True)
    assert plan.fetched_bytes == plan.unique_bytes == 64 * 8 * 4 and plan.local == ()
    relayed = [i for i in plan.broadcasts if i.relay]
    assert relayed and all(i.reader in i.ranks and i.reader not in i.wanting for i in relayed)
    assert all(i.wanting in ((0, 2), (1, 3)) for i in plan.broadcasts)
    readers = {i.reader for i in plan.broadcasts}
    assert len(readers) > 1  # the slabs are spread over the ranks
    for r in readers:
        reads = plan.reads_for(r)
        groups = row_groups(reads)
        assert all(len(g) == 2 for g in groups), groups  # each slab: both halves, read together
        for g in groups:
            assert sorted(reads[i].offsets[1] for i in g) == [0, 4]
    without = build_global_plan(tensors, wants, split_bytes=256)
    assert not any(i.relay for i in without.broadcasts)
    assert all(len(g) == 1 for r in range(4) for g in row_groups(without.reads_for(r)))  # one half each


def test_relay_needs_one_dtype_and_leaves_contiguous_boxes_alone() -> None:
    tensors = {"w": T((64, 8), (C((0, 0), (64, 8)),), 4)}
    mixed = [[("w", (0, 4 * (r % 2)), (64, 4), BOTH, "float32" if r % 2 else "bfloat16")] for r in range(4)]
    assert not any(i.relay for i in build_global_plan(tensors, mixed, split_bytes=256, relay=True).broadcasts)
    rows_only = [[("w", (32 * (r % 2), 0), (32, 8), BOTH)] for r in range(4)]  # one box per row interval
    assert not any(i.relay for i in build_global_plan(tensors, rows_only, split_bytes=256, relay=True).broadcasts)
    halves = [[("w", (0, 4 * (r % 2)), (64, 4), BOTH)] for r in range(4)]
    own = build_global_plan(tensors, halves, split_bytes=256, relay=True, broadcast=False)
    assert own.broadcasts == () and all(len(i.ranks) == 2 for i in own.local)  # no broadcasts: none relayed


def test_relaying_keeps_the_groups_few() -> None:
    # One relaying rank per host and holder set: a TP8 x DP2 Llama-8B on 8-rank hosts joins
    # at most 9 groups per rank (with the nearest holder of each slab relaying, TP8 x DP8 made 65).
    from collections import Counter

    from dcp_load.plan._simulate import Layout, gathered_wants, model_metadata

    tensors = model_metadata("llama-8b")
    wants, hosts = gathered_wants(tensors, Layout(8, 1, 2, ranks_per_host=8))
    plan = build_global_plan(tensors, wants, hosts=hosts, same_host_reads=False, relay=True)
    assert any(i.relay for i in plan.broadcasts)
    per_rank = Counter(r for s in {i.ranks for i in plan.broadcasts if len(i.ranks) > 1} for r in s)
    assert max(per_rank.values()) <= 9, per_rank
    assert plan.fetched_bytes == plan.unique_bytes
