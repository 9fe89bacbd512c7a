"""``Flat`` destinations and ``flat_views``: the decomposition of an interval of a row-major
flattening into boxes (property-based: disjoint, exact, at most 2N-1, each a view of the
buffer), exact loads of random intervals from random saved chunkings (0-D to 4-D, uneven)
with the bytes each load reads, the planner's per-rank reads for flat partitions (own
bytes plus the partial rows it cuts, every byte once per job), mixed state dicts, save of
a whole-tensor Flat, the derived-planning rule, and every refusal (interval outside the
global shape, non-contiguous tensors, DTensors, overlapping destinations), raised before
any destination is written."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from dcp_load import Chunk, Flat, flat_views, load, save
from dcp_load.layouts._flat import flat_boxes
from dcp_load.layouts._flat_target import FlatTarget
from dcp_load.layouts._state import Leaf
from dcp_load.layouts._target_for import target_for
from dcp_load.plan._plan import BROADCASTABLE, build_global_plan
from hypothesis import event, given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _full(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.int64) * 7 + seed).remainder(1000).to(dtype).reshape(shape)


def _poison(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n,), float("nan") if dtype.is_floating_point else -123, dtype=dtype)


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    out, o = [], 0
    for i in range(parts):
        s = base + (1 if i < extra else 0)
        if s:
            out.append((o, s))
        o += s
    return out or [(0, 0)]


def _write(path: str, tensors: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """A native checkpoint with each tensor saved as a grid of chunks (``grid[d]`` pieces
    along dim ``d``, uneven), over two data files."""
    from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key

    writer = NativeWriter(path)
    files: dict[str, dict[str, torch.Tensor]] = {}
    metas = {}
    count = 0
    for name, (t, grid) in tensors.items():
        chunks = []
        for box in itertools.product(*(_cuts(n, p) for n, p in zip(t.shape, grid, strict=True))):
            offsets, sizes = tuple(o for o, _ in box), tuple(s for _, s in box)
            file = f"data-{count % 2}.safetensors"
            count += 1
            key = chunk_key(name, offsets)
            files.setdefault(file, {})[key] = t[tuple(slice(o, o + s) for o, s in box)].contiguous()
            chunks.append(ChunkMeta(offsets, sizes, file, key))
        metas[name] = TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(chunks))
    for file, data in files.items():
        writer.write_file(file, data)
    writer.commit(CheckpointMetadata(tensors=metas, values={}, format="native"))


@st.composite
def _intervals(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    return shape, start, draw(st.integers(0, total - start))


# -- the decomposition ------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(_intervals())
def test_boxes_are_disjoint_exact_few_and_views_of_the_buffer(case):
    shape, start, numel = case
    boxes = flat_boxes(shape, start, numel)
    total = math.prod(shape)
    if total == 0:
        assert boxes == [((0,) * len(shape), shape, 0)]
        return
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    # Each box is the run [pos, pos + numel) of the interval, in order: together they cover it
    # exactly, once (which also makes them disjoint).
    index = torch.arange(total).reshape(shape)
    covered = []
    pos = 0
    for offsets, sizes, at in boxes:
        assert at == pos and all(n > 0 for n in sizes)
        flat = index[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))].reshape(-1)
        assert flat.tolist() == list(range(start + at, start + at + math.prod(sizes)))
        covered.extend(flat.tolist())
        pos += math.prod(sizes)
    assert covered == list(range(start, start + numel))
    # Each box's destination is a view of the caller's buffer at the box's position.
    buf = torch.zeros(numel + 3)
    target = target_for(Leaf("t", Flat(buf[3:], shape, start), {}, "t"))
    assert isinstance(target, FlatTarget)
    assert [(b.offsets, b.sizes) for b in target.boxes] == [(o, s) for o, s, _ in boxes]
    for offsets, sizes, at in boxes:
        view = target.view(offsets, sizes)
        assert tuple(view.shape) == sizes and view.is_contiguous()
        assert view.data_ptr() == buf.data_ptr() + (3 + at) * buf.element_size()


def test_decomposition_examples():
    # [7, 47) of (3, 4, 5): the tail of row (0, 1), rows (0, 2-3), the plane 1, row (2, 0), the head of (2, 1)
    assert flat_boxes((3, 4, 5), 7, 40) == [
        ((0, 1, 2), (1, 1, 3), 0), ((0, 2, 0), (1, 2, 5), 3), ((1, 0, 0), (1, 4, 5), 13),
        ((2, 0, 0), (1, 1, 5), 33), ((2, 1, 0), (1, 1, 2), 38)]
    assert flat_boxes((4, 6), 6, 18) == [((1, 0), (3, 6), 0)]  # whole rows: one box
    assert flat_boxes((), 0, 1) == [((), (), 0)]
    assert flat_boxes((5,), 2, 0) == []


# -- loads -------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(_intervals(), st.lists(st.integers(1, 3), min_size=4, max_size=4), st.sampled_from(DTYPES),
       st.integers(1, 4))
def test_random_intervals_load_exactly_and_read_only_their_bytes(tmp_path_factory, case, grid, dtype, parts):
    shape, _, _ = case
    full = _full(shape, dtype)
    path = str(tmp_path_factory.mktemp("flat"))
    _write(path, {"t": (full, tuple(grid[:len(shape)]))})
    total = math.prod(shape)
    cuts = _cuts(total, parts)
    for lo, n in cuts:  # each part of a flat partition, loaded alone
        buf = _poison(n + 2, dtype)
        report = load({"t": Flat(buf[1:n + 1], shape, lo)}, checkpoint_id=path, no_dist=True)
        assert torch.equal(buf[1:n + 1], full.reshape(-1)[lo:lo + n])
        assert buf[0].isnan() if dtype.is_floating_point else buf[0] == -123  # nothing outside is written
        need = n * full.element_size()
        assert report.bytes_needed == need and report.bytes_read == need  # narrowed reads, nothing more


def _own_and_cut(metas, rank_boxes, itemsize):
    """(own bytes, bytes of the saved rows the boxes cut partially) of one rank."""
    from dcp_load.plan._plan import intersect

    own = cut = 0
    for name, offsets, sizes in rank_boxes:
        chunks = metas[name].chunks
        own += math.prod(sizes) * itemsize
        for index, _, s in intersect(chunks, offsets, sizes):
            c = chunks[index]
            if s and s[1:] != tuple(c.sizes[1:]):  # rows shared with a neighbour's interval
                cut += s[0] * math.prod(c.sizes[1:]) * itemsize
    return own, cut


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 6), min_size=0, max_size=4),
                          st.lists(st.integers(1, 3), min_size=4, max_size=4)), min_size=1, max_size=3),
       st.integers(1, 5), st.data())
def test_flat_partitions_read_every_byte_once_and_own_bytes_plus_cut_rows(shapes, world, data):
    """A ZeRO partition of the flat space of a few tensors over ``world`` ranks, planned with
    broadcasts: the job reads each byte once, and each rank its own bytes plus at most the
    saved rows it shares with a neighbour (which it may read for both and send)."""
    from dcp_reader import ChunkMeta, TensorMeta

    metas, space = {}, []
    for k, (shape, grid) in enumerate(shapes):
        shape = tuple(shape)
        chunks = tuple(ChunkMeta(tuple(o for o, _ in box), tuple(s for _, s in box), "f", f"t{k}")
                       for box in itertools.product(*(_cuts(n, p) for n, p in zip(shape, grid, strict=False))))
        metas[f"t{k}"] = TensorMeta(f"t{k}", shape, "float32", chunks)
        space.append((f"t{k}", shape))
    total = sum(math.prod(s) for _, s in space)
    bounds = sorted(data.draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    edges = [0, *bounds, total]
    wants, per_rank = [], []
    for r in range(world):
        views = flat_views(space, torch.zeros(edges[r + 1] - edges[r]), edges[r])
        boxes = [(n, o, s) for n, v in views.items() for o, s, _ in v.boxes() if math.prod(s)]
        per_rank.append(boxes)
        wants.append([(n, o, s, BROADCASTABLE, "") for n, o, s in boxes])
    plan = build_global_plan(metas, wants, broadcast=True)
    assert sum(plan.loads) == plan.unique_bytes == total * 4
    for r in range(world):
        own, cut = _own_and_cut(metas, per_rank[r], 4)
        assert plan.loads[r] <= own + cut, (r, plan.loads[r], own, cut)
        event("reads " + ("its own bytes" if plan.loads[r] == own else "fewer (a neighbour sends its cut rows)"
                          if plan.loads[r] < own else "more (it sends a neighbour's cut rows)"))


def test_mixed_state_dict_flat_chunk_and_plain(tmp_path):
    a, b, c = _full((5, 7)), _full((4, 3), torch.bfloat16, 3), _full((6,), torch.int64, 1)
    _write(str(tmp_path), {"a": (a, (2, 2)), "b": (b, (1, 2)), "c": (c, (3,))})
    buf = _poison(20, torch.float32)
    chunk = torch.full((2, 3), float("nan"), dtype=torch.bfloat16)
    plain = _poison(6, torch.int64)
    state = {"a": Flat(buf.view(4, 5), (5, 7), 9), "b": Chunk(chunk, (4, 3), (1, 0)), "c": plain}
    report = load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(buf, a.reshape(-1)[9:29]) and torch.equal(chunk, b[1:3]) and torch.equal(plain, c)
    assert report.bytes_read == report.bytes_needed == 20 * 4 + 6 * 2 + 6 * 8


def test_cast_into_a_flat_buffer(tmp_path):
    a = _full((6, 5), torch.bfloat16)
    _write(str(tmp_path), {"a": (a, (2, 1))})
    buf = _poison(17, torch.float32)
    load({"a": Flat(buf, (6, 5), 8)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(buf, a.float().reshape(-1)[8:25])


def test_flat_views_of_a_space(tmp_path):
    space = [("a", (3, 4)), ("empty", (0, 2)), ("b", (5,)), ("c", ()), ("d", (2, 2))]
    buf = torch.zeros(9)
    views = flat_views(space, buf, 10)  # elements [10, 19): the end of a, empty, b, c, the head of d
    assert {k: (v.start, v.numel) for k, v in views.items()} == {"a": (10, 2), "empty": (0, 0), "b": (0, 5),
                                                                   "c": (0, 1), "d": (0, 1)}
    assert views["b"].tensor.data_ptr() == buf.data_ptr() + 2 * 4
    assert flat_views(dict(space), torch.zeros(0), 5) == {}
    with pytest.raises(ValueError, match=r"holds elements \[20, 30\) but the space .* has only 22"):
        flat_views(space, torch.zeros(10), 20)


# -- save ---------------------------------------------------------------------------------------------
def test_a_whole_tensor_flat_saves_and_loads_into_boxes(tmp_path):
    a = _full((5, 3, 2))
    save({"a": Flat(a.clone().reshape(-1), (5, 3, 2), 0)}, checkpoint_id=str(tmp_path / "ck"))
    got = torch.full((2, 3, 2), float("nan"))
    load({"a": Chunk(got, (5, 3, 2), (3, 0, 0))}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(got, a[3:])


def test_a_space_saved_through_flat_views_keeps_its_empty_tensors(tmp_path):
    """A tensor of no element lies at a point of the space: the buffers around that point
    name it, so that save writes it (it used to be left out, and loading the checkpoint
    into the model's tensors failed on the missing key)."""
    space = [("a", (3, 4)), ("empty", (0, 2)), ("b", (5,)), ("end", (2, 0))]
    values = torch.arange(17, dtype=torch.float32)
    save(flat_views(space, values.clone(), 0), checkpoint_id=str(tmp_path / "one"))
    state = {"a": torch.zeros(3, 4), "empty": torch.zeros(0, 2), "b": torch.zeros(5), "end": torch.zeros(2, 0)}
    load(state, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    assert torch.equal(torch.cat([state["a"].reshape(-1), state["b"]]), values)
    assert [k for k, v in flat_views(space, torch.zeros(5), 12).items() if v.numel == 0] == ["empty", "end"]
    assert "empty" not in flat_views(space, torch.zeros(2), 13) and "empty" in flat_views(space, torch.zeros(0), 12)


def test_save_refuses_a_tensor_only_empty_intervals_hold(tmp_path):
    """An empty interval names its tensor: a save where no rank holds any of it is
    incomplete (the tensor used to be left out of the checkpoint without a word)."""
    with pytest.raises(Exception, match=r"'x': chunks cover 0 of 12 elements"):
        save({"x": Flat(torch.zeros(0), (3, 4), 5), "y": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"))
    assert not (tmp_path / "ck" / "dcp-metadata.json").exists()


# -- derived planning ---------------------------------------------------------------------------------
def test_flats_are_never_derived():
    """Not even whole-tensor ones: derived as a plain tensor, a tensor one rank of a ZeRO
    partition holds whole would be planned on every rank (test_integ_load_flat)."""
    from dcp_load.plan._derive import derive_entry

    whole = Flat(torch.zeros(12), (3, 4), 0)
    assert derive_entry(whole, "w", (3, 4), "float32", 0, 4, [((0, 0), (3, 4))], 1) is None
    part = Flat(torch.zeros(5), (3, 4), 2)
    assert derive_entry(part, "w", (3, 4), "float32", 0, 4, [((0, 2), (1, 2))], 1) is None


# -- refusals -----------------------------------------------------------------------------------------
def test_interval_outside_the_global_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[10, 14\) does not fit in global_shape \(3, 4\), which has 12"):
        Flat(torch.zeros(4), (3, 4), 10)
    with pytest.raises(ValueError, match="start must be >= 0"):
        Flat(torch.zeros(4), (3, 4), -1)


def test_non_contiguous_tensors_are_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        Flat(torch.zeros(4, 3).t(), (20,), 0)
    with pytest.raises(ValueError, match="not contiguous"):
        flat_views([("a", (4,))], torch.zeros(4, 2)[:, 0], 0)


def test_overlapping_destinations_are_refused_before_any_write(tmp_path):
    a = _full((4, 4))
    _write(str(tmp_path), {"a": (a, (1, 1)), "b": (a.clone(), (1, 1))})
    buf = _poison(16, torch.float32)
    state = {"a": Flat(buf[:10], (4, 4), 0), "b": Flat(buf[8:], (4, 4), 8)}
    with pytest.raises(Exception, match=r"'a' and 'b' overlap in memory .* each entry must own its memory"):
        load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert buf.isnan().all()
    plain = _poison(16, torch.float32)
    with pytest.raises(Exception, match="overlap in memory"):
        load({"a": Flat(plain[4:], (4, 4), 4), "b": plain.view(4, 4)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert plain.isnan().all()
    with pytest.raises(Exception, match="overlap in memory"):
        save({"a": Flat(buf[:10], (4, 4), 0), "b": Flat(buf[8:], (4, 4), 8)}, checkpoint_id=str(tmp_path / "s"))
    # Disjoint views of one buffer are fine, and tied plain tensors are not this check's concern.
    buf2 = _poison(16, torch.float32)
    load({"a": Flat(buf2[:8], (4, 4), 0), "b": Flat(buf2[8:], (4, 4), 8)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(buf2, a.reshape(-1))


@pytest.mark.parametrize("kw", [{"start": 2.5}, {"start": True}, {"start": torch.tensor(2.7)}, {"start": "2"},
                                {"global_shape": (3.7, 4)}, {"global_shape": "34"}, {"global_shape": (True, 4)},
                                {"numel": 2.5}, {"local_start": 1.5}])
def test_non_integer_arguments_are_refused_not_truncated(kw):
    """A float start of 2.5 used to become 2 and global_shape "34" (3, 4): a silent wrong interval."""
    args = {"tensor": torch.zeros(4), "global_shape": (3, 4), "start": 2, **kw}
    name = next(iter(kw))
    with pytest.raises(TypeError, match=rf"Flat: {name} .*{type(kw[name]).__name__}"):
        Flat(**args)


def test_integer_like_arguments_are_taken():
    import numpy as np

    f = Flat(torch.zeros(4), torch.Size([3, 4]), np.int64(2), numel=torch.tensor(3), local_start=np.int32(1))
    assert (f.global_shape, f.start, f.numel, f.local_start) == ((3, 4), 2, 3, 1)
    assert type(f.start) is int and all(type(s) is int for s in f.global_shape)


def test_negative_global_shape_is_named():
    with pytest.raises(ValueError, match=r"global_shape \(-3, -4\) has a negative size"):
        Flat(torch.zeros(4), [-3, -4], 0)


def test_flat_views_refuses_bad_shapes_offsets_and_duplicates():
    # A negative size used to shift every later tensor silently: b became [1, 4) of itself.
    with pytest.raises(ValueError, match=r"flat_views: 'a' has shape \(-1,\)"):
        flat_views([("a", (-1,)), ("b", (4,))], torch.zeros(3), 0)
    # A repeated name the buffer touches once used to pass: ranks disagreed on its place.
    with pytest.raises(ValueError, match=r"flat_views: 'a' appears twice"):
        flat_views([("a", (4,)), ("a", (4,))], torch.zeros(4), 4)
    with pytest.raises(TypeError, match=r"flat_views: offset must be an int, got 2.5"):
        flat_views([("a", (4,)), ("b", (4,))], torch.zeros(2), 2.5)
    with pytest.raises(TypeError, match=r"flat_views: 'a' has shape 4; give a sequence of ints"):
        flat_views([("a", 4)], torch.zeros(2), 0)


def test_a_flat_over_a_non_tensor_is_refused_when_made():
    """An array used to pass until load, which then named neither the key nor Flat."""
    import numpy as np

    with pytest.raises(TypeError, match="Flat.tensor must be a torch or MindSpore tensor, got ndarray"):
        Flat(np.zeros(4, dtype=np.float32), (3, 4), 2)


def test_flats_on_meta_are_refused_as_meta_not_as_overlapping(tmp_path):
    """Every meta tensor has address 0: two meta Flats used to be reported overlapping too."""
    _write(str(tmp_path), {"a": (_full((3, 4)), (1, 1)), "b": (_full((3, 4)), (1, 1))})
    state = {k: Flat(torch.empty(4, device="meta"), (3, 4), 2) for k in ("a", "b")}
    with pytest.raises(Exception, match="on the 'meta' device") as info:
        load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert "overlap" not in str(info.value)


def test_a_local_start_past_the_tensor_is_named():
    """It used to be reported as the interval [0, -2) not fitting the global shape."""
    with pytest.raises(ValueError, match=r"local_start=6, numel=-2 do not fit in the tensor of 4 element"):
        Flat(torch.zeros(4), (3, 4), 0, local_start=6)
    with pytest.raises(ValueError, match=r"local_start=0, numel=-1 do not fit .* both must be >= 0"):
        Flat(torch.zeros(4), (3, 4), 0, numel=-1)
