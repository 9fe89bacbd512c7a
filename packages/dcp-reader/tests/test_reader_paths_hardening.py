"""Only regular files inside the checkpoint directory are opened, and they are checked
before opening: a FIFO (which would hang a read), a directory, a device or a symlink out of
the directory in place of a data, metadata or index file is refused with UnsafePathError,
in every format and in format detection; metadata and index reads are bounded in size."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from dcp_reader import (
    METADATA_FILE,
    CheckpointError,
    NativeWriter,
    UnsafePathError,
    detect_format,
    open_checkpoint,
)
from safetensors.torch import save_file


@pytest.fixture(autouse=True)
def _no_hang():
    """A hang (opening a FIFO blocks until a writer comes) fails the test after 20 s."""
    def boom(*_):
        raise TimeoutError("the reader hung")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _native(path):
    from dcp_reader import CheckpointMetadata, ChunkMeta, TensorMeta

    w = NativeWriter(path)
    w.write_file("a.safetensors", {"w@0": torch.arange(4.0)})
    w.commit(CheckpointMetadata(tensors={"w": TensorMeta("w", (4,), "float32", (
        ChunkMeta((0,), (4,), "a.safetensors", "w@0"),))}, values={}, format="native"))
    return path


def test_fifo_as_first_safetensors_is_refused_in_detection(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    os.mkfifo(tmp_path / "a.safetensors")
    with pytest.raises(UnsafePathError, match="FIFO"):
        open_checkpoint(tmp_path)


def test_symlink_out_as_first_safetensors_is_refused_before_opening(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"\xff" * 64)  # garbage: opening it would give a header error instead
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(outside, ck / "a.safetensors")
    with pytest.raises(UnsafePathError, match="outside"):
        detect_format(ck)


def test_native_metadata_symlinked_outside_is_refused(tmp_path):
    ck = _native(tmp_path / "ck")
    real = tmp_path / "elsewhere.json"
    os.replace(ck / METADATA_FILE, real)
    os.symlink(real, ck / METADATA_FILE)
    with pytest.raises(UnsafePathError, match="outside"):
        open_checkpoint(ck)


def test_metadata_symlinked_to_dev_zero_is_refused(tmp_path):
    ck = _native(tmp_path / "ck")
    os.unlink(ck / METADATA_FILE)
    os.symlink("/dev/zero", ck / METADATA_FILE)
    with pytest.raises(UnsafePathError):
        open_checkpoint(ck)


@pytest.mark.parametrize("name", [METADATA_FILE, "a.safetensors"])
def test_native_fifo_is_refused(tmp_path, name):
    ck = _native(tmp_path / "ck")
    os.unlink(ck / name)
    os.mkfifo(ck / name)
    with pytest.raises(UnsafePathError, match="FIFO"):
        open_checkpoint(ck, format="native")


def test_native_data_file_that_is_a_directory_is_refused(tmp_path):
    ck = _native(tmp_path / "ck")
    os.unlink(ck / "a.safetensors")
    os.mkdir(ck / "a.safetensors")
    with pytest.raises(UnsafePathError, match="directory"):
        open_checkpoint(ck)


def test_torch_dcp_metadata_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / ".metadata")
    with pytest.raises(UnsafePathError, match="FIFO"):
        open_checkpoint(tmp_path)


def test_index_that_is_a_directory_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "model-1.safetensors")
    os.mkdir(tmp_path / "model.safetensors.index.json")
    with pytest.raises(UnsafePathError, match="directory"):
        open_checkpoint(tmp_path)


def test_index_symlinked_outside_is_refused(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"w": torch.ones(2)}, ck / "model-1.safetensors")
    (tmp_path / "index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    os.symlink(tmp_path / "index.json", ck / "model.safetensors.index.json")
    with pytest.raises(UnsafePathError, match="outside"):
        open_checkpoint(ck)


def test_symlink_inside_the_directory_still_reads(tmp_path):
    ck = _native(tmp_path / "ck")
    os.replace(ck / "a.safetensors", ck / "real.safetensors")
    os.symlink("real.safetensors", ck / "a.safetensors")
    with open_checkpoint(ck) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert torch.equal(r.read("w", c, (0,), (4,)), torch.arange(4.0))


def test_metadata_reads_are_bounded(tmp_path):
    from dcp_reader.storage._paths import read_regular

    (tmp_path / "big").write_bytes(b"x" * 1000)
    with pytest.raises(UnsafePathError, match="1000 bytes, more than the 999"):
        read_regular(str(tmp_path), "big", limit=999)
    assert read_regular(str(tmp_path), "big", limit=1000) == b"x" * 1000


def test_every_refusal_is_a_checkpoint_error(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError):
        open_checkpoint(tmp_path, format="hf")
