"""Weight sync between two separately launched jobs (integ_sync_cases): 2 "trainer" ranks
and 2 "engine" ranks, each job with its own default gloo group (``run_ranks`` with its own
init file), joined by ``dcp_load.transfer_group`` through a TCPStore on 127.0.0.1; values
exact, nothing on either default group during the transfers, each default group usable
after; jobs that disagree or an engine rank that dies are named on every rank in time."""

from __future__ import annotations

import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))
sys.path.insert(0, str(Path(__file__).parent))
import integ_sync_cases as cases  # noqa: E402

SIZES = (2, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(fn: Any, *args: Any, sizes: tuple[int, int] = SIZES, timeout: float = 240,
             may_die: tuple[int, ...] = (), trainer_may_die: tuple[int, ...] = ()) -> tuple[list[Any], list[Any]]:
    """``fn`` on a trainer job and an engine job launched apart (each its own default group)."""
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_ranks, fn, n, side, port, sizes, *args, timeout=timeout, pg_timeout=timeout,
                            may_die=may_die if side == "engine" else trainer_may_die)
                for side, n in zip(("trainer", "engine"), sizes, strict=True)]
        return jobs[0].result(), jobs[1].result()


def test_two_jobs_transfer_within_their_own_group():
    trainer, engine = run_jobs(cases.two_jobs)
    for side, per_rank in (("trainer", trainer), ("engine", engine)):
        for rank, r in enumerate(per_rank):
            me = rank if side == "trainer" else 2 + rank
            assert r["group"] == (me, 4, rank, SIZES), r
            assert r["bad0"] == r["bad1"] == [] and r["default_ok"], (side, rank, r)
            assert not r["report0"]["reused"] and r["report1"]["reused"], r
            assert (r["report0"]["rank"], r["report0"]["world"]) == (me, 4), r
    sent = sum(r["report0"]["sent"] for r in trainer)
    assert sent and sum(r["report0"]["sent"] for r in engine) == 0
    # every byte an engine keeps arrived from the trainer (the norm in bf16: half its fp32 bytes)
    for r in engine:
        assert r["report0"]["received"] == r["report0"]["kept"] - cases.SHAPES["norm"][0] * 2, r


def test_jobs_that_disagree_on_world_sizes_fail_on_every_rank():
    trainer, engine = run_jobs(cases.disagree)
    for side, per_rank in (("trainer", trainer), ("engine", engine)):
        for rank, r in enumerate(per_rank):
            message = r["message"]
            assert message and f"({side} rank {rank}): the jobs disagree" in message, r
            if side == "trainer":
                assert "engine rank 0 says world_sizes=[2, 3]" in message, r
                assert f"trainer rank {rank} (this rank) has world_sizes=[2, 2]" in message, r
            else:
                assert "trainer rank 0 says world_sizes=[2, 2]" in message, r
                assert f"engine rank {rank} (this rank) has world_sizes=[2, 3]" in message, r
            assert r["seconds"] < 20 and r["default_ok"], r


def test_an_engine_rank_that_dies_is_named_in_time():
    trainer, engine = run_jobs(cases.engine_dies, may_die=(1,))
    for r in [*trainer, engine[0]]:
        assert r["message"] and "rank 3" in r["message"] and r["untouched"], r
        assert "ranks 2-3 the engine's ranks 0-1" in r["message"], r
        assert r["seconds"] < 30, r


def test_engine_plain_tp_shards_fused_from_fsdp_shards():
    trainer, engine = run_jobs(cases.engine_tp)
    for rank, r in enumerate(engine):
        assert r["bad0"] == r["bad1"] == [], (rank, r)
        assert not r["report0"]["reused"] and r["report1"]["reused"], r
        assert r["report0"]["received"] == r["report0"]["kept"], r  # every byte from the trainer, once
        assert dict(r["report0"]["composed"]) == {"qkv": 3, "gate_up": 2}, r
    for side, per_rank in (("trainer", trainer), ("engine", engine)):
        for r in per_rank:
            # the trainer's changed shape is named on every rank of both jobs, before any write
            message = r["error2"]
            assert message.startswith("validate failed on 2 rank(s) (ranks 2-3)"), (side, r)
            assert "ranks 2-3: dst 'down' has shape (8, 16) but its source 'down' gives (8, 12)" in message, r
            assert "ranks 0-1 are the trainer's ranks 0-1, ranks 2-3 the engine's ranks 0-1." in message, r
    assert all(r["untouched"] for r in engine)


def test_fp8_blockwise_destinations_quantized_on_the_trainer():
    trainer, engine = run_jobs(cases.fp8_blockwise)
    for rank, r in enumerate(engine):
        assert r["bad0"] == r["bad1"] == [], (rank, r)
        assert not r["report0"]["reused"] and r["report1"]["reused"], r
        norm = cases.FP8_SHAPES["norm"][0]
        # FP8 bytes and fp32 scales travel as kept; the fp32 norm arrives as bf16
        assert r["report0"]["received"] == r["report0"]["kept"] - norm * 2, r
    assert sum(r["report0"]["sent"] for r in trainer) > 0


def test_delta_sends_only_what_changed():
    trainer, engine = run_jobs(cases.delta_updates)
    half = {n: cases.SHAPES[n][0] * cases.SHAPES[n][1] * 4 // 2 for n in ("wq", "wk", "wv", "wo")}  # per engine rank
    every = ["wk", "wo", "wq", "wv"]
    for rank, r in enumerate(engine):
        assert r["first"]["received"] == sum(half[n] for n in every) and r["first"]["exact"] == every, r
        # wo changed: only its bytes travel; the poisoned others were not written
        one = r["one_changed"]
        assert one["received"] == half["wo"] and one["reused"] and one["exact"] == ["wo"], r
        assert one["poisoned"] == ["wk", "wq", "wv"], r
        # nothing changed: nothing travels, every destination keeps what it had (poisoned here)
        assert r["none_changed"]["received"] == 0 and r["none_changed"]["broadcasts"] == 0, r
        assert r["none_changed"]["poisoned"] == every, r
        # wq[8, 0] changed (trainer rank 1's rows 8-15): the piece of engine rank 0's columns alone,
        # as its bitmask (32 elements: 8 bytes, padded) and the one fp32 value
        assert r["one_element"]["received"] == (8 + 4 if rank == 0 else 0), r
        assert r["one_element"]["exact"] == every, r
    assert sum(r["none_changed"]["sent"] for r in trainer) == 0


def test_an_engine_rank_that_dies_while_data_moves_is_named_in_time():
    trainer, engine = run_jobs(cases.engine_dies_mid_transfer, may_die=(1,))
    for r in [*trainer, engine[0]]:
        assert r["message"] and "execute" in r["message"] and "rank 3" in r["message"], r
        assert r["seconds"] < 30, r


def test_delta_sends_changed_elements_as_bitmask_and_values():
    trainer, engine = run_jobs(cases.delta_sparse)
    for rank, r in enumerate(engine):
        assert not r["first"]["reused"] and r["first"]["received"] == r["first"]["kept"], r
        assert r["first"]["exact"] == ["a", "b", "c"], r
        # 2 % of "a" and "b" changed: bitmask + values, at most 0.1 x what the engine keeps
        sparse = r["sparse"]
        want = sum(cases.sparse_bytes(n, 1, 0.02, rank) for n in ("a", "b"))
        assert sparse["reused"] and sparse["received"] == want, (want, r)
        assert sparse["received"] <= 0.1 * sparse["kept"], r
        assert sparse["exact"] == ["b"] and sparse["poisoned"] == ["c"], r
        # the unchanged element set to 1000 was not written; every other element of "a" is exact
        assert r["sentinel"] == 1000 and r["a_else_exact"], r
        # 95 % of "b" changed: bitmask + values would be larger than the pieces, so "b" goes whole
        dense = r["dense"]
        b_whole = 128 * 64 * 2 // 2
        assert dense["received"] == b_whole + cases.sparse_bytes("a", 2, 0.02, rank), r
        assert dense["exact"] == ["a", "b", "c"], r
        # new destination tensors (poisoned), nothing changed: every piece travels whole
        new = r["new_destinations"]
        assert new["reused"] and new["received"] == new["kept"] and new["exact"] == ["a", "b", "c"], r
    assert sum(r["sparse"]["sent"] for r in trainer) == sum(r["sparse"]["received"] for r in engine)


def test_delta_into_fp8_destinations_sends_changed_pieces_whole():
    trainer, engine = run_jobs(cases.fp8_delta)
    for rank, r in enumerate(engine):
        assert r["step0"]["exact"] and r["step1"]["exact"] and r["step1"]["reused"], r
        # engine rank 0's FP8 piece of trainer rank 0's rows (128 x 256) whole; its scales did not change
        assert r["step1"]["received"] == (128 * 256 if rank == 0 else 0), r


def test_delta_bitmask_on_ranks_that_send_and_receive():
    for r in run_ranks(cases.delta_colocated, 2, timeout=120):
        half = 64 * 64 * 2
        assert r["step0"]["exact"] and r["step0"]["received"] == half and r["step0"]["copied"] == half, r
        assert r["step1"]["exact"] and 0 < r["step1"]["received"] <= 0.1 * half and r["step1"]["copied"] == half, r


def test_a_trainer_rank_that_dies_while_data_moves_releases_the_engine_within_the_timeout():
    # the groups the failed call made are bounded by its timeout (5 s): releasing the call
    # does not wait for a broadcast of the dead rank's group for the platform's 10 minutes
    trainer, engine = run_jobs(cases.trainer_dies_mid_transfer, timeout=150, trainer_may_die=(1,))
    for r in [trainer[0], *engine]:
        assert r["message"] and "rank 1" in r["message"], r
        assert r["raised"] < 30 and r["released"] < 30, r


def test_close_after_delta_transfers_releases_the_groups_sockets():
    trainer, engine = run_jobs(cases.delta_close_cycles)
    for r in [*trainer, *engine]:
        first, *later = r["sockets"]
        assert all(n <= first for n in later), r
