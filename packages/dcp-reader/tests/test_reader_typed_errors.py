"""Every way a corrupt checkpoint can fail is a CheckpointError, never a bare Python error:
deeply nested JSON (RecursionError), JSON integers beyond Python's 4300-digit limit
(ValueError), non-UTF-8 text, a torch DCP value blob where a tensor is expected
(AttributeError), and torch DCP byte ranges past the end of their file or overlapping,
which are found when the checkpoint is opened, before any read."""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_reader import (
    METADATA_FILE,
    CheckpointError,
    MetadataError,
    NativeWriter,
    TruncatedFileError,
    open_checkpoint,
)
from safetensors.torch import save_file


def _native_doc(path, **extra_values):
    w = NativeWriter(path)
    w.write_file("a.safetensors", {"w@0": torch.arange(4.0)})
    doc = {"schema_version": 1, "format": "native", "tensors": {"w": {"shape": [4], "dtype": "float32",
           "chunks": [{"offsets": [0], "sizes": [4], "file": "a.safetensors", "key": "w@0"}]}},
           "values": {}}
    return doc


def _typed(path, **kw):
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(path, **kw)
    return ei.value


def test_deeply_nested_json_metadata(tmp_path):
    doc = _native_doc(tmp_path)
    text = json.dumps(doc)[:-1] + ',"deep":' + "[" * 100_000 + "]" * 100_000 + "}"
    (tmp_path / METADATA_FILE).write_text(text)
    assert "nested too deeply" in str(_typed(tmp_path))


def test_deeply_nested_value_in_metadata(tmp_path):
    doc = _native_doc(tmp_path)
    (tmp_path / METADATA_FILE).write_text(json.dumps(doc)[:-2] + '"v":{"value":' + "[" * 5000 + "]" * 5000 + "}}}")
    _typed(tmp_path)


def test_huge_json_integer_in_metadata(tmp_path):
    doc = _native_doc(tmp_path)
    text = json.dumps(doc).replace('"shape": [4]', '"shape": [' + "9" * 5000 + "]")
    (tmp_path / METADATA_FILE).write_text(text)
    assert isinstance(_typed(tmp_path), MetadataError)


def test_non_utf8_metadata(tmp_path):
    _native_doc(tmp_path)
    (tmp_path / METADATA_FILE).write_bytes(b'{"schema_version": 1, "x": "\xff\xfe"}')
    _typed(tmp_path)


def test_deeply_nested_safetensors_header(tmp_path):
    doc = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(doc)) + doc)
    _typed(tmp_path)


def test_sharding_info_that_is_not_text(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"), metadata={"DCP_SHARDING_INFO": "1" * 5000})
    _typed(tmp_path, format="torch-dcp-hf")


def _dcp(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7, "x": torch.ones(3)}, checkpoint_id=str(path))


def _rewrite(path, fn):
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own checkpoint: trusted
    fn(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _info(md, fqn):
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def test_torch_dcp_value_blob_where_a_tensor_is_expected(tmp_path):
    _dcp(tmp_path)

    def swap(md):
        w, step = _info(md, "w"), _info(md, "step")
        w.relative_path, w.offset, w.length = step.relative_path, step.offset, step.length
        step.offset, step.length = 0, 0  # keeps the two ranges from overlapping
    _rewrite(tmp_path, swap)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        with pytest.raises(MetadataError, match="not a tensor"):
            r.read("w", c, (0, 0), (2, 3))


def test_torch_dcp_range_past_the_end_is_found_at_open(tmp_path):
    _dcp(tmp_path)

    def far(md):
        _info(md, "x").offset = 10**12
    _rewrite(tmp_path, far)
    with pytest.raises(TruncatedFileError, match="past the end") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "x"


def test_torch_dcp_overlapping_ranges_are_found_at_open(tmp_path):
    _dcp(tmp_path)

    def overlap(md):
        w, x = _info(md, "w"), _info(md, "x")
        x.relative_path, x.offset = w.relative_path, w.offset + 1
        x.length = min(x.length, os.path.getsize(tmp_path / w.relative_path) - x.offset)
    _rewrite(tmp_path, overlap)
    with pytest.raises(MetadataError, match="overlap"):
        open_checkpoint(tmp_path)


def test_torch_dcp_garbage_storage_structure(tmp_path):
    _dcp(tmp_path)

    def garbage(md):
        md.storage_data = {"not an index": 5}
    _rewrite(tmp_path, garbage)
    _typed(tmp_path)


def test_torch_dcp_corrupt_value_blob_is_typed(tmp_path):
    _dcp(tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        info = _info(pickle.load(f), "step")
    with open(tmp_path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * info.length)
    with open_checkpoint(tmp_path) as r, pytest.raises(CheckpointError):
        r.read_value("step")


def test_value_key_of_the_wrong_type_is_a_metadata_error(tmp_path):
    # found by the fuzzer: a list as a pickled value's key raised TypeError (unhashable)
    doc = _native_doc(tmp_path)
    doc["values"] = {"obj": {"file": "values.pkl", "key": ["x"]}}
    (tmp_path / "values.pkl").write_bytes(pickle.dumps({"obj": 1}))
    (tmp_path / METADATA_FILE).write_text(json.dumps(doc))
    assert isinstance(_typed(tmp_path, allow_pickle=True), MetadataError)
