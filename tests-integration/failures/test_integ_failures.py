"""Failing together, fast, on 4 real gloo ranks with a 10-minute process-group timeout.

Covered: a rank SIGKILLed inside a broadcast and on its read-ahead thread; a rank whose
copy of the checkpoint lacks its data file or has it truncated; a rank whose platform
choice fails; an exception in execute outside the read thread; a rank arriving later than
``timeout=``; a rank that raises before calling ``load``; 50 repeated loads leak no
threads, fds, groups or memory. Every surviving rank must raise ``LoadError`` within 30 s
(so dcp, not the process-group timeout, ends the wait), naming the failed rank.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from dcp_platform.testing import RankDied, run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_failure_cases as cases  # noqa: E402

WORLD = 4
PG_TIMEOUT = 600.0  # the process-group timeout: never what ends a wait here
BOUND_S = 30.0


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("failures")
    # The copies keep the checkpoint's directory name (a copy on another node): a rank
    # opening a checkpoint of another name is a different checkpoint (the metadata digest).
    out = {k: str(root / k / "good") if k != "good" else str(root / k) for k in ("good", "missing_file", "truncated")}
    cases.write(out["good"])
    data = [f for f in os.listdir(out["good"]) if f.endswith(".safetensors")]
    shutil.copytree(out["good"], out["missing_file"])
    for f in data:
        os.remove(os.path.join(out["missing_file"], f))
    shutil.copytree(out["good"], out["truncated"])
    for f in data:
        path = os.path.join(out["truncated"], f)
        os.truncate(path, os.path.getsize(path) // 2)
    return out


def _assert_all_raise(outcomes: list[dict], failed: int, *, phase: str | None = None,
                      words: str | None = None, dead: tuple[int, ...] = ()) -> None:
    for rank, out in enumerate(outcomes):
        if rank in dead:
            assert isinstance(out, RankDied) and out.exitcode == -9, out
            continue
        err = out["error"]
        assert err is not None, f"rank {rank} did not raise (ok={out.get('ok')})"
        assert err["type"] == "LoadError", f"rank {rank}: {err['message']}"
        assert out["seconds"] < BOUND_S, f"rank {rank} took {out['seconds']:.1f} s"
        assert failed in err["ranks"], f"rank {rank} does not name rank {failed}: {err['message']}"
        if phase is not None:
            assert err["phase"] == phase, err["message"]
        if words is not None:
            assert words in err["message"], err["message"]


@pytest.fixture(scope="module")
def shared(ckpts: dict[str, str]) -> dict:
    return run_ranks(cases.shared_cases, WORLD, ckpts, timeout=300, pg_timeout=PG_TIMEOUT)


def _per_rank(shared: list[dict], name: str) -> list[dict]:
    return [r[name] for r in shared]


def test_platform_choice_failing_on_one_rank_raises_everywhere(shared):
    _assert_all_raise(_per_rank(shared, "platform"), 1, phase="validate", words="no-such-backend")


def test_missing_file_on_one_rank(shared):
    _assert_all_raise(_per_rank(shared, "missing_file"), 1, phase="validate", words="rank-00000.")


def test_truncated_file_on_one_rank(shared):
    _assert_all_raise(_per_rank(shared, "truncated"), 1, phase="validate", words="rank 1")


def test_late_rank_beyond_timeout_is_named(shared):
    outcomes = _per_rank(shared, "late")
    _assert_all_raise(outcomes, 2, words="did not reach")
    # The ranks that arrived gave up after timeout=2 s, not after the late rank's 5 s.
    assert all(o["seconds"] < 4.5 for r, o in enumerate(outcomes) if r != 2), outcomes


def test_rank_raising_before_load_is_named(shared):
    outcomes = _per_rank(shared, "raise_before")
    assert "rank 3 failed before calling load" in outcomes[3]["error"]["message"]
    _assert_all_raise(outcomes[:3], 3, words="did not reach")


def test_repeated_loads_leak_nothing(shared):
    for rank, r in enumerate(shared):
        rep = r["repeat"]
        assert rep["ok"] and not rep["errors"], rep["errors"]
        threads, fds, groups, rss = rep["before"]
        assert rep["after"][:3] == (threads, fds, groups), f"rank {rank}: {rep}"
        assert rep["after"][3] - rss < 16 * 2**20, f"rank {rank}: RSS grew {rep['after'][3] - rss} bytes"


@pytest.mark.parametrize("fn", [cases.kill_in_broadcast, cases.kill_in_read_ahead],
                         ids=["broadcast", "read_ahead"])
def test_killed_rank_makes_every_survivor_raise(ckpts, fn):
    victim = 2
    outcomes = run_ranks(fn, WORLD, ckpts, victim, timeout=120, pg_timeout=PG_TIMEOUT, may_die=(victim,))
    _assert_all_raise(outcomes, victim, phase="execute", words="stopped responding", dead=(victim,))


def test_exception_in_execute_outside_read_thread(ckpts):
    victim = 1
    # may_die: every rank reports before its teardown, which unfinished collectives can block;
    # _assert_all_raise still requires every rank to have reported.
    outcomes = run_ranks(cases.raise_in_execute, WORLD, ckpts, victim, timeout=120, pg_timeout=PG_TIMEOUT,
                         may_die=(0, 1, 2, 3))
    _assert_all_raise(outcomes, victim, phase="execute", words="injected fused_copy failure")
