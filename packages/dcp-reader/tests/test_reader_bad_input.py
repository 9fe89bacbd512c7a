"""Every kind of bad input raises its typed error naming the file and the key: missing or
incomplete metadata, invalid JSON, unknown schema version, missing files and keys,
truncated files and headers that point past the end, unknown dtypes, chunks that overlap
or leave gaps, file names escaping the directory (.., absolute, symlink out), and pickles
that would run code (nothing runs)."""

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
    CoverageError,
    MetadataError,
    MissingFileError,
    MissingKeyError,
    MissingMetadataError,
    NativeWriter,
    TruncatedFileError,
    UnknownDtypeError,
    UnsafePathError,
    UnsafePickleError,
    open_checkpoint,
)
from safetensors.torch import save_file


def _native(path, tensors=None, *, files=None):
    """A native checkpoint with hand-written metadata (bypassing the writer's checks)."""
    tensors = tensors or {"w": {"shape": [4, 2], "dtype": "float32", "chunks": [
        {"offsets": [0, 0], "sizes": [2, 2], "file": "a.safetensors", "key": "w@0,0"},
        {"offsets": [2, 0], "sizes": [2, 2], "file": "b.safetensors", "key": "w@2,0"}]}}
    w = NativeWriter(path)
    for f, d in (files or {"a.safetensors": {"w@0,0": torch.ones(2, 2)},
                           "b.safetensors": {"w@2,0": torch.zeros(2, 2)}}).items():
        w.write_file(f, d)
    doc = {"schema_version": 1, "format": "native", "tensors": tensors, "values": {}}
    (path / METADATA_FILE).write_text(json.dumps(doc))
    return path


def _read_all(r):
    for n, t in r.metadata.tensors.items():
        for c in t.chunks:
            r.read(n, c, c.offsets, c.sizes)


def test_all_errors_are_checkpoint_errors_with_path_and_key():
    for cls in (MissingMetadataError, MetadataError, MissingFileError, MissingKeyError, TruncatedFileError,
                UnknownDtypeError, CoverageError, UnsafePathError, UnsafePickleError):
        e = cls("x", path="/p", key="k")
        assert isinstance(e, CheckpointError) and e.path == "/p" and e.key == "k"


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(MissingMetadataError, match="no checkpoint found"):
        open_checkpoint(tmp_path)
    with pytest.raises(MissingMetadataError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_torch_dcp_without_metadata_is_incomplete(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(MissingMetadataError, match="incomplete torch.distributed.checkpoint"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("text, words", [("{oops", "invalid JSON"),
                                         ('{"schema_version": 2, "format": "native"}', "unknown schema_version 2")])
def test_bad_native_metadata(tmp_path, text, words):
    (tmp_path / METADATA_FILE).write_text(text)
    with pytest.raises(MetadataError, match=words) as ei:
        open_checkpoint(tmp_path)
    assert ei.value.path == str(tmp_path / METADATA_FILE)


def test_missing_files_are_all_listed(tmp_path):
    _native(tmp_path)
    os.unlink(tmp_path / "a.safetensors")
    os.unlink(tmp_path / "b.safetensors")
    with pytest.raises(MissingFileError, match="a.safetensors; b.safetensors") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "w" and ei.value.offenders == ("a.safetensors", "b.safetensors")


def test_missing_key_in_a_data_file(tmp_path):
    _native(tmp_path, files={"a.safetensors": {"w@0,0": torch.ones(2, 2)},
                             "b.safetensors": {"other": torch.zeros(2, 2)}})
    with open_checkpoint(tmp_path) as r, pytest.raises(MissingKeyError, match="'w@2,0'") as ei:
        _read_all(r)
    assert ei.value.key == "w@2,0" and ei.value.path.endswith("b.safetensors")
    with open_checkpoint(tmp_path) as r, pytest.raises(MissingKeyError, match="no tensor 'nope'"):
        r.read("nope", r.metadata.tensors["w"].chunks[0], (0, 0), (1, 1))


def test_metadata_and_file_disagree_on_dtype(tmp_path):
    _native(tmp_path, files={"a.safetensors": {"w@0,0": torch.ones(2, 2)},
                             "b.safetensors": {"w@2,0": torch.zeros(2, 2, dtype=torch.float16)}})
    with open_checkpoint(tmp_path) as r, pytest.raises(MetadataError, match="F16.*float32") as ei:
        _read_all(r)
    assert ei.value.key == "w@2,0"


def test_truncated_data_file(tmp_path):
    _native(tmp_path)
    p = tmp_path / "b.safetensors"
    p.write_bytes(p.read_bytes()[:-5])
    with open_checkpoint(tmp_path) as r, pytest.raises(TruncatedFileError, match="'w@2,0' ends at byte") as ei:
        _read_all(r)
    assert ei.value.key == "w@2,0" and ei.value.path.endswith("b.safetensors")


def test_header_length_past_eof_and_tiny_file(tmp_path):
    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    p = tmp_path / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    with pytest.raises(TruncatedFileError, match="header length 1000000000 runs past"):
        open_checkpoint(tmp_path)
    p.write_bytes(b"abc")
    with pytest.raises(TruncatedFileError, match="too short"):
        open_checkpoint(tmp_path)


def _rewrite_header(path, fn):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    fn(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data[8 + n:])


def test_header_offsets_past_eof(tmp_path):
    save_file({"a": torch.ones(3), "b": torch.ones(2)}, str(tmp_path / "model.safetensors"))

    def lie(h):
        for k in ("a", "b"):
            s, e = h[k]["data_offsets"]
            h[k]["data_offsets"] = [s + 4096, e + 4096]
    _rewrite_header(tmp_path / "model.safetensors", lie)
    with pytest.raises(TruncatedFileError, match="places data past the end") as ei:
        open_checkpoint(tmp_path)
    assert set(ei.value.offenders) == {"a", "b"} and "model.safetensors" in str(ei.value)


def test_unknown_dtype_in_a_header(tmp_path):
    save_file({"a": torch.ones(4, dtype=torch.uint8), "b": torch.ones(4, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))

    def unknown(h):
        h["a"]["dtype"] = "F4"
        h["b"]["dtype"] = "Q9"
    _rewrite_header(tmp_path / "model.safetensors", unknown)
    with pytest.raises(UnknownDtypeError, match="'a' has dtype 'F4'.*'b' has dtype 'Q9'") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "a" and ei.value.path.endswith("model.safetensors")


def test_gap_and_overlap_in_native_metadata(tmp_path):
    _native(tmp_path, {"w": {"shape": [5, 2], "dtype": "float32", "chunks": [
        {"offsets": [0, 0], "sizes": [2, 2], "file": "a.safetensors", "key": "w@0,0"},
        {"offsets": [2, 0], "sizes": [2, 2], "file": "b.safetensors", "key": "w@2,0"}]},
        "v": {"shape": [3, 2], "dtype": "float32", "chunks": [
            {"offsets": [0, 0], "sizes": [2, 2], "file": "a.safetensors", "key": "w@0,0"},
            {"offsets": [1, 0], "sizes": [2, 2], "file": "b.safetensors", "key": "w@2,0"}]}})
    with pytest.raises(CoverageError, match="cover 8 of 10.*overlap") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.offenders == ("w", "v") and ei.value.path.endswith(METADATA_FILE)


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_file_names_escaping_the_directory(tmp_path, bad):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _native(ckpt, {"w": {"shape": [2], "dtype": "float32", "chunks": [
        {"offsets": [0], "sizes": [2], "file": bad, "key": "w@0"}]}}, files={})
    with pytest.raises(UnsafePathError, match="escape the checkpoint directory") as ei:
        open_checkpoint(ckpt)
    assert ei.value.key == "w" and ei.value.offenders == (bad,)


def test_symlink_out_is_refused_and_symlink_inside_is_fine(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _native(ckpt)
    outside = tmp_path / "secret.safetensors"
    os.replace(ckpt / "b.safetensors", outside)
    os.symlink(outside, ckpt / "b.safetensors")
    with pytest.raises(UnsafePathError, match="outside the checkpoint") as ei:
        open_checkpoint(ckpt)
    assert ei.value.key == "w"
    os.unlink(ckpt / "b.safetensors")
    os.replace(outside, ckpt / "real-b.safetensors")
    os.symlink("real-b.safetensors", ckpt / "b.safetensors")
    with open_checkpoint(ckpt) as r:
        _read_all(r)


def test_hf_index_problems(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(MissingKeyError, match="'b'") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "b" and ei.value.path.endswith("s1.safetensors")
    idx.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "c": "s2.safetensors"}}))
    with pytest.raises(MissingFileError, match="s2.safetensors") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.key == "c"
    idx.write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(UnsafePathError):
        open_checkpoint(tmp_path)
    idx.write_text("{")
    with pytest.raises(MetadataError, match="invalid JSON"):
        open_checkpoint(tmp_path)


# -- torch.distributed.checkpoint's pickled .metadata -------------------------------------------

def _torch_dcp(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "n": 5}, checkpoint_id=str(path), no_dist=True)
    return path


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path):
    _torch_dcp(tmp_path)
    marker = str(tmp_path / "pwned")
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafePickleError, match=r"posix\.mkdir|os\.mkdir") as ei:
        open_checkpoint(tmp_path)
    assert not os.path.exists(marker)
    assert ei.value.path.endswith(".metadata")


def test_code_hidden_inside_real_metadata_is_refused(tmp_path):
    _torch_dcp(tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own, trusted, file
    marker = str(tmp_path / "pwned")
    md.planner_data = {"w": _RunsCode(marker)}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafePickleError):
        open_checkpoint(tmp_path)
    assert not os.path.exists(marker)


def test_torch_dcp_relative_path_escaping(tmp_path):
    _torch_dcp(tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafePathError, match="escape"):
        open_checkpoint(tmp_path)


def test_torch_dcp_truncated_distcp(tmp_path):
    _torch_dcp(tmp_path)
    p = tmp_path / "__0_0.distcp"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(TruncatedFileError, match="truncated") as ei:  # found at open, before any read
        open_checkpoint(tmp_path)
    assert "w" in ei.value.offenders and "__0_0.distcp" in str(ei.value)


def test_torch_dcp_garbage_metadata(tmp_path):
    _torch_dcp(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(MetadataError, match="cannot read the pickled metadata"):
        open_checkpoint(tmp_path)


def test_overlapping_header_entries(tmp_path):
    save_file({"a": torch.ones(3), "b": torch.ones(2)}, str(tmp_path / "model.safetensors"))

    def overlap(h):  # inside the file, so the size check alone would pass
        h["b"]["data_offsets"] = [0, 8]
    _rewrite_header(tmp_path / "model.safetensors", overlap)
    with pytest.raises(MetadataError, match="overlap") as ei:
        open_checkpoint(tmp_path)
    assert ei.value.path.endswith("model.safetensors") and ei.value.key in ("a", "b")


def test_bad_arguments_are_value_errors(tmp_path):
    _native(tmp_path)
    with pytest.raises(ValueError, match="format must be one of"):
        open_checkpoint(tmp_path, format="zip")
    with pytest.raises(ValueError, match="max_open_files"):
        open_checkpoint(tmp_path, max_open_files=0)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        with pytest.raises(ValueError, match="framework"):
            r.read("w", c, (0, 0), (1, 1), framework="jax")
        with pytest.raises(ValueError, match="2 dims"):
            r.read("w", c, (0,), (1,))
