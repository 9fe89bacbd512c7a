"""hyper-parallel checkpoints (format "hyper-parallel"), written by tests/hyper_writer.py from
the format's description: random chunkings over random ranks (ragged ``__dcp_chunk_`` keys,
also when a key collides with another fqn), every pickle protocol, with and without
``tensor_key``, per-rank ``{rank}.metadata``, pickled values, and data files written the way
MindSpore writes them (MindSpore dtype names, ``{"format": "ms"}`` header metadata)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from dcp_reader import (
    MissingMetadataError,
    UnsafePickleError,
    detect_format,
    is_rank_local,
    open_checkpoint,
)
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import hyper_writer as hw  # noqa: E402

FMT = "hyper-parallel"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assemble(r, name: str, framework: str = "torch") -> torch.Tensor:
    """The whole tensor from its chunks, into a poisoned target."""
    t = r.metadata.tensors[name]
    dt = getattr(torch, t.dtype)
    out = torch.full(t.shape, 77, dtype=torch.float32).to(dt)
    for c in t.chunks:
        part = r.read(name, c, c.offsets, c.sizes, framework=framework)
        if framework == "numpy":
            part = torch.from_numpy(np.array(part)).view(dt)
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = part
    return out


def _cuts(n: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.sets(st.integers(1, max(1, n - 1)), max_size=3).map(
        lambda s: [(a, b - a) for a, b in zip([0, *sorted(x for x in s if x < n)],
                                                [*sorted(x for x in s if x < n), n], strict=True)])


@st.composite
def layouts(draw):
    """A tensor, its random grid chunking, each chunk's rank, a dtype and how to save."""
    rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 7))
    boxes = [((r0, c0), (rs, cs)) for r0, rs in draw(_cuts(rows)) for c0, cs in draw(_cuts(cols))]
    owners = draw(st.lists(st.integers(0, 2), min_size=len(boxes), max_size=len(boxes)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.bool]))
    protocol = draw(st.sampled_from([0, 2, 4, 5]))
    return rows, cols, boxes, owners, dtype, protocol, draw(st.booleans()), draw(st.booleans())


def _full(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.data())
def test_random_chunkings_read_back_exactly(layout, data):
    rows, cols, boxes, owners, dtype, protocol, collide, tensor_key = layout
    w = _full((rows, cols), dtype, rows * 31 + cols)
    decoy = _full((3,), torch.float32, 7)
    ranks: dict[int, dict] = {}
    for (off, size), rank in zip(boxes, owners, strict=True):
        piece = w[off[0]:off[0] + size[0], off[1]:off[1] + size[1]].clone()
        ranks.setdefault(rank, {}).setdefault("w", []).append((off, piece))
    several = [r for r, items in ranks.items() if len(items["w"]) > 1]
    shapes = {"w": (rows, cols), "s": ()}
    ranks.setdefault(owners[0], {})["s"] = [((), torch.tensor(2.5))]
    if collide and several:  # an fqn equal to the first ragged key: the key gets "_" appended
        ranks[several[0]]["w.__dcp_chunk_0"] = [((0,), decoy)]
        shapes["w.__dcp_chunk_0"] = (3,)
    with tempfile.TemporaryDirectory() as d:
        hw.write_checkpoint(d, ranks, shapes, tensor_key=tensor_key)
        if protocol != 4:  # rewrite the metadata with another pickle protocol
            with hw.seed_modules(), open(f"{d}/.metadata", "rb") as f:
                md = __import__("pickle").load(f)
            hw.dump_metadata(md, f"{d}/.metadata", protocol=protocol)
        assert detect_format(d) == FMT
        with open_checkpoint(d) as r:
            assert r.format == FMT and set(r.metadata.tensors) == set(shapes)
            assert same(assemble(r, "w"), w)
            assert same(assemble(r, "s"), torch.tensor(2.5))
            if collide and several:
                assert same(assemble(r, "w.__dcp_chunk_0"), decoy)
                keys = {c.key for c in r.metadata.tensors["w"].chunks}
                assert "w.__dcp_chunk_0_" in keys
            # a random box inside a random chunk, in global coordinates
            c = data.draw(st.sampled_from(r.metadata.tensors["w"].chunks))
            lo = [data.draw(st.integers(o, o + s - 1)) for o, s in zip(c.offsets, c.sizes, strict=True)]
            hi = [data.draw(st.integers(a + 1, o + s)) for a, o, s in zip(lo, c.offsets, c.sizes, strict=True)]
            box = r.read("w", c, tuple(lo), tuple(b - a for a, b in zip(lo, hi, strict=True)))
            assert same(box, w[lo[0]:hi[0], lo[1]:hi[1]])


def test_ragged_key_colliding_with_an_fqn_gets_underscores(tmp_path):
    w, other, other2 = torch.arange(12.0).reshape(4, 3), torch.ones(2), torch.zeros(1)
    ranks = {0: {"w": [((0, 0), w[:1].clone()), ((1, 0), w[1:].clone())],
                 "w.__dcp_chunk_0": [((0,), other)], "w.__dcp_chunk_0_": [((0,), other2)]}}
    hw.write_checkpoint(tmp_path, ranks, {"w": (4, 3), "w.__dcp_chunk_0": (2,), "w.__dcp_chunk_0_": (1,)})
    with open_checkpoint(tmp_path) as r:
        assert [c.key for c in r.metadata.tensors["w"].chunks] == ["w.__dcp_chunk_0__", "w.__dcp_chunk_1"]
        assert same(assemble(r, "w"), w) and same(assemble(r, "w.__dcp_chunk_0"), other)
        assert same(assemble(r, "w.__dcp_chunk_0_"), other2)


def _two_ranks() -> tuple[dict, dict, dict]:
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    b = torch.arange(8, dtype=torch.bfloat16)
    ranks = {0: {"w": [((0, 0), w[:4].clone())], "b": [((0,), b[:4].clone())], "step": 7,
                 "opt": {"lr": 0.1, "betas": (0.9, 0.95)}},
             1: {"w": [((4, 0), w[4:].clone())], "b": [((4,), b[4:].clone())], "names": ["a", "b"]}}
    return ranks, {"w": (8, 6), "b": (8,)}, {"w": w, "b": b}


def test_values_need_allow_pickle(tmp_path):
    ranks, shapes, _ = _two_ranks()
    hw.write_checkpoint(tmp_path, ranks, shapes)
    with open_checkpoint(tmp_path) as r:
        assert set(r.metadata.values) == {"step", "opt", "names"}
        assert r.metadata.values["names"].file == "_rank1_.bytes"
        with pytest.raises(UnsafePickleError) as e:
            r.read_value("opt")
        assert e.value.key == "opt" and "allow_pickle=True" in str(e.value)
    with open_checkpoint(tmp_path, allow_pickle=True) as r:
        assert r.read_value("step") == 7
        assert r.read_value("opt") == {"lr": 0.1, "betas": (0.9, 0.95)}
        assert r.read_value("names") == ["a", "b"]


def test_rank_local_metadata(tmp_path):
    ranks, shapes, full = _two_ranks()
    hw.write_checkpoint(tmp_path, ranks, shapes, per_rank=True)
    assert not (tmp_path / ".metadata").exists() and (tmp_path / "1.metadata").exists()
    assert detect_format(tmp_path) == FMT and is_rank_local(tmp_path)
    with pytest.raises(MissingMetadataError, match="rank=") as e:
        open_checkpoint(tmp_path)
    assert "0.metadata" in str(e.value)
    for rank in (0, 1):
        with open_checkpoint(tmp_path, rank=rank, allow_pickle=True) as r:
            t = r.metadata.tensors["w"]
            assert t.shape == (8, 6) and len(t.chunks) == 1 and t.chunks[0].file == f"_rank{rank}_.safetensors"
            c = t.chunks[0]
            assert same(r.read("w", c, c.offsets, c.sizes), full["w"][rank * 4:rank * 4 + 4])
            assert set(r.metadata.values) == ({"step", "opt"} if rank == 0 else {"names"})
    with pytest.raises(MissingMetadataError, match="2.metadata"):
        open_checkpoint(tmp_path, rank=2)


def test_rank_local_is_false_with_global_metadata(tmp_path):
    ranks, shapes, full = _two_ranks()
    hw.write_checkpoint(tmp_path, ranks, shapes)
    assert not is_rank_local(tmp_path) and not is_rank_local(tmp_path / "absent")
    with open_checkpoint(tmp_path, rank=1) as r:  # .metadata wins: rank is ignored
        assert same(assemble(r, "w"), full["w"]) and same(assemble(r, "b"), full["b"])


def test_mindspore_style_files_and_dtype_names(tmp_path):
    """numpy arrays saved by safetensors with MindSpore's dtype names ("Float32") and header
    metadata: what a MindSpore rank of the seed writes, without MindSpore installed."""
    w = np.arange(30, dtype=np.float32).reshape(6, 5)
    ids = np.arange(6, dtype=np.int64) * 3
    ranks = {0: {"w": [((0, 0), w[:2].copy()), ((2, 0), w[2:3].copy())], "ids": [((0,), ids.copy())]},
             1: {"w": [((3, 0), w[3:].copy())]}}
    hw.write_checkpoint(tmp_path, ranks, {"w": (6, 5), "ids": (6,)}, framework="numpy")
    with open_checkpoint(tmp_path) as r:
        assert r.metadata.tensors["w"].dtype == "float32" and r.metadata.tensors["ids"].dtype == "int64"
        for fw in ("torch", "numpy"):
            assert np.array_equal(assemble(r, "w", fw).numpy(), w)
            assert np.array_equal(assemble(r, "ids", fw).numpy(), ids)


@pytest.mark.parametrize("dtype,name", [("torch.float16", "float16"), ("torch.half", "float16"),
                                        ("BFloat16", "bfloat16"), ("Float8E4M3FN", "float8_e4m3fn"),
                                        ("UInt8", "uint8"), ("Bool", "bool"), ("Complex64", "complex64")])
def test_dtype_names(dtype, name):
    from dcp_reader.formats._hyper import neutral_dtype

    assert neutral_dtype(dtype, path="p", fqn="x") == name


@pytest.mark.mindspore
def test_mindspore_saved_files(tmp_path):
    """Data files written by mindspore.save_checkpoint(format="safetensors"), as the seed's
    MindSpore platform writes them."""
    ms = pytest.importorskip("mindspore", reason="needs MindSpore (nox -s tests-mindspore)")
    w = np.arange(40, dtype=np.float32).reshape(8, 5) / 3
    mk = lambda a, dt=None: ms.Tensor(a) if dt is None else ms.Tensor(a).astype(dt)  # noqa: E731
    ranks = {0: {"w": [((0, 0), mk(w[:3])), ((3, 0), mk(w[3:5]))], "h": [((0,), mk(w[0], ms.bfloat16))]},
             1: {"w": [((5, 0), mk(w[5:]))], "n": [((), mk(np.int32(4)))]}}
    hw.write_checkpoint(tmp_path, ranks, {"w": (8, 5), "h": (5,), "n": ()}, framework="mindspore")
    with open_checkpoint(tmp_path) as r:
        assert {n: t.dtype for n, t in r.metadata.tensors.items()} == {"w": "float32", "h": "bfloat16", "n": "int32"}
        assert np.array_equal(assemble(r, "w").numpy(), w)
        assert same(assemble(r, "h"), torch.from_numpy(w[0]).to(torch.bfloat16))
        c = r.metadata.tensors["w"].chunks[1]
        got = r.read("w", c, (3, 1), (2, 3), framework="mindspore")
        assert np.array_equal(got.asnumpy(), w[3:5, 1:4])
