"""Bad hyper-parallel checkpoints: pickles naming anything outside the allow-list (nothing
runs), corrupt or unknown metadata, missing or unsafe data files, keys the data file lacks,
shapes and dtypes disagreeing with the safetensors header, unknown dtype strings, gaps,
truncated value files. Every error is typed and names the file and the key."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from dcp_reader import (
    CoverageError,
    MetadataError,
    MissingFileError,
    MissingKeyError,
    MissingMetadataError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsafePathError,
    UnsafePickleError,
    detect_format,
    open_checkpoint,
)
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import hyper_writer as hw  # noqa: E402

W = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def _write(path: Path) -> None:
    hw.write_checkpoint(path, {0: {"w": [((0, 0), W[:2].clone()), ((2, 0), W[2:3].clone())], "step": 3},
                               1: {"w": [((3, 0), W[3:].clone())]}}, {"w": (6, 4)})


def _edit(path: Path, fn) -> None:
    """Load the metadata with the writer's classes, change it with ``fn``, write it back."""
    with hw.seed_modules(), open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    fn(md)
    hw.dump_metadata(md, str(path / ".metadata"))


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_raises_and_runs_nothing(tmp_path):
    _write(tmp_path)
    marker = tmp_path / "ran"
    _edit(tmp_path, lambda md: setattr(md, "planner_data", {"w": _Evil(str(marker))}))
    with pytest.raises(UnsafePickleError) as e:
        open_checkpoint(tmp_path)
    assert e.value.key == "posix.system" and e.value.path.endswith(".metadata")
    assert "nothing was executed" in str(e.value) and not marker.exists()


@pytest.mark.parametrize("ref", [b"hyper_parallel.core.distributed_checkpoint.planner\nLoadPlan",
                                 b"torch.distributed.checkpoint.metadata\nMetadata",
                                 b"builtins\neval"])
def test_names_outside_the_allow_list_are_refused(tmp_path, ref):
    _write(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"c" + ref + b"\n)R.")
    with pytest.raises(UnsafePickleError, match="not a hyper-parallel checkpoint metadata class") as e:
        open_checkpoint(tmp_path, format="hyper-parallel")
    assert e.value.key == ref.decode().replace("\n", ".")


def test_corrupt_or_foreign_metadata(tmp_path):
    _write(tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    (tmp_path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(MetadataError, match="cannot read the pickled metadata"):
        open_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    assert detect_format(tmp_path) == "hyper-parallel"  # its data files say so
    with pytest.raises(MetadataError, match="not a hyper-parallel Metadata"):
        open_checkpoint(tmp_path)


def test_unknown_version(tmp_path):
    _write(tmp_path)
    _edit(tmp_path, lambda md: setattr(md, "version", "2.0"))
    with pytest.raises(MetadataError, match="'2.0'") as e:
        open_checkpoint(tmp_path)
    assert e.value.key == "version"


@pytest.mark.parametrize("dtype", ["Float4", "torch.float8_e8m0fnu", "unknown"])
def test_unknown_dtype_strings(tmp_path, dtype):
    _write(tmp_path)

    def change(md):
        old = md.state_dict_metadata["w"]
        md.state_dict_metadata["w"] = hw.TensorStorageMetadata(hw.TensorProperties(dtype), old.size, old.chunks)
    _edit(tmp_path, change)
    with pytest.raises(UnknownDtypeError, match=dtype) as e:
        open_checkpoint(tmp_path)
    assert e.value.key == "w" and e.value.path.endswith(".metadata")


def test_chunk_without_storage_entry(tmp_path):
    _write(tmp_path)
    _edit(tmp_path, lambda md: md.storage_data.pop(hw.MetadataIndex("w", (2, 0))))
    with pytest.raises(MetadataError, match=r"no storage_data entry for 'w' at offsets \(2, 0\)") as e:
        open_checkpoint(tmp_path)
    assert e.value.key == "w"


def test_gap_in_a_global_checkpoint(tmp_path):
    _write(tmp_path)
    _edit(tmp_path, lambda md: md.state_dict_metadata["w"].chunks.pop())
    with pytest.raises(CoverageError, match="gaps") as e:
        open_checkpoint(tmp_path)
    assert e.value.key == "w"


def test_missing_data_file(tmp_path):
    _write(tmp_path)
    os.remove(tmp_path / "_rank1_.safetensors")
    with pytest.raises(MissingFileError, match="_rank1_.safetensors") as e:
        open_checkpoint(tmp_path)
    assert e.value.offenders == ("_rank1_.safetensors",)


def test_unsafe_relative_path(tmp_path):
    _write(tmp_path)
    _edit(tmp_path, lambda md: setattr(md.storage_data[hw.MetadataIndex("w", (3, 0))], "relative_path",
                                       "../outside.safetensors"))
    with pytest.raises(UnsafePathError, match="outside.safetensors"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("bad,error,match", [
    ({}, MissingKeyError, "key 'w' is not in this safetensors file"),
    ({"w": torch.zeros(4, 3)}, MetadataError, r"F32 \[4, 3\] in the file but the metadata says float32 \[3, 4\]"),
    ({"w": torch.zeros(3, 4, dtype=torch.float16)}, MetadataError, r"F16 \[3, 4\] in the file"),
])
def test_data_file_disagrees_with_metadata(tmp_path, bad, error, match):
    _write(tmp_path)
    save_file({"other": torch.zeros(1), **bad}, str(tmp_path / "_rank1_.safetensors"))
    with open_checkpoint(tmp_path) as r:
        chunk = r.metadata.tensors["w"].chunks[2]
        with pytest.raises(error, match=match) as e:
            r.read("w", chunk, chunk.offsets, chunk.sizes)
    assert e.value.key == "w" and e.value.path.endswith("_rank1_.safetensors")


def test_truncated_value_file(tmp_path):
    _write(tmp_path)
    os.truncate(tmp_path / "_rank0_.bytes", 3)
    with open_checkpoint(tmp_path, allow_pickle=True) as r, pytest.raises(TruncatedFileError) as e:
        r.read_value("step")
    assert e.value.key == "step" and e.value.path.endswith("_rank0_.bytes")


def test_data_files_without_metadata_are_an_incomplete_save(tmp_path):
    _write(tmp_path)
    os.remove(tmp_path / ".metadata")
    with pytest.raises(MissingMetadataError, match="incomplete save") as e:
        detect_format(tmp_path)
    assert e.value.key == ".metadata" and "_rank0_.safetensors" in str(e.value)


def test_rank_argument_is_checked(tmp_path):
    hw.write_checkpoint(tmp_path, {0: {"w": [((0, 0), W.clone())]}}, {"w": (6, 4)}, per_rank=True)
    with pytest.raises(ValueError, match="rank must be an int"):
        open_checkpoint(tmp_path, rank=-1)
