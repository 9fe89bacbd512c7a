"""The device path on 2 real gloo ranks, each with fake accelerator memory
(``dcp_platform.testing.FakeAccelerator``: copies complete late, at random):

* a load with broadcasts: each replicated piece is read once, copied to its reader's
  device destination through pinned buffers and broadcast from there; values exact on
  every rank, no pinned buffer rewritten before its copy ran, one stream wait per load;
* without ordering a broadcast after its piece's copies, receivers get poison (the check
  above would fail);
* async_save of device tensors overwritten right after the call: the checkpoint holds
  the values at the call, each box copied by its one writer.
"""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))

import integ_device_cases as cases  # noqa: E402


def test_device_load_with_broadcasts(tmp_path):
    outs = run_ranks(cases.load_broadcast, 2, str(tmp_path / "c"), 7, False, timeout=240, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["exact"] == cases.NAMES, (rank, out)
        assert out["violations"] == [], (rank, out)
        assert out["broadcasts"] > 0 and out["stream_syncs"] == 1, (rank, out)
        assert out["received"] > 0 and out["copies"] > 0, (rank, out)  # each rank reads some, receives the rest
    assert sum(o["copies"] for o in outs) == len(cases.NAMES)  # each piece went to a device once


def test_broadcast_before_its_copy_is_caught(tmp_path):
    outs = run_ranks(cases.load_broadcast, 2, str(tmp_path / "c"), 11, True, timeout=240, pg_timeout=120)
    assert any(o["exact"] != cases.NAMES for o in outs), outs


def test_async_save_from_device_memory_on_ranks(tmp_path):
    outs = run_ranks(cases.async_save_replicated, 2, str(tmp_path / "c"), timeout=240, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["exact"] == cases.NAMES, (rank, out)
        assert out["violations"] == [], (rank, out)
    assert sum(o["copies"] for o in outs) == len(cases.NAMES)  # one writer per replicated box
