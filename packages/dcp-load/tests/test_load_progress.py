"""What a load shows a person: the plan summary and each phase's time and bytes at INFO on
rank 0 only, nothing when INFO is off, and the terminal bar only on a TTY after the delay
(a fake clock drives it); on 2 real gloo ranks, rank 1 logs and draws nothing."""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

import dcp_load
import pytest
import torch
from dcp_load.run._progress import Progress
from dcp_load.run._units import human_bytes
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import load_progress_cases as cases  # noqa: E402

LOGGER = "dcp_load.run._progress"
PHASES = ["load phase prepare", "load phase plan", "load plan", "load phase validate", "load phase execute",
          "load phase finish", "load phase total"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Plan:
    """The parts of a GlobalPlan the summary reads: the whole job's plan of 2 ranks."""

    world_size, loads, unique_bytes, fetched_bytes, rank = 2, (3000, 1000), 4000, 4000, None
    broadcasts = (type("Item", (), {"ranks": (0, 1)})(),)

    def reads_for(self, rank: int):
        return [type("Item", (), {"nbytes": 1500})()] * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    dcp_load.save({"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), "b": torch.zeros(32)},
                  checkpoint_id=path)
    return path


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 1000, 1_536_000, 2.5e12, 7e15)] == [
        "0 B", "999 B", "1.0 KB", "1.5 MB", "2.5 TB", "7000.0 TB"]


def test_bar_waits_for_the_delay_then_shows_bytes_and_rate():
    clock, tty = Clock(), cases.FakeTTY()
    p = Progress(0, True, stream=tty, delay_s=3.0, clock=clock)
    p.plan(Plan(), 0, 5)
    assert p.total == 3000
    clock.now += 1.0
    p.advance(1000)
    assert tty.getvalue() == ""  # a short load shows no bar
    clock.now += 3.0
    p.advance(500)
    assert tty.getvalue() == "\rdcp load [############............]  50% 1.5 KB / 3.0 KB 375 B/s "
    clock.now += 0.01
    p.advance(500)  # redraws are at most ten a second
    assert tty.getvalue().count("\r") == 1
    clock.now += 0.99
    p.close()
    assert tty.getvalue().endswith("\rdcp load [################........]  67% 2.0 KB / 3.0 KB 400 B/s \n")
    p.close()
    p.advance(1000)
    assert tty.getvalue().endswith("400 B/s \n")  # closed: nothing more


def test_no_bar_without_a_tty_or_off_rank_0_or_when_disabled():
    for rank, enabled, stream in ((0, True, io.StringIO()), (1, True, cases.FakeTTY()),
                                  (0, False, cases.FakeTTY())):
        clock = Clock()
        p = Progress(rank, enabled, stream=stream, delay_s=0.0, clock=clock)
        p.plan(Plan(), rank, 5)
        clock.now += 5
        p.advance(3000)
        p.close()
        assert stream.getvalue() == "", (rank, enabled)


def test_a_broken_stderr_never_fails_the_load():
    class Broken(cases.FakeTTY):
        def write(self, s: str) -> int:
            raise OSError("stderr is gone")

    clock = Clock()
    p = Progress(0, True, stream=Broken(), delay_s=0.0, clock=clock)
    p.plan(Plan(), 0, 1)
    clock.now += 1
    p.advance(10)
    p.close()


def test_info_lines_on_rank_0_and_nothing_on_other_ranks(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress(0, stream=io.StringIO())
        p.plan(Plan(), 0, 5)
        p.phase("plan", 0.25)
        p.phase("execute", 2.0, 3_000_000)
        Progress(1).phase("execute", 2.0, 3_000_000)
    assert [r.getMessage() for r in caplog.records] == [
        "load plan: 5 tensor(s) on 2 rank(s); rank 0 reads 2 piece(s), 3.0 KB; job: read per rank: max 3.0 KB, "
        "mean 2.0 KB (max/mean 1.500); broadcasts per rank: max 1; storage amplification: 1.0000",
        "load phase plan: 0.250 s",
        "load phase execute: 2.000 s, 3.0 MB (1.5 MB/s)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_nothing_when_logging_is_off(checkpoint, caplog, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", cases.FakeTTY())
    monkeypatch.setattr("dcp_load.run._progress.DELAY_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="dcp_load"):
        dcp_load.load({"w": torch.empty(64, 32)}, checkpoint_id=checkpoint, strict=False)
    assert caplog.records == [] and sys.stderr.getvalue() == ""


def test_one_process_load_logs_every_phase_and_draws_the_bar(checkpoint, caplog, monkeypatch):
    monkeypatch.setattr(sys, "stderr", cases.FakeTTY())
    monkeypatch.setattr("dcp_load.run._progress.DELAY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="dcp_load"):
        dcp_load.load({"w": torch.empty(64, 32)}, checkpoint_id=checkpoint, strict=False)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [m.split(":")[0] for m in messages] == PHASES
    assert messages[2] == ("load plan: 1 tensor(s) on 1 rank(s); rank 0 reads 1 piece(s), 8.2 KB; job: read per rank: "
                           "max 8.2 KB, mean 8.2 KB (max/mean 1.000); broadcasts per rank: max 0; storage "
                           "amplification: 1.0000")
    assert "8.2 KB (" in messages[4] and "8.2 KB (" in messages[6]
    assert re.fullmatch(r"(\rdcp load \[#{24}\] 100% 8\.2 KB / 8\.2 KB [0-9.]+ [KMG]?B/s )+\n",
                        sys.stderr.getvalue()), sys.stderr.getvalue()


def test_two_ranks_only_rank_0_logs_and_draws(checkpoint):
    (msgs0, bar0, ok0), (msgs1, bar1, ok1) = run_ranks(cases.load_with_progress, 2, checkpoint, timeout=120)
    assert ok0 and ok1
    assert [m.split(":")[0] for m in msgs0] == PHASES
    assert msgs0[2].startswith("load plan: 2 tensor(s) on 2 rank(s); rank 0 reads "), msgs0[2]
    # a derived plan: rank 0 knows the replica groups it planned, here both ranks; w and b
    # (8,320 bytes) are read once between them, each broadcast to the other
    assert msgs0[2].endswith("; rank 0's replica groups: broadcasts of rank 0: 2; storage amplification: 1.0000"), \
        msgs0[2]
    assert "dcp load [" in bar0 and bar0.endswith("\n")
    assert msgs1 == [] and bar1 == ""


def test_a_rank_part_of_a_derived_plan_claims_no_job_wide_reads_per_rank():
    """Rank r's part of a derived plan charges other ranks only the rows it planned: a
    max/mean over those partial loads (1.537 here, against 1.000 for the job) must not be
    printed as the job's bytes read per rank."""
    from dcp_load.plan._local import plan_for_rank
    from dcp_load.plan._plan import HostBlocks
    from dcp_load.plan._simulate import Layout, model_metadata, simulate, stage_entries
    from dcp_load.run._plan_summary import plan_numbers, summary_text

    tensors, layout = model_metadata("llama-8b"), Layout(2, 2, 2, ranks_per_host=1)
    job = simulate(tensors, layout, time_roles=False)
    assert summary_text(job).startswith("read per rank: max 2.0 GB, mean 2.0 GB (max/mean 1.000); ")
    per_stage = stage_entries(tensors, layout)
    for rank, stage in ((0, 0), (3, 1)):
        part = plan_for_rank(tensors, per_stage[stage], rank, layout.world, hosts=HostBlocks(8, 1),
                             same_host_reads=True)
        numbers = plan_numbers(part)
        assert numbers["read_bytes_per_rank_max"] is None and numbers["read_bytes_per_rank_mean"] is None
        assert summary_text(numbers) == (f"broadcasts of rank {rank}: {len(part.broadcasts)}; "
                                         "storage amplification: 1.0000")
