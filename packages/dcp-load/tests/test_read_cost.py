"""The read cost model (``plan._read_cost``) and covering reads: whatever the model chooses
(exact runs, or covering ranges at any level, cut at any staging size) the values loaded
are the saved ones (hypothesis over shapes, dtypes, saved chunkings, boxes, casts; native
files with block checksums, Hugging Face and torch DCP files); a row-parallel shard is
read with O(chunks) read requests, not one per row; the model's choices on page cache and
on object storage."""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
import warnings
from pathlib import Path

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load import Chunk
from dcp_load.plan import _read_cost as rc
from dcp_load.run import _execute, _stage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import sources_cases as cases  # noqa: E402

MiB = 1024 * 1024


def _geometry(chunk, offsets, sizes, item=2):
    return rc.BoxGeometry(chunk, offsets, sizes, item)


def test_page_cache_maps_short_runs_and_reads_long_ones_with_preadv():
    # dcp-reader copies runs up to MAPPED_RUN_MAX out of a memory map: one call, no over-read
    limit = 16 * MiB
    for chunk, offsets, sizes in [((4096, 1024), (0, 512), (4096, 512)), ((65536, 64), (0, 32), (65536, 32)),
                                  ((50304, 768), (0, 384), (50304, 384)),
                                  ((16, 512, 512), (0, 0, 256), (16, 512, 256)),
                                  ((256, 256, 3, 3), (0, 0, 0, 1), (256, 256, 3, 1)),
                                  ((4096, 1024), (0, 0), (4096, 8))]:
        c = rc.choose(_geometry(chunk, offsets, sizes), rc.MAPPED_COST, limit)
        assert not c.covering and c.calls == 1 and c.fetched == math.prod(sizes) * 2, (chunk, sizes, c)
    long = rc.choose(_geometry((512, 65536), (0, 32768), (512, 16384)), rc.MAPPED_COST, limit)
    assert not long.covering and long.calls == 1 and long.level == 1  # 32 KiB runs: preadv, 512 a call
    fewer = rc.choose(_geometry((4096, 1024), (0, 512), (2, 512)), rc.MAPPED_COST, limit)
    assert fewer.covering  # two runs: a covering read's call is cheaper than a map


def test_page_cache_unmapped_covers_short_runs_and_reads_long_ones_exactly():
    limit = 16 * MiB
    rc_local = rc.LOCAL_COST  # DCP_MAPPED_READS=0: files are not mapped
    half = rc.choose(_geometry((4096, 1024), (0, 512), (4096, 512)), rc_local, limit)
    assert not half.covering and half.calls == 8  # 1 KiB rows: scattered natively, 512 a call
    narrow = rc.choose(_geometry((65536, 64), (0, 32), (65536, 32)), rc_local, limit)
    assert narrow.covering and narrow.level == 0  # 64 B rows: the run count outweighs the bytes
    experts = rc.choose(_geometry((16, 512, 512), (0, 0, 256), (16, 512, 256)), rc_local, limit)
    assert experts.covering  # runs over two dims: read run by run in Python, so covered
    conv = rc.choose(_geometry((256, 256, 3, 3), (0, 0, 0, 1), (256, 256, 3, 1)), rc_local, limit)
    assert conv.covering and conv.calls == 1
    down = rc.choose(_geometry((2048, 11264), (0, 5632), (2048, 5632)), rc_local, limit)
    assert not down.covering  # 11 KiB runs: the extra bytes cost more than the requests
    column = rc.choose(_geometry((4096, 1024), (2048, 0), (2048, 1024)), rc_local, limit)
    assert not column.covering and column.calls == 1  # contiguous: one read
    sparse = rc.choose(_geometry((4096, 1024), (0, 0), (4096, 8)), rc_local, limit)
    assert not sparse.covering  # 1 column in 128: over the 8 x over-read bound


def test_object_storage_never_fetches_more_than_1_05_x():
    limit = 16 * MiB
    for chunk, offsets, sizes in [((4096, 1024), (0, 512), (4096, 512)), ((256, 256, 3, 3), (0, 0, 0, 1), (256, 256, 3, 2)),
                                  ((64, 1000), (0, 0), (64, 990))]:
        g = _geometry(chunk, offsets, sizes)
        c = rc.choose(g, rc.OBJECT_COST, limit)
        assert c.fetched <= 1.05 * g.nbytes, (chunk, sizes, c)


def test_the_cost_of_a_reader_comes_from_its_storage():
    class Store:
        local = False

    class Reader:
        storage = Store()

    assert rc.read_cost_of(Reader()) is rc.OBJECT_COST
    Store.local = True
    old = os.environ.pop("DCP_MAPPED_READS", None)
    try:
        assert rc.read_cost_of(Reader()) is rc.MAPPED_COST  # the default: short runs mapped
        os.environ["DCP_MAPPED_READS"] = "0"
        assert rc.read_cost_of(Reader()) is rc.LOCAL_COST  # dcp-reader maps nothing then
    finally:
        os.environ.pop("DCP_MAPPED_READS", None)
        if old is not None:
            os.environ["DCP_MAPPED_READS"] = old
    Store.read_cost = rc.ReadCost(1, 1, 1, 1, 1, 1, 1.0)
    assert rc.read_cost_of(Reader()) is Store.read_cost


@st.composite
def _covered_boxes(draw):
    nd = draw(st.integers(1, 4))
    chunk = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    offsets = tuple(draw(st.integers(0, c - 1)) for c in chunk)
    sizes = tuple(draw(st.integers(1, c - o)) for c, o in zip(chunk, offsets, strict=True))
    item = draw(st.sampled_from([1, 2, 4]))
    g = rc.BoxGeometry(chunk, offsets, sizes, item)
    level = draw(st.integers(0, max(0, g.outer - 1)))
    limit = draw(st.integers(g.span(g.outer), max(g.span(g.outer), g.span(0)) + 8))
    return g, level, limit


@settings(max_examples=200, deadline=None)
@given(_covered_boxes())
def test_cover_pieces_tile_the_box_each_within_the_staging_buffer(case):
    g, level, limit = case
    seen = []
    for offs, sizes in rc.cover_pieces(g, level, limit):
        piece = rc.BoxGeometry(g.chunk, offs, sizes, g.itemsize)
        assert piece.span(0) <= limit or piece.runs == 1
        seen += [tuple(o + i for o, i in zip(offs, idx, strict=True)) for idx in _indices(sizes)]
    assert seen == [tuple(o + i for o, i in zip(g.offsets, idx, strict=True)) for idx in _indices(g.sizes)]


def _indices(sizes):
    import itertools

    return list(itertools.product(*(range(s) for s in sizes)))


@st.composite
def _loads(draw):
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=nd, max_size=nd)))
    cuts = [draw(st.lists(st.integers(1, max(1, s - 1)), max_size=2)) for s in shape]
    tiles = [draw(st.lists(st.integers(1, max(1, s - 1)), max_size=2)) for s in shape]
    saved = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.float64]))
    dest = draw(st.sampled_from([saved, saved, torch.float32, torch.bfloat16]))
    if saved == torch.int16 or dest == torch.int16:
        dest = saved
    fmt = draw(st.sampled_from(["native", "hf", "torch-dcp"]))
    mode = draw(st.sampled_from(["model", "exact", "cover"]))
    limit = draw(st.sampled_from([8, 64, 1024, 16 * MiB]))
    composed = draw(st.booleans())  # through sources= (a SourcedReader), or the saved name
    return shape, cuts, tiles, saved, dest, fmt, mode, limit, composed, random.Random(draw(st.integers(0, 2**32)))  # used on reading threads


def _write(path, fmt, full, cuts):
    if fmt == "native":
        cases.write_chunked(path, full, cuts, files=2)
    elif fmt == "hf":
        os.makedirs(path)
        save_file(full, os.path.join(path, "model.safetensors"))
    else:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            tdcp.save(full, checkpoint_id=path, no_dist=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_loads())
def test_every_choice_of_the_model_loads_the_saved_values(case):
    shape, cuts, tiles, saved, dest, fmt, mode, limit, composed, rnd = case
    g = torch.Generator().manual_seed(len(shape))
    full = {"t": (torch.randn(shape, generator=g) * 100).to(saved)}

    def forced(geom, cost, buffer):
        best = rc.choose(geom, cost, buffer)
        if mode == "exact" or geom.runs <= 1 or geom.span(geom.outer) > buffer:
            return rc.ReadChoice(False, geom.outer, geom.nbytes, 1, 0.0) if mode == "exact" else best
        if mode == "cover":
            return rc.ReadChoice(True, rnd.randrange(geom.outer), 0, 1, 0.0)
        return best

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_execute, "choose", forced)
        mp.setattr(_stage, "STAGE_BYTES", max(limit, 8))
        _load_and_check(shape, cuts, tiles, full, dest, fmt, composed, rnd, mode)


def _load_and_check(shape, cuts, tiles, full, dest, fmt, composed, rnd, mode):
    boxes = cases.grid(shape, tiles)
    if not composed:  # one destination of the saved name: one of the tiles
        boxes = [boxes[rnd.randrange(len(boxes))]]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        _write(path, fmt, full, {"t": cuts})
        state = {f"d{j}" if composed else "t": Chunk(_poisoned(sizes, dest), shape, offsets)
                 for j, (offsets, sizes) in enumerate(boxes)}
        dcp_load.load(state, checkpoint_id=path, no_dist=True, sources={k: "t" for k in state} if composed else None)
    for j, (offsets, sizes) in enumerate(boxes):
        want = cases.box(full["t"], offsets, sizes).to(dest)
        got = state[f"d{j}" if composed else "t"].tensor
        assert torch.equal(got, want), (j, offsets, sizes, fmt, mode)


def _poisoned(sizes, dtype):
    return torch.empty(sizes, dtype=dtype).view(torch.uint8).fill_(0x7F).view(dtype)


@pytest.mark.parametrize("fmt", ["hf", "torch-dcp"])
def test_a_row_parallel_shard_takes_one_read_per_chunk_not_per_row(tmp_path, monkeypatch, fmt):
    """Regression: a (4096, 64) Shard(1) half was one run per row (8191 iovecs in 8
    ``preadv`` calls); covered, it is one range read."""
    full = {"w": torch.randn(4096, 64).to(torch.bfloat16), "b": torch.randn(64)}
    path = str(tmp_path / "ckpt")
    _write(path, fmt, full, {})
    segments = []
    real = os.preadv

    def counting(fd, buffers, offset, *a):
        segments.append(len(buffers))
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", counting)
    state = {"w": Chunk(torch.full((4096, 32), 7.0, dtype=torch.bfloat16), (4096, 64), (0, 32)),
             "b": Chunk(torch.full((32,), 7.0), (64,), (32,))}
    report = dcp_load.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["w"].tensor, full["w"][:, 32:]) and torch.equal(state["b"].tensor, full["b"][32:])
    assert sum(segments) <= 12, segments  # headers and indexes included: a few per file
    assert report.bytes_read == (4096 * 32 * 2 + 32 * 4) or fmt == "torch-dcp"


def test_covering_reads_count_what_they_fetch(tmp_path):
    from dcp_reader import open_checkpoint

    w = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(str(tmp_path)) as reader:
        chunk = reader.metadata.tensors["w"].chunks[0]
        need = reader.covering_bytes("w", chunk, (0, 2), (64, 4))
        assert need == (63 * 8 + 6) * 4 - 2 * 4
        buf = torch.zeros(need, dtype=torch.uint8)
        box = reader.read_covering("w", chunk, (0, 2), (64, 4), buf)
        assert torch.equal(box, w[:, 2:6])
        assert reader.bytes_read == 64 * 4 * 4 and reader.bytes_fetched == need
        assert math.prod(box.shape) == 256


@pytest.mark.parametrize("dest", [torch.bfloat16, torch.float32])
def test_short_rows_of_a_hf_file_are_copied_out_of_a_map(tmp_path, monkeypatch, dest):
    """A Shard(1) third of a (4096, 96) bf16 weight (64 B runs, 192 B apart): copied out of a
    memory map (a cast through a staging buffer), never covered, and the report counts the
    box's bytes, fetched as read."""
    from dcp_reader.formats import _safetensors_file

    monkeypatch.delenv("DCP_MAPPED_READS", raising=False)  # the default
    full = torch.randn(4096, 96).to(torch.bfloat16)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    mapped = []
    real = _safetensors_file.map_runs
    monkeypatch.setattr(_safetensors_file, "map_runs", lambda *a, **k: mapped.append(real(*a, **k)) or mapped[-1])
    state = {"w": Chunk(_poisoned((4096, 32), dest), (4096, 96), (0, 32))}
    report = dcp_load.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["w"].tensor, full[:, 32:64].to(dest))
    assert mapped and all(mapped)
    assert report.bytes_read == 4096 * 32 * 2 and report.bytes_fetched == report.bytes_read
