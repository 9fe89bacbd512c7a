"""Block checksums: NativeWriter records an XXH3-64 digest per 4 MiB block of every chunk
(moved from the data file's header into the metadata by commit); reads verify the blocks
they touch and raise ChecksumError naming file, tensor and block; verification can be
turned off; checkpoints without checksums still load; malformed checksum strings are a
MetadataError."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dcp_reader import (
    METADATA_FILE,
    CheckpointMetadata,
    ChecksumError,
    ChunkMeta,
    MetadataError,
    NativeWriter,
    TensorMeta,
    open_checkpoint,
)
from dcp_reader.integrity._checksum import BLOCK_BYTES


def _save(path, t):
    w = NativeWriter(path)
    size = w.write_file("a.safetensors", {"w@0,0": t})
    w.commit(CheckpointMetadata(tensors={"w": TensorMeta("w", tuple(t.shape), "float32", (
        ChunkMeta((0, 0), tuple(t.shape), "a.safetensors", "w@0,0"),))}, values={}, format="native"))
    return size


def _flip(path, offset_from_end):
    with open(path / "a.safetensors", "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


def test_checksums_are_recorded_per_block(tmp_path):
    t = torch.randn(3 * 1024 + 5, 1024)  # 12 MiB + 20 KiB: four blocks, the last short
    _save(tmp_path, t)
    doc = json.loads((tmp_path / METADATA_FILE).read_text())
    text = doc["tensors"]["w"]["chunks"][0]["checksum"]
    head, digests = text.split(":")
    assert head == f"xxh3-64/{BLOCK_BYTES}" and len(digests.split(",")) == 4
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert torch.equal(r.read("w", c, (0, 0), tuple(t.shape)), t)


def test_a_flipped_bit_is_found_only_by_reads_touching_its_block(tmp_path):
    t = torch.randn(3 * 1024 + 5, 1024)
    _save(tmp_path, t)
    _flip(tmp_path, 100)  # in the last block
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert torch.equal(r.read("w", c, (0, 0), (1024, 1024)), t[:1024])  # block 0 only
        with pytest.raises(ChecksumError, match="block 3") as ei:
            r.read("w", c, (3 * 1024, 0), (5, 1024))
        assert ei.value.key == "w" and ei.value.path.endswith("a.safetensors")
        with pytest.raises(ChecksumError):
            r.read("w", c, (0, 0), tuple(t.shape))
        with pytest.raises(ChecksumError):
            r.read_into("w", c, (0, 0), tuple(t.shape), torch.empty(t.shape))
        with pytest.raises(ChecksumError):
            r.read("w", c, (0, 1), (3 * 1024 + 5, 2))  # a strided box touches every block
    with open_checkpoint(tmp_path, verify_checksums=False) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert not torch.equal(r.read("w", c, (0, 0), tuple(t.shape)), t)  # the flip comes through


def test_checkpoints_without_checksums_still_load(tmp_path):
    t = torch.randn(4, 4)
    _save(tmp_path, t)
    doc = json.loads((tmp_path / METADATA_FILE).read_text())
    del doc["tensors"]["w"]["chunks"][0]["checksum"]
    (tmp_path / METADATA_FILE).write_text(json.dumps(doc))
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert c.checksum is None and torch.equal(r.read("w", c, (0, 0), (4, 4)), t)


@pytest.mark.parametrize("bad", ["crc32:1234", "xxh3-64/0:", "xxh3-64/4194304:zz", "xxh3-64/4194304:",
                                 "xxh3-64/4194304:1,2"])
def test_malformed_checksum_is_a_metadata_error(tmp_path, bad):
    t = torch.randn(4, 4)
    _save(tmp_path, t)
    doc = json.loads((tmp_path / METADATA_FILE).read_text())
    doc["tensors"]["w"]["chunks"][0]["checksum"] = bad
    (tmp_path / METADATA_FILE).write_text(json.dumps(doc))
    with open_checkpoint(tmp_path) as r, pytest.raises(MetadataError):
        r.read("w", r.metadata.tensors["w"].chunks[0], (0, 0), (4, 4))
