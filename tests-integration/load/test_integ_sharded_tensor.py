"""torch ShardedTensors (FSDP1's ``SHARDED_STATE_DICT``) on 2 real gloo ranks
(integ_sharded_tensor_cases): saved by torch DCP and by dcp (native format, torch DCP's
format, torch_compat), loaded by dcp and by torch DCP into NaN-poisoned ShardedTensors
(ChunkShardingSpec over dim 0 or dim 1, uneven, one or two local shards per rank), DTensors
and plain tensors: resharded wherever the layouts differ; 2-rank saves loaded on one rank
with ``no_dist=True``."""

from __future__ import annotations

import os
import sys

from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import integ_sharded_tensor_cases as cases  # noqa: E402


def _failed(per_rank: list[dict[str, str]]) -> dict[str, str]:
    return {f"rank {r}: {name}": got for r, out in enumerate(per_rank) for name, got in out.items() if got != "ok"}


def test_torch_saved_sharded_tensors_load_into_every_layout(tmp_path):
    per_rank = run_ranks(cases.torch_saved, 2, str(tmp_path), timeout=300, pg_timeout=120)
    assert len(per_rank[0]) == len(cases.LAYOUTS) * (len(cases.LAYOUTS) + 4), per_rank[0]
    assert not _failed(per_rank), _failed(per_rank)


def test_dcp_saved_sharded_tensors_load_with_torch_and_dcp(tmp_path):
    per_rank = run_ranks(cases.dcp_saved, 2, str(tmp_path), timeout=300, pg_timeout=120)
    assert any(" -> torch st-dim1x2" in name for name in per_rank[0]), per_rank[0]
    assert not _failed(per_rank), _failed(per_rank)


def test_dtensor_and_plain_saves_load_into_sharded_tensors(tmp_path):
    per_rank = run_ranks(cases.others_saved, 2, str(tmp_path), timeout=300, pg_timeout=120)
    assert len(per_rank[0]) == 4 * len(cases.LAYOUTS), per_rank[0]
    assert not _failed(per_rank), _failed(per_rank)


def test_two_rank_saves_load_on_one_rank_without_a_group(tmp_path):
    run_ranks(cases.saved_for_one, 2, str(tmp_path), timeout=300, pg_timeout=120)
    (out,) = run_ranks(cases.load_alone, 1, str(tmp_path), timeout=300, pg_timeout=120)
    assert len(out) == 3 * (len(cases.LAYOUTS) + 2), out
    assert all(got == "ok" for got in out.values()), {k: v for k, v in out.items() if v != "ok"}


def test_empty_local_shards_past_the_end_save_and_load(tmp_path):
    per_rank = run_ranks(cases.empty_shards, 2, str(tmp_path), timeout=300, pg_timeout=120)
    assert len(per_rank[0]) == 2 * (len(cases.LAYOUTS) + 3) + 1, per_rank[0]
    assert not _failed(per_rank), _failed(per_rank)
