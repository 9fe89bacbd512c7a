"""A rank with nothing to broadcast reads on torch's intra-op threads, each with its own
sibling reader: the split of reads (hypothesis), values after a one-process load on 1-4
threads (native with checksums, HF), a corrupt block raising, and no reader or file left
open."""

from __future__ import annotations

import os

import dcp_load
import pytest
import torch
from dcp_load import LoadError
from dcp_load.plan._plan import ReadItem
from dcp_load.run._execute import MAX_READ_THREADS, split_reads
from dcp_reader import CheckpointReader
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file


def _item(i: int, nbytes: int) -> ReadItem:
    return ReadItem(f"t{i}", 0, (0,), (nbytes,), nbytes, (0,), None, "uint8")


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 20), max_size=40), parts=st.integers(1, 6))
def test_split_reads_deals_every_read_once_in_order_and_balanced(sizes, parts):
    reads = [_item(i, n) for i, n in enumerate(sizes)]
    out = split_reads(reads, parts)
    assert len(out) == parts
    assert sorted(r.name for part in out for r in part) == sorted(r.name for r in reads)
    for part in out:  # each part keeps the plan's order
        assert [int(r.name[1:]) for r in part] == sorted(int(r.name[1:]) for r in part)
    loads = [sum(r.nbytes for r in part) for part in out]
    # largest first to the lightest part: no part exceeds the mean by more than one read
    assert max(loads) <= sum(sizes) / parts + max(sizes, default=0)


def _state(n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"layers.{i}.w": torch.randn(64 + 8 * i, 48, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(n)}


def _poisoned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, float("nan")) for k, v in state.items()}


class _Spy:
    """Counts the sibling readers made and closed."""

    def __init__(self, monkeypatch):
        self.made: list[CheckpointReader] = []
        original = CheckpointReader.sibling

        def sibling(reader):
            sib = original(reader)
            self.made.append(sib)
            return sib

        monkeypatch.setattr(CheckpointReader, "sibling", sibling)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 3, MAX_READ_THREADS + 2])
def test_one_process_load_reads_on_torch_threads(tmp_path, monkeypatch, threads, n_threads):
    state = _state()
    dcp_load.save(state, checkpoint_id=str(tmp_path))  # native, with block checksums
    threads(n_threads)
    spy = _Spy(monkeypatch)
    fds = _open_fds()
    out = _poisoned(state)
    report = dcp_load.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert len(spy.made) == min(n_threads, MAX_READ_THREADS) - 1
    assert report.bytes_read == report.bytes_needed == sum(v.numel() * v.element_size() for v in state.values())
    assert report.pieces_read == len(state)
    assert _open_fds() == fds  # every sibling closed its files


def test_hf_files_on_two_threads_equal_the_saved_tensors(tmp_path, monkeypatch, threads):
    state = _state(9)
    names = sorted(state)
    save_file({k: state[k] for k in names[:5]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[5:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    threads(2)
    spy = _Spy(monkeypatch)
    out = _poisoned(state)
    dcp_load.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert len(spy.made) == 1
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_a_corrupt_block_on_two_threads_raises_and_closes_the_sibling(tmp_path, monkeypatch, threads):
    state = _state()
    dcp_load.save(state, checkpoint_id=str(tmp_path))
    (data,) = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    path = tmp_path / data
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last block of the last tensor in the file
    path.write_bytes(bytes(raw))
    threads(2)
    spy = _Spy(monkeypatch)
    fds = _open_fds()
    with pytest.raises(LoadError, match="checksum|ChecksumError"):
        dcp_load.load(_poisoned(state), checkpoint_id=str(tmp_path), no_dist=True)
    assert len(spy.made) == 1
    assert _open_fds() == fds


def test_a_load_gives_memory_back_at_most_once_per_interval(tmp_path, monkeypatch):
    """The reading threads' free arena memory goes back to the system (glibc
    ``malloc_trim(0)``) at the end of a load, at most once per ``TRIM_EVERY_S`` while the
    anonymous memory grows less than ``TRIM_GROWTH_BYTES``."""
    import sys

    import dcp_load.run._execute as ex

    if sys.platform.startswith("linux"):
        assert ex._malloc_trim() is not None  # glibc here: the function is found
        assert ex.anonymous_bytes() > 0
    calls: list[int] = []
    monkeypatch.setattr(ex, "TRIM_GROWTH_BYTES", 1 << 40)
    monkeypatch.setattr(ex, "_TRIM", [calls.append, -ex.TRIM_EVERY_S, 0])
    save_file({"w": torch.ones(8, 4)}, str(tmp_path / "model.safetensors"))
    for _ in range(3):
        dcp_load.load({"w": torch.zeros(8, 4)}, checkpoint_id=str(tmp_path))
    assert calls == [0]
    monkeypatch.setattr(ex, "TRIM_EVERY_S", 0.0)
    dcp_load.load({"w": torch.zeros(8, 4)}, checkpoint_id=str(tmp_path))
    assert calls == [0, 0]


def test_a_load_gives_memory_back_once_it_grew(tmp_path, monkeypatch):
    """Within the interval, a load that ends with ``TRIM_GROWTH_BYTES`` more anonymous
    memory than the least seen since the last trim trims at once (a burst of loads kept
    what their threads freed); memory freed meanwhile lowers that mark."""
    import dcp_load.run._execute as ex

    calls: list[int] = []
    anon = [100 << 20]
    monkeypatch.setattr(ex, "anonymous_bytes", lambda: anon[0])
    monkeypatch.setattr(ex, "_TRIM", [calls.append, -ex.TRIM_EVERY_S, 0])
    save_file({"w": torch.ones(8, 4)}, str(tmp_path / "model.safetensors"))

    def load() -> None:
        dcp_load.load({"w": torch.zeros(8, 4)}, checkpoint_id=str(tmp_path))

    load()
    assert calls == [0]  # the first load: the interval has passed
    anon[0] += ex.TRIM_GROWTH_BYTES - 1
    load()
    assert calls == [0]
    anon[0] -= 4 << 20  # the caller freed memory: the mark goes down with it
    load()
    anon[0] += ex.TRIM_GROWTH_BYTES
    load()
    assert calls == [0, 0]
    assert ex._TRIM[2] == anon[0]  # measured again after the trim
    load()
    assert calls == [0, 0]
