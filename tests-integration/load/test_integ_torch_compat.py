"""``dcp_load.torch_compat`` on 2 real gloo ranks (integ_torch_compat_cases): a non-tensor
value that only rank 1 holds (torchtitan's dataloader keeps its state under a key of each
data-parallel rank's own) is saved by ``save`` and ``async_save`` as torch DCP saves it,
and each rank loads its own back, as with torch DCP."""

from __future__ import annotations

import os
import pickle
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import integ_torch_compat_cases as cases  # noqa: E402


def test_values_of_other_ranks_are_saved_as_torch_dcp_saves_them(tmp_path):
    per_rank = run_ranks(cases.per_rank_values, 2, str(tmp_path), timeout=300, pg_timeout=240)
    for rank, r in enumerate(per_rank):
        want = cases._plain(cases._state(rank, 2))
        assert r["torch"] == want, r
        assert r["dcp"] == r["dcp-async"] == r["torch"], r
        assert pickle.loads(r["dcp"]["loader"][f"dp_rank_{rank}"]) == {"seen": 10 + rank}
