"""Transfer groups re-created on one port (integ_sync_restart_cases): a trainer that restarts
while the engine lives on, both sides rejoining after ``close()`` (the port, store and kept
plans released), a second group on a taken port, two processes claiming one rank, and the
store's owner gone. Each job is its own ``run_ranks`` launch; every failure is named on the
rank that sees it within the cases' bound (``TIMEOUT_S``), never a hang."""

from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from dcp_platform.testing import RankDied, run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_sync_restart_cases as cases  # noqa: E402

#: Bound of one launch: a case that hangs fails here, well before CI's limit.
LAUNCH_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(fn: Any, *args: Any, engines: int = 1, may_die: tuple[int, ...] = ()) -> tuple[list[Any], list[Any]]:
    """``fn`` on a 1-rank trainer job and an ``engines``-rank engine job, launched apart."""
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_ranks, fn, 1, "trainer", port, *args, timeout=LAUNCH_S, may_die=may_die)
        engine = pool.submit(run_ranks, fn, engines, "engine", port, *args, timeout=LAUNCH_S)
        return trainer.result(), engine.result()


@pytest.mark.parametrize("wait", [False, True], ids=["rejoin-at-once", "rejoin-after-exit"])
def test_engine_rejoins_a_restarted_trainer_and_transfers_at_once(wait):
    # The engine rejoins right after close() (the old trainer may still serve the port) or
    # once the old trainer exited; the trainer's second launch counts its calls from 0
    # while the engine made 2 already.
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        engine = pool.submit(run_ranks, cases.long_lived_engine, 1, port, 2, 2, wait, timeout=2 * LAUNCH_S)
        first = run_ranks(cases.trainer_launch, 1, port, 1, 2, timeout=LAUNCH_S)
        if wait:
            time.sleep(1)  # the engine sees the old trainer gone before the new one binds
        second = run_ranks(cases.trainer_launch, 1, port, 2, 2, timeout=LAUNCH_S)
        got = engine.result()[0]
    for launch, steps in ((first, 2), (second, 2)):
        assert [r[0] for r in launch[0]] == [None] * steps, launch
    expected = [[cases.value(1, 0)], [cases.value(1, 1)], [cases.value(2, 0)], [cases.value(2, 1)]]
    assert [g for g, _ in got] == expected, got
    assert all(seconds < 5 for _, seconds in got), got


def test_close_releases_the_port_the_store_and_the_kept_plans():
    trainer, engine = run_jobs(cases.rejoin_cycles, 4)
    for side, r in (("trainer", trainer[0]), ("engine", engine[0])):
        want = [[cases.value(1, c)] for c in range(4)] if side == "engine" else [None] * 4
        assert [g for g, _ in r["got"]] == want, (side, r["got"])
        assert r["kept"] == [False] * 4, r  # close() forgot the group's kept plans
        # the same descriptors after every cycle (a group's sockets and threads go with it)
        assert max(r["fds"][1:]) <= r["fds"][0], (side, r["fds"])


def test_a_second_group_on_a_taken_port_is_named_on_both_sides():
    trainer, engine = run_jobs(cases.two_names_one_port)
    t, e = trainer[0], engine[0]
    assert "could not host the store" in t["message"] and "is taken by another process or by a transfer " \
        "group not closed yet" in t["message"], t
    assert "serves transfer group 'policy', not 'ref'" in e["message"] and "(engine rank 0)" in e["message"], e
    assert t["seconds"] < 2 and e["seconds"] < 2, (t, e)
    assert e["policy"][0] == [cases.value(1, 0)], e


def test_two_processes_claiming_one_rank_are_told_at_once(tmp_path):
    trainer, engine = run_jobs(cases.duplicate_engine, str(tmp_path), engines=2)
    assert trainer[0]["got"][0] is None, trainer
    winners = [r for r in engine if "got" in r]
    losers = [r for r in engine if "message" in r]
    assert len(winners) == 1 and winners[0]["got"][0] == [cases.value(1, 0)], engine
    assert len(losers) == 1, engine
    assert "another process already joined this group as engine rank 0" in losers[0]["message"], losers
    assert losers[0]["seconds"] < cases.TIMEOUT_S, losers


def test_the_store_owner_gone_is_named():
    trainer, engine = run_jobs(cases.owner_dies, may_die=(0,))
    assert isinstance(trainer[0], RankDied), trainer
    got, seconds = engine[0]["got"], engine[0]["seconds"]
    assert got.startswith("TransferGroupError: ") and "trainer rank 0, which serves the group's store at " \
        "127.0.0.1:" in got and "is gone" in got and "(engine rank 0)" in got, got
    assert seconds < 2, engine
