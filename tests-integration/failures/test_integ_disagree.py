"""Ranks that disagree fail together, and the next load where they agree succeeds.

Real gloo ranks (process-group timeout 10 minutes unless a case says otherwise):

* Load calls pair by their number in each process, every call counted: a call refused on
  its arguments, or made without collectives (``no_dist``, ``use_collectives=False``) on
  some ranks only, makes the ranks that made it collectively raise ``LoadError`` naming
  it at once; the next calls pair as they should (before, rank 0's n-th call ran with
  rank 1's (n+1)-th and each held half of two checkpoints). A save on rank 0 alone does
  not shift the loads; a ``no_dist`` load on every rank leaves no key in the store.
* Two checkpoints with one layout (native with checksums, and Hugging Face files without)
  on different ranks: ``LoadError`` on every rank and every planning path, nothing
  written (before, each rank got half of each), naming the checkpoint each rank opened and
  not the state dicts, which agree.
* ``broadcast_groups=`` on some ranks only: ``LoadError`` naming the setting (before, the
  ranks waited in different collectives without bound).
* After a broadcast fails on one rank, no group leaks, and the next load and save raise at
  once on every rank saying to re-create the process group (before, the next load waited
  in the digest all-reduce for the process-group timeout); once re-created, loads work.
* Without ``timeout=``, the process group's timeout bounds the arrival.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_disagree_cases as cases  # noqa: E402

PG_TIMEOUT = 600.0  # the process-group timeout: never what ends a wait here
FAST_S = 10.0  # a disagreement found at once, not after timeout=30


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("disagree")
    out = cases.write(str(root))
    out["scratch"] = str(root / "scratch")
    return out


def _raised(out: dict, *, words: str = "", rank: int | None = None, fast: bool = True) -> None:
    err = out["error"]
    assert err is not None, f"did not raise: {out}"
    assert err["type"] in ("LoadError", "ValueError"), err["message"]
    assert words in err["message"], err["message"]
    if rank is not None and err["type"] == "LoadError":
        assert rank in err["ranks"], err
    if fast:
        assert out["seconds"] < FAST_S, out


def _ok(out: dict) -> None:
    assert out["error"] is None and out["ok"], out


@pytest.fixture(scope="module")
def pairing(ck: dict[str, str]) -> list[dict]:
    return run_ranks(cases.pairing_cases, 2, ck, timeout=300, pg_timeout=PG_TIMEOUT)


def test_an_argument_error_on_one_rank_keeps_calls_paired(pairing):
    assert pairing[1]["bad_argument"]["error"]["type"] == "ValueError"
    _raised(pairing[0]["bad_argument"], words="timeout must be", rank=1)
    for r in pairing:
        _ok(r["then_a"])
        _ok(r["then_b"])


@pytest.mark.parametrize("case, odd, words", [("no_dist", 1, "no_dist=True"),
                                              ("no_collectives", 0, "use_collectives=False")])
def test_a_call_without_collectives_on_some_ranks(pairing, case, odd, words):
    _ok(pairing[odd][case])  # that rank loads on its own, as asked
    _raised(pairing[1 - odd][case], words=words, rank=odd)
    for r in pairing:
        _ok(r[f"after_{case}"])


def test_a_save_on_one_rank_does_not_shift_loads(pairing):
    for r in pairing:
        _ok(r["after_solo_save"])


def test_no_dist_on_every_rank_leaves_no_keys(pairing):
    for r in pairing:
        _ok(r["all_no_dist"])
        assert r["all_no_dist"]["keys_left"] == [], r["all_no_dist"]
        _ok(r["after_all_no_dist"])


@pytest.fixture(scope="module")
def mixed(ck: dict[str, str]) -> list[dict]:
    return run_ranks(cases.mixed_checkpoint_cases, 2, ck, timeout=300, pg_timeout=PG_TIMEOUT)


@pytest.mark.parametrize("case", ["derived", "derived_no_broadcast", "hf", "gathered"])
def test_different_checkpoints_with_one_layout_fail_everywhere(mixed, ck, case):
    hf = "hf_" if case == "hf" else ""
    for r in mixed:
        out = r[case]
        _raised(out, words="same checkpoint")
        assert out["error"]["phase"] == "validate" and out["untouched"], out
        # Each rank's path is shown, and the state dicts, which are the same, are not blamed.
        message = out["error"]["message"]
        assert "opened different checkpoints" in message, message
        assert f"rank 0 opened {ck[hf + 'a']!r}; rank 1 opened {ck[hf + 'b']!r}" in message, message
        assert "state dict layout" not in message, message
    for r in mixed:
        _ok(r["after"])


def test_broadcast_groups_on_one_rank_fails_everywhere(ck):
    per_rank = run_ranks(cases.groups_cases, 2, ck, timeout=120, pg_timeout=PG_TIMEOUT)
    for r in per_rank:
        _raised(r["groups_on_one_rank"], words="broadcast_groups=given")
        assert r["groups_on_one_rank"]["error"]["phase"] == "validate"
        _ok(r["after"])


def test_after_an_execute_failure_the_next_load_refuses_at_once(ck, tmp_path):
    per_rank = run_ranks(cases.after_execute_failure, 4, ck, str(tmp_path / "store2"), timeout=240,
                         pg_timeout=PG_TIMEOUT)
    for rank, r in enumerate(per_rank):
        _raised(r["failure"], words="injected broadcast failure", rank=1)
        assert r["failure"]["error"]["phase"] == "execute"
        assert r["groups_leaked"] == 0, (rank, r["groups_leaked"])
        for case in ("next", "save"):
            _raised(r[case], words="destroy it and create a new one")
        _ok(r["rebuilt"])


def test_default_timeout_is_the_process_groups(ck):
    per_rank = run_ranks(cases.default_timeout_cases, 2, ck, timeout=120, pg_timeout=2.0)
    err = per_rank[0]["error"]
    assert err is not None and "did not reach dcp-load within 2 s" in err["message"], per_rank[0]
    assert per_rank[0]["seconds"] < 4.5, per_rank[0]
    assert per_rank[1]["error"] is not None, per_rank[1]  # arrived after the others gave up
