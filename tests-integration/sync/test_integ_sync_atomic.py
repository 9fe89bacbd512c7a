"""A transfer that fails part way, between two jobs launched apart (integ_sync_atomic_cases):
a ``delta=True`` call after its plan's first leaves every engine destination with the
previous step, bit for bit, whether a trainer rank raises or exits after the dense pieces
were broadcast; a call that writes in place (``delta=False``, or a delta plan's first call)
says on every rank that the destinations may hold a mix of two steps and that the next
transfer sends everything. Either way the plan is forgotten and a following ``delta=True``
transfer in a new group sends everything and gives the next step exactly."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
sys.path.insert(0, str(Path(__file__).parent))
import integ_sync_atomic_cases as cases  # noqa: E402
from ports import free_ports  # noqa: E402

SIZES = (2, 2)
EVERY = ["a", "b", "c"]
MIX = "the destinations may hold a mix of two steps"
NEXT_ALL = "the next transfer plans again and sends everything"
LOAD_LINE = "Load again before using them"


def run_jobs(fn: Any, *args: Any, trainer_may_die: tuple[int, ...] = ()) -> tuple[list[Any], list[Any]]:
    """``fn`` on a trainer job and an engine job launched apart, with two ports (two groups)."""
    port, port2 = free_ports(2)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_ranks, fn, n, side, port, SIZES, port2, *args, timeout=240, pg_timeout=240,
                            may_die=trainer_may_die if side == "trainer" else ())
                for side, n in zip(("trainer", "engine"), SIZES, strict=True)]
        return jobs[0].result(), jobs[1].result()


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failed_delta_transfer_leaves_the_previous_step(how):
    trainer, engine = run_jobs(cases.delta_fails_midway, how, trainer_may_die=(1,) if how == "exit" else ())
    for rank, r in enumerate(engine):
        assert r["matches1"] == EVERY and not r["step1"]["reused"], (rank, r)
        # "a" (95 % changed) was broadcast whole before the failure: staged, never written
        assert r["matches2"] == EVERY, (rank, r)
        # the plan was forgotten: the new group's delta=True transfer sends everything, exact
        assert r["step3"]["received"] == r["step3"]["kept"] and r["matches3"] == EVERY, (rank, r)
    for r in [*(trainer if how == "raise" else trainer[:1]), *engine]:
        assert "step2" not in r and "execute" in r["error2"] and "rank 1" in r["error2"], r
        assert "no destination was written" in r["error2"] and MIX not in r["error2"], r
        assert LOAD_LINE not in r["error2"], r  # the advice written for ``load`` does not apply
        assert r["seconds"] < 30, r
        # closing the failed group: no collective queued behind the broadcasts that never finished
        assert r["close_seconds"] < 15, r


@pytest.mark.parametrize("delta", [False, True], ids=["full", "first_delta"])
def test_a_failed_transfer_in_place_names_the_mix_on_every_rank(delta):
    trainer, engine = run_jobs(cases.full_fails_midway, delta)
    for r in [*trainer, *engine]:
        message = r["error2"]
        assert "execute" in message and "rank 1" in message and "injected" in message, r
        assert MIX in message and NEXT_ALL in message and LOAD_LINE not in message, r
        assert r["plans_kept"] == 0, r  # the failed call's plan forgotten on every rank
    for rank, r in enumerate(engine):
        if not delta:
            assert not r["step1"]["reused"], r
        assert r["step3"]["received"] == r["step3"]["kept"] and r["matches3"] == EVERY, (rank, r)
