"""Narrowed reads inside torch.distributed.checkpoint's torch.save blobs (``.distcp``).

Property tests save random tensors (every dtype dcp-reader knows, bf16 and float8 among
them; 0-size and 0-dim shapes; transposed and sliced sources) with torch DCP's own
``FileSystemWriter`` in one process and read random boxes with ``read`` (torch and numpy)
and ``read_into``, each compared byte for byte with what ``torch.distributed.checkpoint.load``
itself loads into poisoned targets. Byte counts show that a box costs its rows (plus the
blob's index once), a legacy-format blob is loaded whole and counted, and every corrupt
blob (truncated, bad headers, lying sizes, a bad or hostile data.pkl, random byte flips) is
a typed error naming the file and the tensor."""

from __future__ import annotations

import io
import os
import pickle
import struct
import tempfile
import warnings
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_reader import (
    CheckpointError,
    MetadataError,
    TruncatedFileError,
    UnsafePickleError,
    open_checkpoint,
)
from dcp_reader._dtypes import itemsize
from dcp_reader.formats._torch_save_zip import HEAD, TAIL, CannotNarrow, parse_blob
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.uint16, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64]


def _save(sd, path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose every byte is 0x5A (no checkpoint here holds it)."""
    width = torch.empty((), dtype=dtype).element_size()
    return torch.full((max(1, int(np.prod(shape))) * width,), 0x5A, dtype=torch.uint8).view(dtype)[
        :int(np.prod(shape))].reshape(shape).clone()


def _torch_loaded(sd, path) -> dict[str, torch.Tensor]:
    """What torch DCP itself loads, into targets poisoned with 0x5A bytes."""
    out = {k: _poisoned(tuple(t.shape), t.dtype) for k, t in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _bytes(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    if not t.numel():
        return np.empty(0, dtype=np.uint8)
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8).numpy()


def _random(dtype: torch.dtype, shape: tuple[int, ...], layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "transposed" and len(shape) >= 2:
        base_shape = tuple(reversed(shape))
    elif layout == "sliced" and shape:
        base_shape = (shape[0] + 2, *shape[1:])
    else:
        base_shape = shape
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (max(1, int(np.prod(base_shape))) * width,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw %= 2
    base = raw.view(dtype)[:int(np.prod(base_shape))].reshape(base_shape)
    if layout == "transposed" and len(shape) >= 2:
        return base.permute(*reversed(range(len(shape))))
    if layout == "sliced" and shape:
        return base[1:1 + shape[0]]
    return base


@st.composite
def _case(draw):
    tensors = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
        layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
        dtype = draw(st.sampled_from(DTYPES))
        boxes = []
        for _ in range(draw(st.integers(1, 3))):
            lo = tuple(draw(st.integers(0, s)) for s in shape)
            hi = tuple(draw(st.integers(a, s)) for a, s in zip(lo, shape, strict=True))
            boxes.append((lo, tuple(b - a for a, b in zip(lo, hi, strict=True))))
        tensors[f"t{i}"] = (_random(dtype, shape, layout, draw(st.integers(0, 2**16))), boxes)
    return tensors


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_random_boxes_equal_what_torch_dcp_loads(case):
    sd = {k: t for k, (t, _) in case.items()}
    with tempfile.TemporaryDirectory() as d:
        _save(sd, d)
        want = _torch_loaded(sd, d)
        with open_checkpoint(d) as r:
            for name, (_, boxes) in case.items():
                chunk = r.metadata.tensors[name].chunks[0]
                for lo, sizes in boxes:
                    box = want[name][tuple(slice(a, a + s) for a, s in zip(lo, sizes, strict=True))]
                    got = r.read(name, chunk, lo, sizes)
                    assert got.dtype == box.dtype and tuple(got.shape) == tuple(box.shape)
                    if got.is_contiguous() and got.dim() and got.numel():
                        got.view(torch.uint8)  # a contiguous box views as bytes, as torch's own do
                    assert np.array_equal(_bytes(got), _bytes(box)), (name, lo, sizes)
                    assert np.array_equal(_bytes(r.read(name, chunk, lo, sizes, framework="numpy")), _bytes(box))
                    out = _poisoned(sizes, box.dtype)
                    r.read_into(name, chunk, lo, sizes, out)
                    assert np.array_equal(_bytes(out), _bytes(box)), (name, lo, sizes)
            assert r.torch_save_reads["whole"] == 0  # every torch.save layout here is narrowed


def test_a_box_costs_its_rows_and_the_index_once(tmp_path):
    w = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
    _save({"w": w}, tmp_path)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert c.storage[1] > 256 * 1024
        assert torch.equal(r.read("w", c, (100, 0), (10, 256)), w[100:110])
        assert r.bytes_read == HEAD + TAIL + 10 * 1024  # the index: the blob's first and last KiB
        out = torch.empty(20, 256)
        r.read_into("w", c, (0, 0), (20, 256), out)
        assert torch.equal(out, w[:20]) and r.bytes_read == HEAD + TAIL + 30 * 1024
        before = r.bytes_read
        assert torch.equal(r.read("w", c, (0, 0), (256, 128)), w[:, :128])  # half of every row: the span
        assert r.bytes_read - before == 256 * 128 * 4  # is read; the box is counted, as for safetensors
        before = r.bytes_read
        assert torch.equal(r.read("w", c, (0, 8), (256, 16)), w[:, 8:24])  # sparse: one read per row
        assert r.bytes_read - before == 256 * 16 * 4
        assert r.torch_save_reads == {"narrowed": 4, "strided": 0, "whole": 0}


def test_a_transposed_source_is_read_as_its_span(tmp_path):
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).t()  # (32, 64), strides (1, 32)
    _save({"w": w}, tmp_path)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        out = torch.full((4, 64), -123.0)
        r.read_into("w", c, (3, 0), (4, 64), out)
        assert torch.equal(out, w[3:7]) and r.torch_save_reads["strided"] == 1


def _meta(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, trusted, file


def _info(md, fqn):
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def _write_meta(path, md) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_a_legacy_format_blob_is_loaded_whole_and_counted(tmp_path):
    w = torch.randn(40, 8)
    _save({"w": w}, tmp_path)
    md = _meta(tmp_path)
    info = _info(md, "w")
    buf = io.BytesIO()
    torch.save(w, buf, _use_new_zipfile_serialization=False)
    (tmp_path / info.relative_path).write_bytes(buf.getvalue())
    info.offset, info.length = 0, len(buf.getvalue())
    _write_meta(tmp_path, md)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        r.check_chunk("w", c)  # loads it whole, once
        assert torch.equal(r.read("w", c, (5, 0), (3, 8)), w[5:8])
        assert torch.equal(r.read("w", c, (9, 0), (3, 8)), w[9:12])
        assert r.torch_save_reads == {"narrowed": 0, "strided": 0, "whole": 1}


# -- corrupt blobs ---------------------------------------------------------------------------
def _blob_ckpt(path):
    """A checkpoint whose "w" blob is larger than HEAD + TAIL; (its file, offset, bytes)."""
    _save({"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), "b": torch.ones(3)}, path)
    info = _info(_meta(path), "w")
    f = path / info.relative_path
    return f, info.offset, f.read_bytes()[info.offset:info.offset + info.length]


def _patch(f, at: int, data: bytes) -> None:
    with open(f, "r+b") as h:
        h.seek(at)
        h.write(data)


def _central(blob: bytes, suffix: bytes) -> int:
    """Where the central directory entry whose name ends with ``suffix`` starts."""
    p = blob.find(b"PK\x01\x02")
    while p >= 0:
        n = struct.unpack("<H", blob[p + 28:p + 30])[0]
        if blob[p + 46:p + 46 + n].endswith(suffix):
            return p
        p = blob.find(b"PK\x01\x02", p + 4)
    raise AssertionError(suffix)


def _parse_file(tmp_path, blob: bytes):
    """``parse_blob`` of ``blob`` written alone to a file: (layout, bytes read)."""
    f = tmp_path / "b.bin"
    f.write_bytes(blob)
    fd = os.open(f, os.O_RDONLY)
    try:
        return parse_blob(fd, 0, len(blob), path=str(f), key="t")
    finally:
        os.close(fd)


def _read_w(path, error=MetadataError, match=None):
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        with pytest.raises(error, match=match) as ei:
            r.read("w", c, (0, 0), (2, 32))
    assert ei.value.key == "w" and ei.value.path.endswith(".distcp")
    return ei.value


def test_check_chunk_finds_a_bad_blob_without_reading_data(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    with open_checkpoint(tmp_path) as r:
        for name, t in r.metadata.tensors.items():
            r.check_chunk(name, t.chunks[0])
        assert r.bytes_read == HEAD + TAIL + _info(_meta(tmp_path), "b").length  # indexes only
    local = struct.unpack("<I", blob[_central(blob, b"/data/0") + 42:][:4])[0]
    _patch(f, off + local, b"XX\x03\x04")
    with open_checkpoint(tmp_path) as r, pytest.raises(MetadataError, match="no local header"):
        r.check_chunk("w", r.metadata.tensors["w"].chunks[0])


def test_check_chunk_of_a_safetensors_chunk_reads_no_data(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path) as r:
        r.check_chunk("w", r.metadata.tensors["w"].chunks[0])
        assert r.bytes_read == 0


def test_a_shortened_blob_has_no_end_record(tmp_path):
    _blob_ckpt(tmp_path)
    md = _meta(tmp_path)
    _info(md, "w").length -= 100
    _write_meta(tmp_path, md)
    _read_w(tmp_path, match="end-of-central-directory")


def test_a_file_truncated_after_open_is_a_truncated_file_error(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        os.truncate(f, off + 600)
        with pytest.raises(TruncatedFileError) as ei:
            r.read("w", c, (0, 0), (2, 32))
    assert ei.value.key == "w"


def test_a_bad_local_header_is_a_metadata_error(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    local = struct.unpack("<I", blob[_central(blob, b"/data/0") + 42:][:4])[0]
    _patch(f, off + local, b"XX\x03\x04")
    _read_w(tmp_path, match="no local header")


def test_a_lying_storage_size_is_a_metadata_error(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    p = _central(blob, b"/data/0")
    _patch(f, off + p + 20, struct.pack("<II", 64 * 32 * 4 + 4, 64 * 32 * 4 + 4))
    _read_w(tmp_path, match="data.pkl says")
    _patch(f, off + p + 20, struct.pack("<II", 64 * 32 * 4, 64 * 32 * 4))
    _patch(f, off + _central(blob, b"/byteorder") + 20, struct.pack("<II", 2**31, 2**31))
    _read_w(tmp_path, match="past the data section")


def test_a_directory_offset_outside_the_blob_is_a_metadata_error(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    eocd = blob.rfind(b"PK\x05\x06")
    _patch(f, off + eocd + 16, struct.pack("<I", len(blob) * 4))
    _read_w(tmp_path, match="central directory")


def test_a_garbage_data_pkl_is_a_metadata_error(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    at = blob.find(b"\x80\x02")  # data.pkl's first bytes (protocol 2)
    _patch(f, off + at, b"\x80\x02\xff\xfe garbage")
    _read_w(tmp_path, match="data.pkl")


def test_a_memo_bomb_in_data_pkl_is_refused(tmp_path):
    f, off, blob = _blob_ckpt(tmp_path)
    at = blob.find(b"\x80\x02")
    _patch(f, off + at, b"\x80\x04}r\x00\x00\x00\x08.")  # would make pickle allocate ~1.8 GB
    _read_w(tmp_path, UnsafePickleError, match="memo index")


def test_a_blob_holding_no_tensor_is_a_metadata_error(tmp_path):
    _save({"w": torch.ones(64, 32), "step": 12}, tmp_path)
    md = _meta(tmp_path)
    w, step = _info(md, "w"), _info(md, "step")
    w.relative_path, w.offset, w.length = step.relative_path, step.offset, step.length
    step.offset, step.length = 0, 0
    _write_meta(tmp_path, md)
    _read_w(tmp_path, match="not a tensor")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_damage_is_a_typed_error_or_a_layout_inside_the_blob(data):
    buf = io.BytesIO()
    torch.save(torch.arange(24 * 64, dtype=torch.bfloat16).reshape(24, 64), buf)
    blob = bytearray(buf.getvalue())
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    length = data.draw(st.integers(len(blob) - 200, len(blob)))
    with tempfile.TemporaryFile() as f:
        f.write(blob)
        f.flush()
        try:
            t, spent = parse_blob(f.fileno(), 0, length, path="x.distcp", key="w")
        except CannotNarrow:
            return
        except CheckpointError as e:
            assert e.key == "w" and e.path == "x.distcp"
            return
    assert spent <= length
    width = itemsize(t.dtype)
    if np.prod(t.shape):  # every element the layout addresses lies inside the blob
        last = t.start + sum((s - 1) * st_ for s, st_ in zip(t.shape, t.stride, strict=True)) * width
        assert last + width <= length


def test_zip64_sizes_are_read_from_the_extra_field(tmp_path):
    """A central directory entry whose sizes and offset are saturated (as in a blob over
    4 GiB) takes them from its zip64 extra field."""
    buf = io.BytesIO()
    t = torch.arange(50, dtype=torch.int64)
    torch.save(t, buf)
    blob = buf.getvalue()
    p = _central(blob, b"/data/0")
    ln, le, lc = struct.unpack("<HHH", blob[p + 28:p + 34])
    usize, local = struct.unpack("<I", blob[p + 24:p + 28])[0], struct.unpack("<I", blob[p + 42:p + 46])[0]
    extra = struct.pack("<HHQQQ", 1, 24, usize, usize, local)
    entry = (blob[p:p + 20] + struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF) + struct.pack("<HHH", ln, len(extra), lc)
             + blob[p + 34:p + 42] + struct.pack("<I", 0xFFFFFFFF) + blob[p + 46:p + 46 + ln] + extra)
    grown = len(entry) - (46 + ln + le + lc)
    fixed = blob[:p] + entry + blob[p + 46 + ln + le + lc:]
    # the directory grew: fix its size in the zip64 and plain end records, and the locator's offset
    z64 = fixed.rfind(b"PK\x06\x06")
    cd_size = struct.unpack("<Q", fixed[z64 + 40:z64 + 48])[0] + grown
    fixed = fixed[:z64 + 40] + struct.pack("<Q", cd_size) + fixed[z64 + 48:]
    loc = fixed.rfind(b"PK\x06\x07")
    fixed = fixed[:loc + 8] + struct.pack("<Q", z64) + fixed[loc + 16:]
    eocd = fixed.rfind(b"PK\x05\x06")
    fixed = fixed[:eocd + 12] + struct.pack("<I", cd_size) + fixed[eocd + 16:]
    assert torch.equal(torch.load(io.BytesIO(fixed), weights_only=True), t)  # torch agrees it is valid
    layout, _ = _parse_file(tmp_path, fixed)
    got = np.frombuffer(fixed[layout.start:layout.start + 400], dtype=np.int64)
    assert layout.shape == (50,) and np.array_equal(got, t.numpy())
    assert zipfile.ZipFile(io.BytesIO(fixed)).testzip() is None


def test_torch_save_layout_facts_the_readme_states(tmp_path):
    """torch.save (this torch) writes stored entries with 64-byte aligned data, sizes only in
    the central directory (data-descriptor flag) and zip64 end records; a one-tensor blob's
    storage starts before byte 1024 and its directory fits in its last 1024 bytes."""
    buf = io.BytesIO()
    torch.save(torch.arange(1000, dtype=torch.float32), buf)
    blob = buf.getvalue()
    z = zipfile.ZipFile(io.BytesIO(blob))
    assert all(i.compress_type == zipfile.ZIP_STORED and i.flag_bits & 0x8 for i in z.infolist())
    assert blob.rfind(b"PK\x06\x06") > 0 and blob.rfind(b"PK\x06\x07") > 0
    layout, spent = _parse_file(tmp_path, blob)
    assert layout.start % 64 == 0 and layout.start < HEAD and spent == HEAD + TAIL
    assert blob.find(b"PK\x01\x02") >= len(blob) - TAIL
