"""Derived planning: the boxes derived from a mesh equal torch's per-rank boxes, and each
rank's own plan from derived wants equals its part of the global plan built from every
rank's gathered wants (same reads, owners and broadcast order), over random meshes (1-3
dims, pipeline-like stages), Shard/Replicate placements, global shapes, saved chunkings,
hosts and slab sizes."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
from dcp_load.plan._derive import Derived, mesh_boxes
from dcp_load.plan._local import plan_for_rank, restrict
from dcp_load.plan._plan import BROADCASTABLE, VIEWS, build_global_plan
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402

BOTH = BROADCASTABLE | VIEWS


@dataclass(frozen=True)
class C:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = "f0"


@dataclass(frozen=True)
class T:
    shape: tuple[int, ...]
    chunks: tuple[C, ...]
    itemsize: int = 2


def _cuts(draw, n: int) -> list[tuple[int, int]]:
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    edges = [0, *points, n]
    return [(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


def _torch_placements(key):
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in key]


def _own_box(shape, grid, rank, key):
    """This rank's box as torch computes it from its own mesh coordinate (no derivation)."""
    coordinate = [int(c) for c in np.argwhere(grid == rank)[0]]
    sizes, offsets = _compute_local_shape_and_global_offset(shape, grid.shape, coordinate, _torch_placements(key))
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


@st.composite
def _jobs(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    stages = draw(st.integers(1, 2))
    per_stage = math.prod(mesh_shape)
    world = per_stage * stages
    order = draw(st.permutations(range(world)))  # mesh ranks need not be in rank order
    tensors, layouts = {}, {}
    for k in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
        saved = [_cuts(draw, n) for n in shape]
        chunks = tuple(C(tuple(o for o, _ in c), tuple(s for _, s in c), f"f{k}-{i}")
                       for i, c in enumerate(itertools.product(*saved)))
        plain = draw(st.booleans()) and k == 0
        key = tuple(draw(st.sampled_from([("R",), *[("S", d) for d in range(ndim)]])) for _ in mesh_shape)
        stage = draw(st.integers(0, stages - 1))
        ranks = tuple(order[stage * per_stage:(stage + 1) * per_stage])
        tensors[f"t{k}"] = T(shape, chunks)
        layouts[f"t{k}"] = None if plain else (ranks, key)
    hosts = draw(st.sampled_from([None, 1, 2]))
    host_list = None if hosts is None else [f"h{r * hosts // world}" for r in range(world)]
    split = draw(st.sampled_from([0, 4, 16, 1 << 20]))
    return mesh_shape, world, tensors, layouts, host_list, split, draw(st.booleans())


def _derived_and_gathered(mesh_shape, world, tensors, layouts):
    entries: list[list[Derived]] = [[] for _ in range(world)]
    wants: list[list[tuple]] = [[] for _ in range(world)]
    for name, t in tensors.items():
        if layouts[name] is None:
            boxes = ((((0,) * len(t.shape)), t.shape, tuple(range(world))),)
            for r in range(world):
                entries[r].append(Derived(name, t.shape, "bfloat16", BOTH, ("plain",), tuple(range(world)), boxes))
                wants[r].append((name, (0,) * len(t.shape), t.shape, BOTH, "bfloat16"))
            continue
        ranks, key = layouts[name]
        boxes = mesh_boxes(t.shape, mesh_shape, ranks, key)
        grid = np.asarray(ranks).reshape(mesh_shape)
        for r in ranks:
            entries[r].append(Derived(name, t.shape, "bfloat16", BOTH, ("mesh",), tuple(sorted(ranks)), boxes))
            o, s = _own_box(t.shape, grid, r, key)
            wants[r].append((name, o, s, BOTH, "bfloat16"))
            mine = [(bo, bs) for bo, bs, h in boxes if r in h]
            assert mine == ([] if 0 in s else [(o, s)])  # derived boxes equal torch's own
    return entries, wants


@settings(max_examples=100, deadline=None)
@given(_jobs())
def test_each_ranks_derived_plan_equals_its_part_of_the_gathered_plan(job):
    mesh_shape, world, tensors, layouts, hosts, split, relay = job
    entries, wants = _derived_and_gathered(mesh_shape, world, tensors, layouts)
    full = build_global_plan(tensors, wants, hosts=hosts, split_bytes=split, relay=relay)
    unique = 0
    for r in range(world):
        mine = plan_for_rank(tensors, entries[r], r, world, hosts=hosts, split_bytes=split, relay=relay)
        reads, bcasts = restrict(full, r)
        assert mine.reads_for(r) == reads
        assert list(mine.broadcasts) == bcasts
        assert all(r in i.ranks for i in mine.broadcasts + mine.local)
        unique += mine.unique_bytes
    assert unique == full.unique_bytes


def test_mesh_boxes_one_box_per_shard_coordinate() -> None:
    # DP2 x TP4 over 8 ranks, [Replicate, Shard(0)] of a (10, 3) tensor: four uneven row
    # boxes (3, 3, 3, 1), each held by the two DP replicas of one TP coordinate.
    boxes = mesh_boxes((10, 3), (2, 4), tuple(range(8)), (("R",), ("S", 0)))
    assert [(o, s, h) for o, s, h in boxes] == [
        ((0, 0), (3, 3), (0, 4)), ((3, 0), (3, 3), (1, 5)), ((6, 0), (3, 3), (2, 6)), ((9, 0), (1, 3), (3, 7))]
    # uneven past the end: Shard(0) of 2 rows over 4 ranks leaves two empty boxes, dropped
    assert [h for _, _, h in mesh_boxes((2,), (4,), (3, 2, 1, 0), (("S", 0),))] == [(3,), (2,)]


def test_rank_local_planning_scales_with_holder_sets() -> None:
    # 4,096 ranks, TP8 x DP512 rows over one saved chunk per tensor: each rank plans 40
    # tensors in well under a second (the gathered plan needs every rank's wants).
    import time

    world, tp = 4096, 8
    grid = tuple(range(world))
    tensors = {f"w{i}": T((4096, 512), (C((0, 0), (4096, 512), f"f{i % 4}"),)) for i in range(40)}
    entries = [Derived(n, t.shape, "bfloat16", BOTH, ("mesh",), grid,
                       mesh_boxes(t.shape, (world // tp, tp), grid, (("R",), ("S", 0)))) for n, t in tensors.items()]
    start = time.perf_counter()
    plan = plan_for_rank(tensors, entries, 5, world)
    assert time.perf_counter() - start < 1.0
    assert all(5 in i.ranks for i in plan.broadcasts + plan.local)
    dp_group = set(range(5, world, tp))  # the ranks holding rank 5's rows
    assert plan.broadcasts and all(set(i.ranks) <= dp_group for i in plan.broadcasts)


def _lanes_sum(per_rank) -> int:
    from dcp_load.plan._digest import PRIME, holder_lane

    return sum(holder_lane(entries, r) for r, entries in enumerate(per_rank)) % PRIME


def test_holder_check_is_zero_exactly_when_layouts_agree() -> None:
    mesh = (0, 1, 2, 3)
    boxes = mesh_boxes((8, 4), (2, 2), mesh, (("R",), ("S", 0)))

    def entry(name="w", placements=(("R",), ("S", 0)), holders=mesh):
        return Derived(name, (8, 4), "bfloat16", BOTH, ("mesh", (2, 2), holders, placements), holders, boxes)

    plain = Derived("b", (4,), "bfloat16", BOTH, ("plain",), mesh, (((0,), (4,), mesh),))
    assert _lanes_sum([[entry(), plain] for _ in mesh]) == 0
    assert _lanes_sum([[entry(), plain], [entry(), plain], [entry(), plain], [entry()]]) != 0  # rank 3 lacks b
    assert _lanes_sum([[entry(), plain]] * 3 + [[entry(placements=(("R",), ("R",))), plain]]) != 0
    assert _lanes_sum([[entry(), plain]] * 3 + [[entry(), plain, entry("x", holders=(3,))]]) == 0  # its own mesh
    two_stages = [[entry(holders=(0, 1))], [entry(holders=(0, 1))], [entry(holders=(2, 3))], [entry(holders=(2, 3))]]
    assert _lanes_sum(two_stages) == 0  # each mesh is consistent: the store count catches a shared name


def test_host_check() -> None:
    from dcp_load.plan._digest import PRIME, host_lane

    assert sum(host_lane(f"h{r // 2}", r, 6, 2) for r in range(6)) % PRIME == 0
    assert sum(host_lane(f"h{r // 2}", r, 5, 2) for r in range(5)) % PRIME == 0  # a short last node
    assert sum(host_lane("same", r, 6, 2) for r in range(6)) % PRIME == 0
    assert sum(host_lane(f"h{r // 3}", r, 6, 2) for r in range(6)) % PRIME != 0  # 3 per host, not 2


def test_derived_plans_equal_the_global_plan_on_a_model_layout() -> None:
    # Llama-8B shapes on TP2 x PP2 x DP4, 4 ranks per host ("auto"): holder sets big enough
    # to be dealt in stripes, hosts computed (HostBlocks) or listed; every rank's own plan
    # is its part of the global plan built from every rank's gathered wants.
    from dcp_load.plan._plan import HostBlocks
    from dcp_load.plan._simulate import Layout, gathered_wants, model_metadata, stage_entries

    tensors = model_metadata("llama-8b")
    layout = Layout(2, 2, 4, ranks_per_host=4)
    wants, hosts = gathered_wants(tensors, layout)
    blocks = HostBlocks(layout.world, 4)
    assert list(blocks) == hosts and blocks[-1] == hosts[-1]
    full = build_global_plan(tensors, wants, hosts=hosts)
    assert len({i.ranks for i in full.broadcasts}) > 1
    per_stage = stage_entries(tensors, layout)
    unique = 0
    for r in range(layout.world):
        entries = per_stage[(r // layout.tp) % layout.pp]
        mine = plan_for_rank(tensors, entries, r, layout.world, hosts=blocks)
        reads, bcasts = restrict(full, r)
        assert mine.reads_for(r) == reads and list(mine.broadcasts) == bcasts
        assert mine.rank == r
        unique += mine.unique_bytes
    assert unique == full.unique_bytes
    spread = max(full.loads) / (sum(full.loads) / layout.world)
    assert spread < 1.001, spread  # dealt stripes: equal to a row (both stages hold as much)
