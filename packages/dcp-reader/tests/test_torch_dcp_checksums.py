"""Checksums of torch DCP checkpoints that dcp saved (``dcp-checksums.json``): reads,
``dcp_load.load`` and ``verify_checkpoint`` find a flipped byte in a chunk's tensor data or
in a value's blob, naming file and entry; an unusable checksums file is a MetadataError
naming it; a checkpoint torch saved has none and loads unverified."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from dcp_load import LoadError, load, save
from dcp_load.cli._main import main as dcp_main
from dcp_reader import ChecksumError, MetadataError, open_checkpoint, verify_checkpoint
from dcp_reader.integrity._checksum import block_digests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SUMS = "dcp-checksums.json"


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "i64": torch.arange(-20, 20),
        "u8": torch.arange(0, 250, dtype=torch.uint8).reshape(25, 10),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "step": 7,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "name": "adam"},
    }


def _save(path, state=None):
    state = _state() if state is None else state
    save(state, checkpoint_id=str(path), no_dist=True, format="torch_dcp")
    return state


def _data_offset(path, name, at=0):
    """(data file, file offset of byte ``at`` of tensor ``name``'s data in its blob)."""
    with open_checkpoint(path, verify_checksums=False) as r:
        t = r.metadata.tensors[name]
        c = t.chunks[0]
        _, layout = r._dcp_layout(t.dtype, name, c)
        return c.file, c.storage[0] + layout.start + at


def _flip(path, file, offset, mask=0x01):
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _zeros_like(state):
    """A state dict to load into: zero tensors, and values of the same structure."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, tuple):
        return tuple(_zeros_like(v) for v in state)
    return type(state)()


def test_every_dtype_loads_equal_and_verified(tmp_path):
    state = _save(tmp_path)
    with open_checkpoint(tmp_path) as r:
        assert all(c.checksum for t in r.metadata.tensors.values() for c in t.chunks)
        assert all(v.checksum for v in r.metadata.values.values())
        for name, t in r.metadata.tensors.items():
            c = t.chunks[0]
            assert torch.equal(r.read(name, c, c.offsets, c.sizes), state[name]), name
        assert r.read_value("step") == 7
    target = _zeros_like(state)
    load(target, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), k
    assert target["step"] == 7 and target["cfg"] == state["cfg"]
    report = verify_checkpoint(tmp_path)
    assert report.ok, report.problems
    assert report.chunks_with_checksums == report.chunks == 8
    assert report.values_with_checksums == report.values == 4  # step, cfg.lr, cfg.betas, cfg.name
    assert report.bytes_verified == sum(v.numel() * v.element_size() for v in state.values()
                                        if isinstance(v, torch.Tensor))


def test_non_contiguous_sources(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"t": torch.randn(40, 70, generator=g).t(), "s": torch.randn(30, 30, generator=g)[::2, 3:9],
             "a": torch.randn(3000, 100, generator=g), "b": torch.randn(5, 7, generator=g).t().to(torch.bfloat16)}
    _save(tmp_path, state)
    assert verify_checkpoint(tmp_path).ok
    target = _zeros_like(state)
    load(target, checkpoint_id=str(tmp_path), no_dist=True)
    for k in state:
        assert torch.equal(target[k], state[k]), k


def test_flipped_tensor_byte_is_named_by_read_load_and_verify(tmp_path, capsys):
    state = _save(tmp_path)
    file, off = _data_offset(tmp_path, "bf16", 11)
    _flip(tmp_path, file, off)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["bf16"].chunks[0]
        with pytest.raises(ChecksumError) as e:
            r.read("bf16", c, (3, 0), (1, 5))
        assert e.value.key == "bf16" and e.value.path.endswith(file) and "'bf16'" in str(e.value)
        c = r.metadata.tensors["f32"].chunks[0]
        assert torch.equal(r.read("f32", c, c.offsets, c.sizes), state["f32"])  # the other tensors read
    with open_checkpoint(tmp_path, verify_checksums=False) as r:
        c = r.metadata.tensors["bf16"].chunks[0]
        assert not torch.equal(r.read("bf16", c, c.offsets, c.sizes), state["bf16"])  # unverified: wrong data
    with pytest.raises(LoadError, match=f"ChecksumError.*{file}.*tensor 'bf16'"):
        load(_zeros_like(state), checkpoint_id=str(tmp_path), no_dist=True)
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and "'bf16'" in report.problems[0] and file in report.problems[0]
    assert dcp_main(["verify", str(tmp_path)]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_flipped_value_byte_is_named_by_read_load_and_verify(tmp_path):
    state = _save(tmp_path)
    with open_checkpoint(tmp_path) as r:
        v = r.metadata.values["step"]
    _flip(tmp_path, v.file, v.storage[0] + v.storage[1] // 2)
    with open_checkpoint(tmp_path) as r:
        with pytest.raises(ChecksumError, match=f"value 'step' is stored at bytes .* of '{v.file}'") as e:
            r.read_value("step")
        assert e.value.key == "step"
        assert r.read_value("cfg.lr") == 0.1
    target = _zeros_like(state)
    with pytest.raises(LoadError, match="ChecksumError.*value 'step'"):
        load(target, checkpoint_id=str(tmp_path), no_dist=True)
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and "value 'step'" in report.problems[0]


def _three_blocks(path):
    state = {"big": torch.arange(3 * 1024 * 1024 + 100, dtype=torch.float32).reshape(-1, 4)}
    _save(path, state)
    return state


def test_byte_outside_a_narrowed_read_is_found_by_verify(tmp_path):
    state = _three_blocks(tmp_path)
    file, off = _data_offset(tmp_path, "big", 2 * 4 * 1024 * 1024 + 12345)  # block 2
    _flip(tmp_path, file, off)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["big"].chunks[0]
        assert torch.equal(r.read("big", c, (10, 0), (100, 4)), state["big"][10:110])  # block 0 only
        out = torch.empty(100, 4)
        r.read_into("big", c, (300_000, 0), (100, 4), out)  # block 1
        assert torch.equal(out, state["big"][300_000:300_100])
        with pytest.raises(ChecksumError, match="block 2"):
            r.read("big", c, (600_000, 1), (3, 2))
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and "block 2" in report.problems[0] and "'big'" in report.problems[0]


def test_covering_and_into_reads_verify(tmp_path):
    state = _three_blocks(tmp_path)
    file, off = _data_offset(tmp_path, "big", 4 * 1024 * 1024 + 8)  # block 1
    _flip(tmp_path, file, off)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["big"].chunks[0]
        buf = torch.empty(r.covering_bytes("big", c, (0, 0), (10, 4)), dtype=torch.uint8)
        box = r.read_covering("big", c, (0, 0), (10, 4), buf)
        assert torch.equal(box, state["big"][:10])
        need = r.covering_bytes("big", c, (262_200, 1), (5, 2))
        assert need >= 4 * 1024 * 1024  # widened to the whole block to verify
        with pytest.raises(ChecksumError, match="block 1"):
            r.read_covering("big", c, (262_200, 1), (5, 2), torch.empty(need, dtype=torch.uint8))
    with open_checkpoint(tmp_path) as r, pytest.raises(ChecksumError, match="block 1"):
        r.read_into("big", c, (262_144, 0), (262_144, 4), torch.empty(262_144, 4))  # exactly block 1
    with open_checkpoint(tmp_path) as r:
        out = torch.empty(262_144, 4)
        r.read_into("big", c, (262_144, 0), (262_144, 4), out, verify=False)  # not asked to verify
        assert not torch.equal(out, state["big"][262_144:524_288])


def _rewrite(path, edit):
    doc = json.loads((path / SUMS).read_text())
    doc = edit(doc)
    (path / SUMS).write_text(doc if isinstance(doc, str) else json.dumps(doc))


def _set(doc, keys, value):
    d = doc
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value
    return doc


HOSTILE = {
    "not json": lambda d: "{not json",
    "a list": lambda d: [],
    "tensors a list": lambda d: _set(d, ["tensors"], []),
    "extra key": lambda d: _set(d, ["version"], 2),
    "values missing": lambda d: {"tensors": d["tensors"]},
    "chunk sum an int": lambda d: _set(d, ["tensors", "f32", "0,0"], 12),
    "chunk sums a str": lambda d: _set(d, ["tensors", "f32"], "xxh3-64/4194304:00"),
    "unknown name": lambda d: _set(d, ["tensors", "nope"], {"0": "xxh3-64/4194304:0000000000000000"}),
    "unknown offsets": lambda d: _set(d, ["tensors", "f32", "1,0"], "xxh3-64/4194304:0000000000000000"),
    "tensor missing": lambda d: (d["tensors"].pop("f32"), d)[1],
    "wrong block count": lambda d: _set(d, ["tensors", "f32", "0,0"], "xxh3-64/16:0000000000000000"),
    "other algorithm": lambda d: _set(d, ["tensors", "f32", "0,0"], "md5/4194304:0000000000000000"),
    "loose hex": lambda d: _set(d, ["tensors", "f32", "0,0"], "xxh3-64/4194304:0x00000000000000"),
    "unknown value": lambda d: _set(d, ["values", "ghost"], "xxh3-64:0000000000000000"),
    "value sum malformed": lambda d: _set(d, ["values", "step"], "xxh3-64:zz"),
    "value sum a list": lambda d: _set(d, ["values", "step"], ["xxh3-64:0000000000000000"]),
    "huge": lambda d: json.dumps(d) + " " * (2 * 1024 * 1024),
    "deep": lambda d: "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_unusable_checksums_file_is_a_metadata_error_naming_it(tmp_path, case):
    _save(tmp_path)
    _rewrite(tmp_path, HOSTILE[case])
    with pytest.raises(MetadataError) as e:
        open_checkpoint(tmp_path)
    assert e.value.path == os.path.join(os.path.realpath(tmp_path), SUMS), e.value
    if case in ("unknown name", "unknown offsets", "tensor missing", "wrong block count"):
        assert e.value.key == ("nope" if case == "unknown name" else "f32")
    if case in ("unknown value", "value sum malformed"):
        assert e.value.key == ("ghost" if case == "unknown value" else "step")
    report = verify_checkpoint(tmp_path)  # a problem; the rest checked without the file
    assert len(report.problems) == 1 and SUMS in report.problems[0] and report.chunks == 8


def test_torch_saved_checkpoint_loads_unverified(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(8, 8), "b": torch.arange(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert not (tmp_path / SUMS).exists()
    with open_checkpoint(tmp_path) as r:
        assert all(c.checksum is None for t in r.metadata.tensors.values() for c in t.chunks)
    target = {"w": torch.zeros(8, 8), "b": torch.zeros(5, dtype=torch.int64)}
    load(target, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.chunks_with_checksums == 0
    assert dcp_main(["verify", str(tmp_path)]) == 0
    assert "no checksums (not saved by dcp" in capsys.readouterr().out


def test_torch_save_over_a_dcp_save_ignores_the_stale_checksums(tmp_path):
    import torch.distributed.checkpoint as dcp

    _save(tmp_path)
    state = {"w": torch.randn(4, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert (tmp_path / SUMS).exists()  # left by dcp's save; torch's files only in the metadata
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert c.checksum is None and torch.equal(r.read("w", c, c.offsets, c.sizes), state["w"])


def test_metadata_round_trip_keeps_checksums(tmp_path):
    _save(tmp_path)
    file, off = _data_offset(tmp_path, "f32", 40)
    with open_checkpoint(tmp_path) as r:
        meta = type(r.metadata).from_json(r.metadata.to_json())
    _flip(tmp_path, file, off)
    with open_checkpoint(tmp_path, metadata=meta) as r:
        c = r.metadata.tensors["f32"].chunks[0]
        with pytest.raises(ChecksumError):
            r.read("f32", c, c.offsets, c.sizes)


# -- property: a flipped byte is found by every read whose blocks cover it ----------------
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.float64]


@st.composite
def _cases(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    dtype = draw(st.sampled_from(_DTYPES))
    lo = tuple(draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, lo, strict=True))
    block = draw(st.sampled_from([8, 16, 64, 1 << 22]))
    width = torch.empty((), dtype=dtype).element_size()
    flip = draw(st.integers(0, torch.Size(shape).numel() * width - 1))
    how = draw(st.sampled_from(["read", "read_into", "covering"]))
    return shape, dtype, lo, size, block, flip, how


def _box_bytes(shape, lo, size, width):
    """[first, last] byte of the box's row-major span in the chunk."""
    strides = [width] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first = sum(o * s for o, s in zip(lo, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(lo, size, strides, strict=True)) + width - 1
    return first, last


def _read(r, c, lo, size, how, dtype):
    if how == "read":
        return r.read("x", c, lo, size)
    if how == "read_into":
        out = torch.empty(size, dtype=dtype)
        r.read_into("x", c, lo, size, out)
        return out
    buf = torch.empty(r.covering_bytes("x", c, lo, size), dtype=torch.uint8)
    return r.read_covering("x", c, lo, size, buf).clone()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_cases())
def test_flipped_byte_is_found_by_any_read_covering_its_block(tmp_path_factory, case):
    shape, dtype, lo, size, block, flip, how = case
    path = tmp_path_factory.mktemp("prop")
    x = (torch.randn(shape) * 50).to(dtype)
    _save(path, {"x": x})
    with open_checkpoint(path, verify_checksums=False) as r:  # smaller blocks over the same bytes
        c = r.metadata.tensors["x"].chunks[0]
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        _rewrite(path, lambda d: _set(d, ["tensors", "x", ",".join(map(str, c.offsets))],
                                      block_digests(raw, block)))
    file, off = _data_offset(path, "x", flip)
    _flip(path, file, off, 0x10)
    width = x.element_size()
    first, last = _box_bytes(shape, lo, size, width)
    covered = first // block <= flip // block <= last // block
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["x"].chunks[0]
        if covered:
            with pytest.raises(ChecksumError) as e:
                _read(r, c, lo, size, how, dtype)
            assert e.value.key == "x" and e.value.path.endswith(file)
        else:
            got = _read(r, c, lo, size, how, dtype)
            box = tuple(slice(o, o + n) for o, n in zip(lo, size, strict=True))
            assert torch.equal(got, x[box])
