"""dcp_platform.Watch and Platform.wait on 3 real gloo ranks (one launch): a bounded wait
returns False before the source sends and True after; gather and a watched broadcast
deliver; a rank that never arrives is named after the arrival timeout; a published abort
reaches ranks blocked in a local wait within the heartbeat interval; a platform whose
default group is not gloo sends control traffic over one shared gloo group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import platform_watch_cases as cases  # noqa: E402

WORLD = 3


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(cases.watch_cases, WORLD, timeout=120, pg_timeout=600)


def test_platform_wait_is_bounded(results):
    for rank, r in enumerate(results):
        assert r["wait"]["data"] == [0.0] * 4
        if rank != 0:
            assert r["wait"]["first"] is False  # the source was still asleep


def test_watch_gather_and_broadcast(results):
    for r in results:
        assert r["gather"]["value"] == [{"rank": i} for i in range(WORLD)]
        assert r["bounded_broadcast"]["value"] == [float(WORLD - 1)] * 3


def test_watch_names_the_rank_that_never_arrived(results):
    for r in results[:-1]:
        late = r["late"]
        assert late["error"] is not None and list(late["error"]) == [WORLD - 1]
        assert "did not reach t within 1.5 s" in late["error"][WORLD - 1][0]
        assert 1.4 < late["seconds"] < 5.0


def test_control_traffic_over_one_shared_gloo_group_when_not_gloo(results):
    for r in results:
        c = r["control"]
        assert c["gathered"] == [list(range(WORLD)), [0.0, 0.0]] * 3
        assert c["groups_added"] == 1 and c["is_gloo"]


def test_watch_abort_reaches_every_waiting_rank(results):
    for rank, r in enumerate(results):
        if rank == 1:
            continue
        assert r["abort"]["error"] == {1: ("boom on rank 1",)}
        assert r["abort"]["seconds"] < 2.0


def test_waiting_logs_nothing_and_a_stalled_collective_is_bounded():
    """A TCPStore: while rank 0 waits 3 s for rank 1 to arrive, nothing is written to its
    stderr (each expired ``store.wait`` slice used to log two ``[c10d] waitForInput``
    warnings). Then ``stall_s=1``: a broadcast rank 1 joins only after 4 s ends rank 0's
    wait after about 1 s with its cause published (rank 1 sees it), and the watch reports
    the collective left unfinished."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_rank = run_ranks(cases.quiet_and_stall_cases, 2, port, timeout=120, pg_timeout=600)
    first = per_rank[0]
    assert first["arrive"]["error"] is None and first["arrive"]["seconds"] > 2.5, first["arrive"]
    assert "waitForInput" not in first["stderr"] and first["stderr"].strip() == "", first["stderr"][:2000]
    stall = first["stall"]
    assert stall["error"] is not None and 0.9 < stall["seconds"] < 3.0, stall
    assert "while every rank was alive" in stall["error"][0][0] and first["interrupted"], first
    assert per_rank[1]["stall"]["error"] == {0: stall["error"][0]}, per_rank[1]
