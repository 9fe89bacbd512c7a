"""The device path on 2 real gloo ranks, each with fake accelerator memory
(``dcp_platform.testing.FakeAccelerator`` with ``hold_s=None``: a copy completes only once
something waits for it, and new memory is poison, NaN):

* a load with broadcasts into float32, bf16 (a cast on the device) and transposed
  (strided) destinations: each replicated piece is read once, copied to its reader's
  device destination through pinned buffers and broadcast from there; values exact on
  every rank, no pinned buffer rewritten before its copy ran, one stream wait per load
  (a cast or strided write ordered after the event a broadcast waits for sent poison);
* without ordering a broadcast after its piece's copies (``DeviceLoad.publish``
  removed), every rank receives poison for the last piece its peer read;
* async_save of device tensors overwritten right after the call: the checkpoint holds
  the values at the call, each box copied by its one writer; without staging's wait for
  its device-to-host copies, the checkpoint holds poison.
"""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))

import integ_device_cases as cases  # noqa: E402


def test_device_load_with_broadcasts(tmp_path):
    outs = run_ranks(cases.load_layouts, 2, str(tmp_path / "c"), 7, timeout=240, pg_timeout=120)
    for rank, by_layout in enumerate(outs):
        assert list(by_layout) == list(cases.LAYOUTS)
        for layout, out in by_layout.items():
            assert out["exact"] == cases.NAMES, (rank, layout, out)
            assert out["violations"] == [], (rank, layout, out)
            assert out["broadcasts"] > 0 and out["stream_syncs"] == 1, (rank, layout, out)
            assert out["received"] > 0 and out["copies"] > 0, (rank, layout, out)  # each reads some, receives the rest
    for layout in cases.LAYOUTS:
        assert sum(o[layout]["copies"] for o in outs) == len(cases.NAMES)  # each piece went to a device once


def test_broadcast_before_its_copy_is_caught(tmp_path):
    outs = run_ranks(cases.load_broadcast, 2, str(tmp_path / "c"), 11, True, timeout=240, pg_timeout=120)
    for rank, out in enumerate(outs):
        wrong = [n for n in cases.NAMES if n not in out["exact"]]
        assert wrong and wrong == out["nan"], (rank, out)  # poison, received from the peer's last read


def test_async_save_from_device_memory_on_ranks(tmp_path):
    outs = run_ranks(cases.async_save_replicated, 2, str(tmp_path / "c"), timeout=240, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["exact"] == cases.NAMES, (rank, out)
        assert out["violations"] == [], (rank, out)
    assert sum(o["copies"] for o in outs) == len(cases.NAMES)  # one writer per replicated box


def test_async_save_without_its_wait_writes_poison_on_ranks(tmp_path):
    outs = run_ranks(cases.async_save_replicated, 2, str(tmp_path / "c"), True, timeout=240, pg_timeout=120)
    for rank, out in enumerate(outs):
        assert out["exact"] == [] and out["nan"] == cases.NAMES, (rank, out)  # every box, whichever rank wrote it
