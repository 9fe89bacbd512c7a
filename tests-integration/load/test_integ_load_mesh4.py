"""dcp_load.load on 4 real gloo ranks (dp2 x tp2): placements [R,R], [R,S(1)], [S(0),S(1)];
resharding TP4 -> TP2, TP4 -> DP2 x TP2, DP2 x TP2 -> TP2, FSDP + TP -> TP2, uneven
shards; batch thresholds 0 / 4096 / 6 MiB; supplied and built groups; non-tensor state,
scalars and optimizer state; repeated loads without leaks; bad checkpoints (every rank
raises, no target changes); read amplification 1.00; checkpoints written by
torch.distributed.checkpoint load to what its own load gives. All scenarios run in one
launch (integ_load_cases.mesh4_cases); each test asserts on one scenario's results.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_load_cases as cases  # noqa: E402

WORLD = 4


def _grid(parts: int, dim: int):
    def grid(name: str) -> tuple[int, ...]:
        shape = cases.SPECS[name][0]
        return tuple(parts if d == min(dim, len(shape) - 1) else 1 for d in range(len(shape)))
    return grid


def build_checkpoints(root: Path) -> dict[str, str]:
    import dcp_load

    names = cases.NAMES
    out = {k: str(root / k) for k in ("big", "hf", "native_grid", "tp4", "uneven", "values", "missing_key",
                                       "wrong_shape", "missing_file", "truncated", "scratch")}
    cases.write_hf(out["hf"], names)
    cases.write_hf(out["big"], list(cases.BIG))
    cases.write_native(out["native_grid"], names, lambda n: (2, 3, 1)[: len(cases.SPECS[n][0])])
    cases.write_native(out["tp4"], names, _grid(4, 1))
    cases.write_native(out["uneven"], names, _grid(3, 0))
    cases.write_hf(out["missing_key"], [n for n in names if n != "odd.w"])
    from safetensors.torch import save_file
    os.makedirs(out["wrong_shape"])
    bad = {n: cases.full(n) for n in names}
    bad["odd.w"] = bad["odd.w"].reshape(5, 7).contiguous()
    save_file(bad, os.path.join(out["wrong_shape"], "model.safetensors"))
    shutil.copytree(out["native_grid"], out["missing_file"])
    os.remove(os.path.join(out["missing_file"], "data-1.safetensors"))
    shutil.copytree(out["native_grid"], out["truncated"])
    victim = os.path.join(out["truncated"], "data-2.safetensors")
    os.truncate(victim, os.path.getsize(victim) - 40)
    os.makedirs(out["scratch"])
    dcp_load.save({"model": {"w": cases.full("half"), "scalar": cases.full("scalar")},
                   "optim": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.arange(12.0).reshape(4, 3)}},
                             "param_groups": [{"lr": 0.01, "params": [0, 1], "name": "decay"}]},
                   "epoch": 3, "extra": [[1, 2], {"x": "y"}]}, checkpoint_id=out["values"], no_dist=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    ckpts = build_checkpoints(tmp_path_factory.mktemp("mesh4"))
    return run_ranks(cases.mesh4_cases, WORLD, ckpts, timeout=400, pg_timeout=120)


def _case(results: list[dict], name: str) -> list:
    per_rank = [r[name] for r in results]
    errors = [e for r in per_rank for e in r["errors"]]
    assert not errors, "\n".join(errors)
    return [r["out"] for r in per_rank]


def _mesh_bytes() -> int:
    return sum(cases.full(n).numel() * cases.full(n).element_size() for n in cases.MESH_NAMES)


def _read_once(reports: list[dict], unique: int) -> None:
    assert all(r["job_unique_bytes"] == unique for r in reports)
    assert sum(r["bytes_read"] for r in reports) == unique  # read amplification 1.00
    assert all(r["job_bytes_read"] == unique for r in reports)


@pytest.mark.parametrize("placements", ["RR", "RS1", "S0S1"])
@pytest.mark.parametrize("src", ["hf", "native_grid"])
def test_meshes_read_every_byte_once(results, placements, src):
    reports = _case(results, f"mesh_{placements}_{src}")
    _read_once(reports, _mesh_bytes())
    for r in reports:
        assert r["bytes_needed"] == r["bytes_read"] + r["bytes_received"]
        assert set(r["seconds"]) >= {"prepare", "plan", "validate", "execute", "total"}
    if placements == "RR":  # four replicas of everything: each rank reads about a quarter
        assert all(r["broadcasts"] > 0 and r["bytes_received"] > 0 for r in reports)


def test_a_large_replicated_tensor_is_read_in_slabs_by_several_ranks(results):
    reports = _case(results, "big_split")
    _read_once(reports, 8192 * 1024 * 4)
    # 32 MiB in 8 MiB slabs (dcp_load.plan._plan.SPLIT_BYTES): one slab for each of the 4 ranks
    assert sorted(r["bytes_read"] for r in reports) == [8 * 2**20] * 4


@pytest.mark.parametrize("batch", [0, 4096, 6 * 1024 * 1024])
def test_batch_settings(results, batch):
    reports = _case(results, f"batch_{batch}")
    _read_once(reports, _mesh_bytes())
    broadcasts = [r["broadcasts"] for r in reports]
    if batch == 0:
        assert sum(broadcasts) > sum(r["broadcasts"] for r in _case(results, "batch_6291456"))


def test_every_rank_reads_without_broadcast(results):
    reports = _case(results, "every_rank_reads")
    assert all(r["broadcasts"] == 0 and r["bytes_received"] == 0 for r in reports)
    assert all(r["bytes_read"] == r["bytes_needed"] for r in reports)
    assert sum(r["bytes_read"] for r in reports) >= 2 * _mesh_bytes()  # dp2 replicas read twice or more
    reports = _case(results, "no_collectives")
    assert all(r["broadcasts"] == 0 and r["bytes_read"] == r["bytes_needed"] for r in reports)


@pytest.mark.parametrize("case", ["tp4_to_tp2", "tp4_to_dp2tp2", "tp4_to_dp2tp2_rows", "uneven_to_S0S1",
                                  "dp2tp2_to_tp2", "fsdp_tp_to_tp2"])
def test_resharding(results, case):
    reports = _case(results, case)
    assert sum(r["bytes_read"] for r in reports) == reports[0]["job_unique_bytes"]


def test_save_writes_each_replicated_shard_once(results):
    for case in ("dp2tp2_to_tp2", "fsdp_tp_to_tp2"):
        saved = [r["saved"] for r in _case(results, case)]
        assert sum(s["bytes_written"] for s in saved) == saved[0]["job_bytes"]
        assert max(s["bytes_written"] for s in saved) < saved[0]["job_bytes"]  # spread over writers


def test_supplied_and_reused_groups(results):
    outs = _case(results, "supplied_groups")
    for o in outs:
        assert o["groups_after"] == o["groups_before"]  # built groups destroyed, supplied kept
        assert all(r["broadcasts"] > 0 for r in o["reports"])


def test_values_scalars_and_optimizer_state(results):
    reports = _case(results, "values_and_optimizer")
    assert all(r["values"] == 6 for r in reports)


def test_repeated_loads_leak_nothing(results):
    for o in _case(results, "repeated"):
        assert o["after"] == o["before"], o


@pytest.mark.parametrize("key,cause", [
    ("missing_key", "'odd.w'"), ("wrong_shape", "shape mismatch"),
    ("missing_file", "data-1.safetensors"), ("truncated", "data-2.safetensors"),
])
def test_bad_checkpoints_fail_everywhere_and_change_nothing(results, key, cause):
    outs = _case(results, f"bad_{key}")
    assert len({o["message"] for o in outs}) == 1  # the same error on every rank
    assert cause in outs[0]["message"]
    assert outs[0]["phase"] == "validate"


def test_strict_false_loads_the_rest(results):
    reports = _case(results, "strict_false")
    assert all(r["missing"] == ["not.saved"] or r["missing"] == ("not.saved",) for r in reports)


@pytest.mark.parametrize("kind", ["default", "hf"])
def test_torch_dcp_checkpoints_match_torch_load(results, kind):
    outs = _case(results, f"torch_dcp_{kind}")
    for layout in ("RS1", "S1S0"):
        assert {o[layout]["format"] for o in outs} == {"torch-dcp" if kind == "default" else "torch-dcp-hf"}


def test_failure_on_one_rank_raises_everywhere(results):
    outs = _case(results, "one_rank_bad")
    assert all(o["failures"] == [2] for o in outs)
    assert "only.on.rank2" in outs[0]["message"]


def test_different_broadcast_settings_fail_instead_of_hanging(results):
    outs = _case(results, "settings_differ")
    assert all("broadcast_batch_bytes=4096" in o["message"] and "same broadcast settings" in o["message"]
               for o in outs)


def test_read_failure_mid_run_raises_everywhere_without_hanging(results):
    outs = _case(results, "midrun_failure")
    for o in outs:
        assert o["phase"] == "execute" and o["failures"] == [1], o
        assert "injected read failure" in o["message"]
        assert o["threads_leaked"] == 0


def test_auto_rereads_on_one_host_and_broadcasts_across_hosts(results):
    unique = _mesh_bytes()
    # One host: the four replicas share a page cache, so each reads for itself.
    reports = _case(results, "auto_one_host_auto")
    assert all(r["broadcasts"] == 0 and r["bytes_received"] == 0 for r in reports)
    assert all(r["bytes_read"] == r["bytes_needed"] == unique for r in reports)
    # An explicit True still reads once and broadcasts, whatever the hosts.
    _read_once(_case(results, "auto_one_host_True"), unique)
    _read_once(_case(results, "auto_two_nodes_True"), unique)
    # Two nodes of two ranks: every [R, R] box spans both nodes. One node fetches it from
    # storage (both of its ranks read it, the second from the page cache the first filled)
    # and broadcasts it to the other node's two ranks.
    reports = _case(results, "auto_two_nodes_auto")
    assert all(r["job_unique_bytes"] == unique for r in reports)
    assert sum(r["bytes_read"] for r in reports) == 2 * unique
    assert sum(r["bytes_received"] for r in reports) == 2 * unique
    assert all(r["broadcasts"] > 0 and r["bytes_needed"] == r["bytes_read"] + r["bytes_received"]
               for r in reports)
