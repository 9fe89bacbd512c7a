"""Block checksums verified as the blocks are read (``read_verified``): pieces hashed on the
reader's HashWorker thread while the next block is read, or inline. A corrupt block in the
middle, at the end, in a short last block, through narrowed and strided reads, into numpy
and torch destinations, is a ChecksumError naming file, tensor, key and block, raised before
the read returns; each block is hashed once per reader; the worker thread starts only for
multi-block reads and is joined by close() (or when a reader is dropped without close);
a failed read leaves no job running. Property-based: a read fails exactly when the block
span it touches holds a corrupted byte (small blocks and pieces so many cases run fast)."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch
import xxhash
from dcp_reader import (
    CheckpointMetadata,
    ChecksumError,
    ChunkMeta,
    NativeWriter,
    TensorMeta,
    open_checkpoint,
)
from dcp_reader.integrity import _checksum
from dcp_reader.integrity._checksum import BLOCK_BYTES, PIECE_BYTES, block_digests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROW = 1024  # float32 columns: 4 KiB per row, 1024 rows per 4 MiB block


def _save(path, t, *, block=None):
    """One float32 tensor in a.safetensors; ``block``: record digests of that block size."""
    w = NativeWriter(path)
    w.write_file("a.safetensors", {"w@0,0": t})
    checksum = None if block is None else block_digests(t.contiguous().view(torch.uint8).numpy(), block)
    w.commit(CheckpointMetadata(tensors={"w": TensorMeta("w", tuple(t.shape), "float32", (
        ChunkMeta((0, 0), tuple(t.shape), "a.safetensors", "w@0,0", checksum=checksum),))},
        values={}, format="native"))


def _corrupt(path, byte):
    """Flip a bit of data byte ``byte`` of the one tensor."""
    with open(path / "a.safetensors", "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + byte)
        b = f.read(1)
        f.seek(8 + n + byte)
        f.write(bytes([b[0] ^ 0x04]))


def _hash_threads():
    return [t for t in threading.enumerate() if t.name == "dcp-reader-hash"]


@pytest.fixture
def four_blocks(tmp_path):
    t = torch.randn(3 * ROW + 7, ROW)  # 12 MiB + 28 KiB: blocks 0-2 whole, block 3 short
    _save(tmp_path, t)
    return tmp_path, t


@pytest.mark.parametrize("block", [1, 3])  # a middle block, the short last block
@pytest.mark.parametrize("how", ["read_into torch", "read_into numpy", "read torch", "read numpy"])
def test_a_corrupt_block_is_named_before_the_read_returns(four_blocks, block, how):
    path, t = four_blocks
    _corrupt(path, block * BLOCK_BYTES + 4 * ROW * (7 if block == 3 else 500) - 3)
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        with pytest.raises(ChecksumError, match=f"block {block} ") as ei:
            if how == "read_into torch":
                r.read_into("w", c, (0, 0), tuple(t.shape), torch.empty(t.shape))
            elif how == "read_into numpy":
                r.read_into("w", c, (0, 0), tuple(t.shape), np.empty(tuple(t.shape), np.float32))
            else:
                r.read("w", c, (0, 0), tuple(t.shape), framework=how.split()[1])
        e = ei.value
        assert e.key == "w" and e.path.endswith("a.safetensors") and "'w@0,0'" in str(e)
        assert block not in r._sums[("a.safetensors", "w@0,0")].verified
        # the blocks before it are good and were recorded as such
        assert set(range(block)) <= r._sums[("a.safetensors", "w@0,0")].verified


def test_the_last_byte_of_a_short_last_block(four_blocks):
    path, t = four_blocks
    _corrupt(path, t.numel() * 4 - 1)
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert torch.equal(r.read("w", c, (0, 0), (3 * ROW, ROW)), t[:3 * ROW])  # blocks 0-2 only
        with pytest.raises(ChecksumError, match="block 3 .bytes .12582912, 12611584."):
            r.read("w", c, (3 * ROW + 6, 0), (1, ROW))


def test_narrowed_reads_verify_only_the_blocks_they_touch(four_blocks):
    path, t = four_blocks
    _corrupt(path, 2 * BLOCK_BYTES + 5)  # block 2
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        sums = lambda: r._sums[("a.safetensors", "w@0,0")].verified  # noqa: E731
        out = torch.empty(ROW, ROW)
        r.read_into("w", c, (ROW, 0), (ROW, ROW), out)  # exactly block 1: straight into out
        assert torch.equal(out, t[ROW:2 * ROW]) and sums() == {1}
        part = np.empty((10, ROW), np.float32)
        r.read_into("w", c, (5, 0), (10, ROW), part)  # inside block 0: read + copy
        assert np.array_equal(part, t[5:15].numpy()) and sums() == {0, 1}
        assert torch.equal(r.read("w", c, (3 * ROW, 3), (7, 5)), t[3 * ROW:, 3:8]) and sums() == {0, 1, 3}
        with pytest.raises(ChecksumError, match="block 2 "):
            r.read("w", c, (0, 0), (3 * ROW + 7, 2))  # a strided box touches every block


def test_each_block_is_hashed_once_per_reader(four_blocks, monkeypatch):
    path, t = four_blocks
    calls = []

    def counting(real):
        def f(*a):
            calls.append(1)
            return real(*a)
        return f

    monkeypatch.setattr(xxhash, "xxh3_64", counting(xxhash.xxh3_64))  # blocks hashed while read
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", counting(xxhash.xxh3_64_intdigest))  # on the worker
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        out = torch.empty(t.shape)
        r.read_into("w", c, (0, 0), tuple(t.shape), out)
        assert torch.equal(out, t) and len(calls) == 4
        r.read_into("w", c, (0, 0), tuple(t.shape), out)
        r.read("w", c, (ROW, 1), (ROW, 3))
        assert len(calls) == 4
    with open_checkpoint(path) as r:  # a new reader verifies again
        r.read("w", r.metadata.tensors["w"].chunks[0], (0, 0), (1, 1))
        assert len(calls) == 5


def test_the_hash_thread_starts_for_multi_piece_reads_and_stops_with_the_reader(four_blocks, tmp_path_factory):
    path, t = four_blocks
    small = tmp_path_factory.mktemp("small")
    _save(small, torch.randn(PIECE_BYTES // (4 * ROW), ROW))  # one piece, one block
    assert not _hash_threads()
    with open_checkpoint(small) as r:
        r.read("w", r.metadata.tensors["w"].chunks[0], (0, 0), (PIECE_BYTES // (4 * ROW), ROW))
        assert not _hash_threads()  # hashed inline
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        r.read("w", c, (0, 0), (1, 1))  # one 4 MiB block: the last of its read, hashed here
        assert not _hash_threads()
        r.read("w", c, (0, 0), tuple(t.shape))  # blocks 1-2 can be hashed while 2-3 are read
        assert len(_hash_threads()) == 1
    assert not _hash_threads()  # close() joined it
    r = open_checkpoint(path)
    r.read("w", r.metadata.tensors["w"].chunks[0], (0, 0), tuple(t.shape))
    thread = _hash_threads()[0]
    del r
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()  # a reader dropped without close() stops it too


def test_a_file_truncated_mid_read_leaves_no_job_running(four_blocks):
    from dcp_reader import TruncatedFileError

    path, t = four_blocks
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        r.read("w", c, (1024, 0), (1, 1))  # open the file (block 1 verified)
        jobs = []
        submit = r._hasher.submit
        r._hasher.submit = lambda *a: jobs.append(submit(*a)) or jobs[-1]
        os.truncate(path / "a.safetensors", os.path.getsize(path / "a.safetensors") - BLOCK_BYTES - 100)
        with pytest.raises(TruncatedFileError):
            r.read_into("w", c, (0, 0), tuple(t.shape), torch.empty(t.shape))
        # block 0 was handed on; the file ended inside block 1 (verified already, read again)
        assert len(jobs) == 1 and all(j._done.is_set() for j in jobs)
    assert not _hash_threads()


def test_a_failing_job_is_raised_by_finish_and_the_thread_survives():
    from dcp_reader.integrity._hash_worker import HashWorker

    w = HashWorker()
    with pytest.raises(ZeroDivisionError):
        w.finish([w.submit(lambda: 1 / 0), w.submit(lambda: 2)])
    assert w.finish([w.submit(lambda x: x + 1, 1)]) == [2]  # the thread survived the failing job
    assert len(_hash_threads()) == 1
    w.close()
    w.close()
    assert not _hash_threads()


def test_finish_runs_jobs_the_thread_has_not_started():
    from dcp_reader.integrity._hash_worker import HashWorker

    w = HashWorker()
    gate = threading.Event()
    ran = []
    blocker = w.submit(gate.wait)  # holds the thread
    jobs = [w.submit(lambda i=i: ran.append((i, threading.current_thread().name)) or i) for i in range(3)]
    threading.Timer(0.2, gate.set).start()
    assert w.finish(jobs) == [0, 1, 2]
    assert [who for _, who in ran] == [threading.current_thread().name] * 3  # run here, not waited for
    assert w.finish([blocker]) == [True]
    w.close()


BLOCK = 4096  # small blocks and pieces: the pipeline runs over many blocks in a few KiB


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), data=st.data())
def test_a_read_fails_exactly_when_it_touches_the_corrupt_block(tmp_path_factory, monkeypatch, rows, cols, data):
    monkeypatch.setattr(_checksum, "PIECE_BYTES", 1024)
    path = tmp_path_factory.mktemp("pipe")
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    _save(path, t, block=BLOCK)
    bad = data.draw(st.integers(0, rows * cols * 4 - 1), label="corrupt byte")
    _corrupt(path, bad)
    r0 = data.draw(st.integers(0, rows - 1), label="row")
    nr = data.draw(st.integers(1, rows - r0), label="rows")
    c0 = data.draw(st.integers(0, cols - 1), label="col")
    nc = data.draw(st.integers(1, cols - c0), label="cols")
    into = data.draw(st.sampled_from(["torch", "numpy", "read"]), label="how")
    lo = (r0 * cols + c0) * 4
    hi = ((r0 + nr - 1) * cols + c0 + nc) * 4
    touched = lo // BLOCK <= bad // BLOCK <= (hi - 1) // BLOCK
    with open_checkpoint(path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        try:
            if into == "read":
                got = r.read("w", c, (r0, c0), (nr, nc))
            else:
                got = torch.empty(nr, nc) if into == "torch" else np.empty((nr, nc), np.float32)
                r.read_into("w", c, (r0, c0), (nr, nc), got)
        except ChecksumError as e:
            assert touched, f"byte {bad} outside the read [{lo}, {hi}) raised {e}"
            assert f"block {bad // BLOCK} " in str(e)
        else:
            assert not touched, f"byte {bad} in the read [{lo}, {hi}) went unnoticed"
            assert np.array_equal(np.asarray(got), t[r0:r0 + nr, c0:c0 + nc].numpy())
