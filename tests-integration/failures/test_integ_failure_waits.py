"""Bounded waits where a rank dies: the derived-planning digest, group creation, save.

4 real gloo ranks with a 10-minute process-group timeout. A victim SIGKILLs itself as it
enters the digest's first all-reduce, on its way into creating its broadcast group or as
it starts connecting it (groups made by their members alone, and the all-gathered path), or
while writing its file in a
collective ``save``; a rank arriving at ``save`` later than ``timeout=`` is named. Every
surviving rank must raise ``LoadError`` within 30 s naming the dead (or late) rank. Also: a
derived load leaves neither its per-name counts nor its watch's keys in the job's store.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import RankDied, run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_failure_cases as base  # noqa: E402
import integ_waits_cases as cases  # noqa: E402

WORLD = 4
PG_TIMEOUT = 600.0  # the process-group timeout: never what ends a wait here
BOUND_S = 30.0
VICTIM = 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("waits")
    out = {"root": str(root), "good": str(root / "good"), "keys": str(root / "keys")}
    base.write(out["good"])
    cases.write_keys_checkpoint(out["keys"])
    return out


def _assert_survivors_raise(outcomes: list, victim: int, phase: str, words: str) -> list[float]:
    seconds = []
    for rank, out in enumerate(outcomes):
        if rank == victim:
            assert isinstance(out, RankDied) and out.exitcode == -9, out
            continue
        err = out["error"]
        assert err is not None, f"rank {rank} did not raise"
        assert err["type"] == "LoadError", f"rank {rank}: {err['message']}"
        assert out["seconds"] < BOUND_S, f"rank {rank} took {out['seconds']:.1f} s"
        assert victim in err["ranks"], f"rank {rank} does not name rank {victim}: {err['message']}"
        assert err["phase"] == phase and words in err["message"], err
        seconds.append(out["seconds"])
    return seconds


def _run(fn, ckpts, *args):
    return run_ranks(fn, WORLD, ckpts, VICTIM, *args, timeout=180, pg_timeout=PG_TIMEOUT, may_die=(VICTIM,))


def test_rank_killed_in_the_digest_exchange(ckpts):
    seconds = _assert_survivors_raise(_run(cases.kill_in_digest, ckpts), VICTIM, "validate", "stopped responding")
    print(f"digest: survivors raised after {max(seconds):.1f} s")


@pytest.mark.parametrize("connecting", [False, True], ids=["entering", "connecting"])
@pytest.mark.parametrize("members_only", [True, False], ids=["members_only", "gathered"])
def test_rank_killed_in_group_creation(ckpts, members_only, connecting):
    outcomes = _run(cases.kill_in_group_creation, ckpts, members_only, connecting)
    seconds = _assert_survivors_raise(outcomes, VICTIM, "execute", "stopped responding")
    print(f"group creation ({'members only' if members_only else 'gathered'}, "
          f"{'connecting' if connecting else 'entering'}): survivors raised after {max(seconds):.1f} s")


def test_rank_killed_while_saving(ckpts):
    seconds = _assert_survivors_raise(_run(cases.kill_in_save, ckpts), VICTIM, "save", "stopped responding")
    print(f"save: survivors raised after {max(seconds):.1f} s")


@pytest.fixture(scope="module")
def shared(ckpts: dict[str, str]) -> list[dict]:
    return run_ranks(cases.shared_cases, WORLD, ckpts, timeout=240, pg_timeout=PG_TIMEOUT)


@pytest.mark.parametrize("n", [8, len(cases.KEY_NAMES)])
def test_derived_load_leaves_no_keys_in_the_store(shared, n):
    for rank, r in enumerate(shared):
        out = r[f"keys_{n}"]
        assert out["error"] is None and out["ok"], (rank, out)
        assert out["left"] == [], (rank, out["left"])  # the digest's per-name counts
        assert len(out["watches"]) == 1 and out["watch_left"] == [], (rank, out)  # the load's watch
    # the per-name counts did happen: each name has one leader among its 2 holders
    assert sum(r[f"keys_{n}"]["counted"] for r in shared) == n


def test_save_arrival_beyond_timeout_is_named(shared):
    outcomes = [r["late_save"] for r in shared]
    for rank, out in enumerate(outcomes):
        err = out["error"]
        assert err is not None and err["type"] == "LoadError", (rank, out)
        assert VICTIM in err["ranks"] and err["phase"] == "save", err
        if rank != VICTIM:
            assert "did not reach dcp-save" in err["message"] and out["seconds"] < 4.5, out
