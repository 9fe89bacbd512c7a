"""``dcp_load.torch_compat`` on 2 real gloo ranks (integ_compat_order_cases): Statefuls whose
``state_dict``/``load_state_dict`` run a collective are called in sorted key order on every
rank although each rank's dict holds them in another order (torch DCP's
``test_different_ordered_state_dict_keys``); a per-rank value that one rank cannot pickle
(a raising ``__reduce__`` or ``__getstate__``) is a LoadError on every rank within seconds,
not a lone TypeError while the other ranks wait for the process group's timeout."""

from __future__ import annotations

import os
import sys

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import integ_compat_order_cases as cases  # noqa: E402

#: the process group's timeout: a rank left waiting in a collective fails after this
PG_TIMEOUT = 45


def test_statefuls_are_called_in_sorted_order_whatever_each_ranks_dict_order(tmp_path):
    per_rank = run_ranks(cases.different_orders, 2, str(tmp_path), timeout=120, pg_timeout=PG_TIMEOUT)
    for r in per_rank:
        assert r["mismatched"] == [], r
        names = ["model", "optim", "sched"]
        assert r["calls"] == [("state_dict", n) for n in names] * 2 + [("load_state_dict", n) for n in names]
        assert r["values"] == {n: [1.0] * 4 for n in names}


@pytest.mark.parametrize(("how", "mode"), [("reduce", "sync"), ("getstate", "sync"), ("reduce", "async")])
def test_a_value_one_rank_cannot_pickle_fails_every_rank_at_once(tmp_path, how, mode):
    per_rank = run_ranks(cases.unpicklable_value, 2, str(tmp_path), how, mode, timeout=150,
                         pg_timeout=PG_TIMEOUT)
    cause = "this object refuses pickling" if how == "reduce" else "this object's state cannot be read"
    for r in per_rank:
        assert r["raised"] == "LoadError" and r["load_error"], r
        assert "'loader.dp_rank_1'" in r["message"] and "rank 1 cannot serialise it" in r["message"], r
        assert cause in r["message"], r
        assert r["seconds"] < PG_TIMEOUT / 3, r
