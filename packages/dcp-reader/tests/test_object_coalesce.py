"""How the object backend groups wanted ranges into GETs (``_object._parts``): every wanted
byte is covered, the gap bytes read stay within ``max_overread`` of the wanted bytes, and a
row-strided column half (gaps owned by other ranks) is no longer fetched whole."""

from __future__ import annotations

import pytest
from dcp_reader.storage._object import _parts
from dcp_reader.storage._options import MiB, ObjectOptions
from hypothesis import given, settings
from hypothesis import strategies as st


def _spans(pairs: list[tuple[int, int]]) -> list[tuple[int, memoryview]]:
    return [(off, memoryview(bytearray(n))) for off, n in pairs]


@st.composite
def _layouts(draw):
    out, pos = [], 0
    for _ in range(draw(st.integers(0, 40))):
        pos += draw(st.integers(0, 3 * MiB))
        n = draw(st.integers(0, 2 * MiB))
        out.append((pos, n))
        pos += n
    return out


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.sampled_from([0, 4096, MiB]), st.sampled_from([0.0, 0.05, 0.5]),
       st.sampled_from([5 * MiB, 8 * MiB]))
def test_parts_cover_every_wanted_byte_and_over_read_stays_within_the_bound(pairs, gap, overread, part):
    parts = _parts(_spans(pairs), part, gap, overread)
    wanted = sum(n for _, n in pairs)
    got = sum(hi - lo for lo, hi in parts)
    assert all(lo < hi and hi - lo <= part for lo, hi in parts)
    assert all(a[1] <= b[0] for a, b in zip(parts, parts[1:], strict=False))  # ascending, disjoint
    for off, n in pairs:  # every wanted byte lies in one GET
        if n:
            covered = sum(min(hi, off + n) - max(lo, off) for lo, hi in parts if lo < off + n and hi > off)
            assert covered == n, (off, n)
    assert got - wanted <= overread * wanted + 1e-6


def test_a_column_half_of_row_major_rows_is_not_fetched_whole():
    # a (2048, 2048) bf16 tensor's left half: 2048 runs of 2 KiB, each followed by the other
    # rank's 2 KiB; the old 1 MiB gap read all 8 MiB in one GET (2 x the wanted bytes)
    row = 4096
    pairs = [(r * row, row // 2) for r in range(2048)]
    parts = _parts(_spans(pairs), 8 * MiB, MiB, 0.05)
    fetched = sum(hi - lo for lo, hi in parts)
    assert fetched <= 1.05 * 4 * MiB
    assert len(parts) < 2048  # the bound's budget still saves some GETs
    assert _parts(_spans(pairs), 8 * MiB, MiB, 1.0) == [(0, 8 * MiB - row // 2)]  # a looser bound reads through


def test_small_gaps_are_read_through_first_and_large_ones_cost_a_get():
    pairs = [(0, 1000), (1010, 1000), (5000, 1000), (100 * MiB, 1000)]
    assert _parts(_spans(pairs), 8 * MiB, MiB, 0.05) == [(0, 2010), (5000, 6000), (100 * MiB, 100 * MiB + 1000)]


def test_max_overread_is_read_from_the_environment_and_checked(monkeypatch):
    monkeypatch.setenv("DCP_STORAGE_MAX_OVERREAD", "0.2")
    assert ObjectOptions.from_env().max_overread == 0.2
    with pytest.raises(ValueError, match="max_overread"):
        ObjectOptions(max_overread=-1)
