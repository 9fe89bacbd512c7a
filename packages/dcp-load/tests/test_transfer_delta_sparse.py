"""The positions + values buffers of ``transfer(delta=True)`` (transferring/_sparse.py):
a piece's changed elements, packed on the sender as indices or a bitmask (whichever is
smaller, as every rank derives it from the counts), written into a strided destination
view on the receiver: exactly the changed elements, the others untouched."""

from __future__ import annotations

import pytest
import torch
from dcp_load.transferring import _sparse


def _changed_piece(share: float, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the previous values, the new ones, the changed positions) of a 96 x 40 piece held as
    the columns [8, 48) of a 96 x 64 tensor (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(96, 64, generator=g).to(dtype)
    view = base[:, 8:48]
    last = view.clone()
    picks = torch.randperm(view.numel(), generator=g)[:round(view.numel() * share)]
    flat = last.reshape(-1).clone()
    flat[picks] += 1
    view.copy_(flat.view(view.shape))
    return last, view, picks


@pytest.mark.parametrize("share", [0.0005, 0.02, 0.031, 0.04, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_changed_elements_reach_a_strided_destination_exactly(share, dtype):
    last, now, picks = _changed_piece(share, dtype, seed=int(share * 1e4))
    numel, wire = now.numel(), str(dtype).removeprefix("torch.")
    mask = _sparse.changed(now, last)
    count = int(mask.count_nonzero())
    assert count == picks.numel()
    if _sparse.by_index(numel, count):
        indices = mask.view(-1).nonzero().squeeze(1)
        buf = _sparse.pack_indices(indices, torch.take(now, indices), numel)
    else:
        buf = _sparse.pack(mask, now[mask])
    assert buf.numel() == _sparse.sparse_nbytes(numel, count, wire)
    # the receiver's destination: the previous values in a strided view, its neighbours poisoned
    base = torch.empty(96, 64, dtype=dtype)
    base.view(torch.uint8).fill_(0x7F)
    dest = base[:, 8:48]
    dest.copy_(last)
    _sparse._scatter(dest, buf, dtype, numel, count)
    assert torch.equal(dest, now)
    assert bool((base[:, :8].view(torch.uint8) == 0x7F).all()) and bool((base[:, 48:].view(torch.uint8) == 0x7F).all())


def test_indices_below_one_change_in_32_elements_else_the_bitmask():
    numel = 1 << 20
    assert _sparse.by_index(numel, numel // 50)  # 2 %: 0.08 bytes per element against 0.125
    assert not _sparse.by_index(numel, numel // 32)
    assert _sparse.sparse_nbytes(numel, 20972, "bfloat16") == 4 * 20972 + 2 * 20972
    assert _sparse.sparse_nbytes(numel, 20971, "bfloat16") == 4 * 20972 + 2 * 20971  # indices padded to 8 bytes
    assert _sparse.sparse_nbytes(numel, numel // 10, "bfloat16") == numel // 8 + 2 * (numel // 10)
    assert _sparse._index_size(1 << 31) == 8 and _sparse._index_size((1 << 31) - 1) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8])
@pytest.mark.parametrize("columns", [(8, 48), (0, 64), (3, 43)])
def test_changed_indices_by_words_equal_the_element_wise_compare(dtype, columns, monkeypatch):
    monkeypatch.setattr(_sparse, "WORDS_FROM", 0)  # these small pieces go by words too
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 100, (96, 64), generator=g).to(dtype)
    now = base[:, columns[0]:columns[1]]
    last = now.clone()
    picks = torch.randperm(now.numel(), generator=g)[:40]
    flat = now.reshape(-1).clone()
    flat[picks] += 1
    now.copy_(flat.view(now.shape))
    if dtype.is_floating_point:  # -0.0 against 0.0 and a NaN's payload differ in their bits only
        last.view(-1)[0], now[0, 0] = 0.0, -0.0
        last.view(-1)[1] = now[0, 1] = float("nan")
    want = _sparse.changed(now, last).view(-1).nonzero().squeeze(1)
    got = _sparse.changed_indices(now, last)
    aligned = (columns[0] * now.element_size()) % 8 == 0 and (now.shape[1] * now.element_size()) % 8 == 0
    if not aligned:
        assert got is None  # rows that do not cut into aligned 8-byte words: element-wise instead
    else:
        assert got is not None and torch.equal(got, want), (got, want)


def test_changed_indices_gives_way_when_too_many_words_differ_or_the_piece_is_small(monkeypatch):
    now = torch.zeros(512, 256, dtype=torch.bfloat16)
    last = now.clone()
    now.view(-1)[:1] = 1
    assert now.numel() >= _sparse.WORDS_FROM and torch.equal(_sparse.changed_indices(now, last), torch.tensor([0]))
    now.view(-1)[::4] = 1  # every word differs: indices would not be the smaller form
    assert _sparse.changed_indices(now, last) is None
    assert _sparse.changed_indices(now[:8], last[:8]) is None  # 2 Ki elements: element-wise
