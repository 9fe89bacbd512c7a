"""``async_save`` in one process copies every save into the one arena the staging pool keeps
(``saving/_staging.py``): a second save of the same layout copies into the same memory, a
save of another layout reuses it without leaving the last save's bytes in its files, and
what the caller writes after the call returns never reaches the files. The files are
byte-identical to ``save``'s of the same values. The arena is ordinary pages, not advised
for huge pages (whose first touch made the first save of 1 GiB on 4 ranks 1.9-6.5 x
slower, ``saving/_staging.py``), and ``release_staging`` unmaps it. Destinations are
poisoned before each load."""

from __future__ import annotations

import os

import dcp_load
import pytest
import torch
from dcp_load.saving._staging import POOL


def _state(gen: int, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(gen)
    return {"w": torch.randn(rows, 32, generator=g) + gen, "h": torch.randn(rows, generator=g).to(torch.bfloat16),
            "i": torch.arange(10) + gen, "s": torch.tensor(float(gen))}


def _poisoned(rows: int = 64) -> dict:
    return {"w": torch.full((rows, 32), float("nan")), "h": torch.full((rows,), float("nan"), dtype=torch.bfloat16),
            "i": torch.full((10,), -1), "s": torch.tensor(float("nan"))}


def _loaded(path, rows: int = 64) -> dict:
    got = _poisoned(rows)
    dcp_load.load(got, checkpoint_id=path, no_dist=True)
    return got


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _data(path) -> bytes:
    """The bytes of the one tensor file of a one-rank checkpoint."""
    (name,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def _arena() -> tuple[int, int, int]:
    """(identity, address, bytes) of the pool's arena: memory freed and taken again may
    come back at the same address, never as the same object."""
    return id(POOL._arena), POOL._arena.ctypes.data, POOL.capacity


def test_a_second_save_of_the_same_layout_copies_into_the_same_arena(tmp_path):
    dcp_load.release_staging()
    dcp_load.save(_state(1), checkpoint_id=tmp_path / "sync")
    dcp_load.async_save(_state(1), checkpoint_id=tmp_path / "a").result(timeout=60)
    first, kept = _arena(), POOL._arena  # kept alive: its identity cannot be reused
    report = dcp_load.async_save(_state(1), checkpoint_id=tmp_path / "b").result(timeout=60)
    assert _arena() == first and POOL._arena is kept and report.staged_bytes == report.bytes_written > 0
    assert _data(tmp_path / "a") == _data(tmp_path / "b") == _data(tmp_path / "sync")
    assert _equal(_loaded(tmp_path / "b"), _state(1))


def test_what_the_caller_writes_after_the_call_never_reaches_the_files(tmp_path):
    dcp_load.release_staging()
    sd = _state(1)
    for gen in (1, 2, 3):  # the arena holds the last save's copy when the next one starts
        for k, v in _state(gen).items():
            sd[k].copy_(v)
        fut = dcp_load.async_save(sd, checkpoint_id=tmp_path / f"g{gen}")
        for v in sd.values():
            v.fill_(-7)  # after the call: the copy was taken
        fut.result(timeout=60)
    for gen in (1, 2, 3):
        assert _equal(_loaded(tmp_path / f"g{gen}"), _state(gen)), gen
        dcp_load.save(_state(gen), checkpoint_id=tmp_path / f"sync{gen}")
        assert _data(tmp_path / f"g{gen}") == _data(tmp_path / f"sync{gen}"), gen


def test_another_layout_reuses_the_arena_without_the_last_saves_bytes(tmp_path):
    dcp_load.release_staging()
    dcp_load.async_save(_state(5, rows=4096), checkpoint_id=tmp_path / "big").result(timeout=60)
    big, kept = _arena(), POOL._arena
    # Fewer, smaller boxes, other names: they land where the big save's bytes still are.
    small = {"other": torch.arange(300, dtype=torch.int32), **_state(6, rows=16)}
    report = dcp_load.async_save(small, checkpoint_id=tmp_path / "small").result(timeout=60)
    assert _arena() == big and POOL._arena is kept and report.staged_bytes == report.bytes_written
    got = {"other": torch.full((300,), -1, dtype=torch.int32), **_poisoned(16)}
    dcp_load.load(got, checkpoint_id=tmp_path / "small", no_dist=True)
    assert _equal(got, small)
    dcp_load.save(small, checkpoint_id=tmp_path / "sync")
    assert _data(tmp_path / "small") == _data(tmp_path / "sync")
    assert _equal(_loaded(tmp_path / "big", rows=4096), _state(5, rows=4096))


def _mapping(address: int) -> list[str] | None:
    """The lines of /proc/self/smaps of the mapping holding ``address``, or None."""
    lines, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                if inside:
                    return lines
                start, end = (int(x, 16) for x in head.split("-"))
                inside, lines = start <= address < end, []
            if inside:
                lines.append(line)
    return lines if inside else None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_the_arena_is_ordinary_pages_and_release_unmaps_it(tmp_path):
    dcp_load.release_staging()
    dcp_load.async_save({"w": torch.ones(2048, 1024)}, checkpoint_id=tmp_path / "ckpt").result(timeout=60)
    size = POOL.capacity
    address = POOL._arena.ctypes.data + size // 2  # advice splits a map: its first page may stay apart
    assert size == 8 * 2**20
    mapping = _mapping(address)
    flags = next(line for line in mapping if line.startswith("VmFlags:")).split()[1:]
    assert "hg" not in flags, flags  # no MADV_HUGEPAGE: the first save's faults are 4 KiB ones
    assert dcp_load.release_staging() == size and _mapping(address) is None
