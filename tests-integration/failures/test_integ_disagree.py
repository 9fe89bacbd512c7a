"""Ranks that disagree fail together, and the next load where they agree succeeds.

Real gloo ranks (process-group timeout 10 minutes unless a case says otherwise):

* Collective load calls pair by their number in each process: a call refused on its
  arguments on one rank makes the others raise ``LoadError`` naming it at once, and the
  next calls pair as they should (before, rank 0's n-th call ran with rank 1's (n+1)-th and
  each held half of two checkpoints). Calls without collectives (``no_dist``,
  ``read_state_dict``, a save on rank 0 alone) take no part: the next collective calls
  pair. Where one rank calls without collectives while the other calls with them, the
  other waits out ``timeout`` and names what it called instead; a rank that comes late
  fails alone, at once, naming the call the others moved on to; the calls after both pair.
  A ``no_dist`` load on every rank leaves no key in the store.
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


def test_calls_without_collectives_on_one_rank_take_no_part(pairing):
    _ok(pairing[0]["alone"])
    assert pairing[0]["alone_read"] is True
    for r in pairing:
        _ok(r["after_alone_a"])
        _ok(r["after_alone_b"])


def test_a_call_without_collectives_where_the_other_calls_with_them(pairing):
    _ok(pairing[1]["no_collectives"])  # that rank loads on its own, as asked
    waited = pairing[0]["no_collectives"]
    _raised(waited, words="did not reach dcp-load", rank=1, fast=False)
    assert cases.SHORT_S <= waited["seconds"] < cases.SHORT_S + FAST_S, waited
    assert "its latest call: load of" in waited["error"]["message"], waited  # what rank 1 called instead
    assert "use_collectives=False" in waited["error"]["message"], waited
    for r in pairing:
        _ok(r["after_no_collectives"])


def test_a_foreign_value_naming_the_missing_ranks_is_a_load_error(pairing):
    late = pairing[1]["late_foreign"]
    _raised(late, rank=1)
    assert late["error"]["type"] == "LoadError", late
    assert "dcp-load/" in late["error"]["message"] and "/missing'" in late["error"]["message"], late
    assert "a pickle, not read" in late["error"]["message"], late
    for r in pairing:
        _ok(r["after_late_foreign"])


def test_a_late_rank_fails_alone_and_its_next_call_pairs(pairing):
    _raised(pairing[0]["late"], words="did not reach dcp-load", rank=1, fast=False)
    late = pairing[1]["late"]
    _raised(late, words="came after the other ranks gave up on it", rank=1)  # at once, not after a timeout
    assert "rank 0 is in: load call" in late["error"]["message"], late  # the call they moved on to
    for r in pairing:
        _ok(r["after_late"])


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
