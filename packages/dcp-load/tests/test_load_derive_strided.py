"""Derived planning with ``_StridedShard`` (torchtitan's FSDP2 + TP layout): the boxes derived
for every rank equal the boxes its own ``Target`` computes from its coordinate (several per
rank where its rows are not contiguous), ``derive_entry`` accepts a rank's own boxes and
refuses others, and each rank's own plan equals its part of the gathered plan, over random
meshes, Shard/_StridedShard/Replicate placements, shapes and saved chunkings."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from dcp_load.layouts._targets import boxes_at
from dcp_load.plan._derive import Derived, _placement_key, _placement_objects, derive_entry, mesh_boxes
from dcp_load.plan._local import plan_for_rank, restrict
from dcp_load.plan._plan import BROADCASTABLE, VIEWS, build_global_plan
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

BOTH = BROADCASTABLE | VIEWS


class C:
    def __init__(self, offsets, sizes, file):
        self.offsets, self.sizes, self.file = offsets, sizes, file


class T:
    def __init__(self, shape, chunks, itemsize=2):
        self.shape, self.chunks, self.itemsize = shape, chunks, itemsize


@st.composite
def _layouts(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    key = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        dim = draw(st.integers(0, ndim - 1))
        key.append(("R",) if kind == "R" else ("S", dim) if kind == "S" else ("SS", dim, draw(st.integers(1, 3))))
    return mesh_shape, shape, tuple(key)


def _own_boxes(shape, mesh_shape, grid, rank, key):
    coordinate = [int(c) for c in np.argwhere(grid == rank)[0]]
    return [(b.offsets, b.sizes) for b in boxes_at(shape, mesh_shape, coordinate, _placement_objects(key))]


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.data())
def test_derived_boxes_are_each_ranks_own_boxes(layout, data):
    mesh_shape, shape, key = layout
    world = math.prod(mesh_shape)
    ranks = tuple(data.draw(st.permutations(range(world))))
    grid = np.asarray(ranks).reshape(mesh_shape)
    boxes = mesh_boxes(shape, mesh_shape, ranks, key)
    held = np.zeros(shape, dtype=np.int64)
    for o, s, h in boxes:
        held[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))] += len(h)
    replicas = math.prod(n for n, p in zip(mesh_shape, key, strict=True) if p[0] == "R")
    assert (held == replicas).all()  # every element held by exactly its replicas
    for r in range(world):
        own = _own_boxes(shape, mesh_shape, grid, r, key)
        assert sorted((o, s) for o, s, h in boxes if r in h) == sorted((o, s) for o, s in own if all(own_s > 0 for own_s in s))


@st.composite
def _jobs(draw):
    mesh_shape, _, _ = draw(_layouts())
    world = math.prod(mesh_shape)
    order = tuple(draw(st.permutations(range(world))))
    tensors, keys = {}, {}
    for k in range(draw(st.integers(1, 3))):
        _, shape, _ = draw(_layouts())
        key = tuple(draw(st.sampled_from([("R",), *[("S", d) for d in range(len(shape))],
                                          *[("SS", d, f) for d in range(len(shape)) for f in (2, 3)]]))
                    for _ in mesh_shape)
        cuts = []
        for n in shape:
            points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
            edges = [0, *points, n]
            cuts.append([(a, b - a) for a, b in itertools.pairwise(edges)])
        chunks = tuple(C(tuple(o for o, _ in c), tuple(s for _, s in c), f"f{k}-{i}")
                       for i, c in enumerate(itertools.product(*cuts)))
        tensors[f"t{k}"], keys[f"t{k}"] = T(shape, chunks), key
    hosts = draw(st.sampled_from([None, 1, 2]))
    host_list = None if hosts is None else [f"h{r * hosts // world}" for r in range(world)]
    return mesh_shape, order, tensors, keys, host_list, draw(st.sampled_from([0, 4, 1 << 20]))


@settings(max_examples=100, deadline=None)
@given(_jobs())
def test_strided_derived_plan_equals_its_part_of_the_gathered_plan(job):
    mesh_shape, order, tensors, keys, hosts, split = job
    world = len(order)
    grid = np.asarray(order).reshape(mesh_shape)
    entries = [[] for _ in range(world)]
    wants = [[] for _ in range(world)]
    for name, t in tensors.items():
        boxes = mesh_boxes(t.shape, mesh_shape, order, keys[name])
        for r in range(world):
            entries[r].append(Derived(name, t.shape, "bfloat16", BOTH, ("mesh",), tuple(range(world)), boxes))
            wants[r] += [(name, o, s, BOTH, "bfloat16") for o, s in _own_boxes(t.shape, mesh_shape, grid, r, keys[name])]
    full = build_global_plan(tensors, wants, hosts=hosts, split_bytes=split)
    for r in range(world):
        mine = plan_for_rank(tensors, entries[r], r, world, hosts=hosts, split_bytes=split)
        reads, bcasts = restrict(full, r)
        assert mine.reads_for(r) == reads
        assert list(mine.broadcasts) == bcasts


def test_derive_entry_takes_a_strided_dtensor_with_several_boxes() -> None:
    # One process, a 1-D mesh of 1 (no process group needed for placements and the key):
    # the key round-trips through torch's own placement objects.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [_StridedShard(0, split_factor=2), Shard(0), Replicate()]
    key = _placement_key(placements)
    assert key == (("SS", 0, 2), ("S", 0), ("R",))
    assert tuple(_placement_objects(key)) == tuple(placements)
    # FSDP2 (dp=2) over TP (tp=2) rows of an (8, 3) weight: rank at (dp 0, tp 1) holds rows
    # 4-5 (its TP half's first FSDP quarter); rank (1, 0) rows 2-3. Each rank holds one
    # contiguous box here; with tp=2 over 6 rows the strided rows split in two runs.
    boxes = mesh_boxes((8, 3), (2, 2), (0, 1, 2, 3), (("SS", 0, 2), ("S", 0)))
    assert sorted((o, s, h) for o, s, h in boxes) == [
        ((0, 0), (2, 3), (0,)), ((2, 0), (2, 3), (2,)), ((4, 0), (2, 3), (1,)), ((6, 0), (2, 3), (3,))]
    split = mesh_boxes((6, 3), (2, 1), (0, 1), (("SS", 0, 3), ("R",)))
    assert any(len([b for b in split if r in b[2]]) > 1 for r in (0, 1))  # non-contiguous rows: several boxes


class _FakeMesh:
    def __init__(self, grid):
        self.mesh = torch.as_tensor(grid)


def test_derive_entry_checks_own_boxes(monkeypatch) -> None:
    import dcp_load.layouts._targets as targets

    class Fake:
        def __init__(self, placements):
            self.placements, self.device_mesh = placements, _FakeMesh([[0, 1], [2, 3]])

    monkeypatch.setattr(targets, "is_dtensor", lambda v: isinstance(v, Fake))
    Fake.__module__ = "torch.fake"
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    value = Fake([_StridedShard(0, split_factor=2), Shard(0)])
    own = [((4, 0), (2, 3))]  # rank 1's rows (see above)
    entry = derive_entry(value, "w", (8, 3), "bfloat16", BOTH, 4, own, 1)
    assert entry is not None and entry.layout[3] == (("SS", 0, 2), ("S", 0))
    assert derive_entry(value, "w", (8, 3), "bfloat16", BOTH, 4, [((0, 0), (2, 3))], 1) is None  # not its rows
