"""``dcp plan`` predicts what ``load`` does, in every ``broadcast_replicated_tensors`` mode.

One checkpoint (a small Llama-like model, one Hugging Face file), on local files and on a
real S3 server on loopback (moto, as test_integ_s3.py starts it), loaded by 4 real gloo
ranks as DP2 x TP2 DTensors into poisoned targets in the modes "auto", True and False.
``dcp plan --checkpoint ... --mesh tp=2,dp=2 --ranks-per-host 4 --broadcast MODE --json``
(all 4 ranks run on this one host) must print the bytes read per rank (max, mean, total)
and the broadcasts per rank that the ranks' reports give, and the simulation behind it
the bytes and broadcasts of every rank. Before, the plan always assumed "auto" on files:
for the load from ``s3://`` it predicted every rank reading all it holds and no broadcast,
while "auto" broadcasts there.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_plan_cases as cases  # noqa: E402

BUCKET = "plan"


def _plan(path: str, mode: str) -> dict:
    from dcp_load.cli._main import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["plan", "--checkpoint", path, "--mesh", "tp=2,dp=2", "--ranks-per-host", "4",
                     "--broadcast", mode, "--repeats", "1", "--json"])
    assert code == 0, buf.getvalue()
    return json.loads(buf.getvalue())


def _simulated(path: str, mode: str, object_store: bool) -> dict:
    from dcp_load.plan._simulate import Layout, load_mode, simulate
    from dcp_reader import open_checkpoint

    with open_checkpoint(path) as reader:
        tensors = dict(reader.metadata.tensors)
    broadcast, same_host = load_mode(cases.MODES[mode], object_store=object_store)
    return simulate(tensors, Layout(2, 1, 2, ranks_per_host=4, broadcast=broadcast, same_host_reads=same_host,
                                    relay=object_store),
                    time_roles=False)


def _compare(per_rank: list[dict], where: str, path: str, object_store: bool) -> None:
    for mode in cases.MODES:
        rows = [r[f"{where}/{mode}"] for r in per_rank]
        assert all(not row["bad"] for row in rows), (where, mode, rows)
        read, bcasts = [row["read"] for row in rows], [row["broadcasts"] for row in rows]
        plan = _plan(path, mode)
        seen = {k: plan[k] for k in ("read_bytes_per_rank_max", "read_bytes_total", "broadcasts_per_rank_max")}
        assert seen == {"read_bytes_per_rank_max": max(read), "read_bytes_total": sum(read),
                        "broadcasts_per_rank_max": max(bcasts)}, (where, mode, plan, read, bcasts)
        assert plan["read_bytes_per_rank_mean"] == sum(read) / len(read)
        sim = _simulated(path, mode, object_store)
        assert (sim["read_bytes_per_rank"], sim["broadcasts_per_rank"]) == (read, bcasts), (where, mode)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    """(per-rank results, {where: path}, the S3 environment): every mode loaded from files and S3."""
    pytest.importorskip("moto.server", reason="the S3 case needs moto[server] (nox installs it)")
    pytest.importorskip("obstore", reason="the S3 case needs obstore (nox installs it)")
    import s3_server

    local = cases.write_hf(str(tmp_path_factory.mktemp("plan") / "hf"))
    server, endpoint = s3_server.start_moto()
    try:
        s3_server.make_bucket(endpoint, BUCKET)
        env = s3_server.s3_env(endpoint)
        with s3_server.env(env):
            from dcp_reader.storage import ObjectStorage

            uri = f"s3://{BUCKET}/hf"
            ObjectStorage(uri).put("model.safetensors", [(Path(local) / "model.safetensors").read_bytes()])
            paths = {"files": local, "s3": uri}
            per_rank = run_ranks(cases.load_modes, 4, paths, env=env, timeout=400, pg_timeout=300)
            yield per_rank, paths
    finally:
        server.stop()


def test_plan_predicts_a_load_from_files_in_every_mode(loaded) -> None:
    per_rank, paths = loaded
    _compare(per_rank, "files", paths["files"], object_store=False)
    auto = [r["files/auto"] for r in per_rank]
    assert all(row["broadcasts"] == 0 for row in auto)  # one host: each rank re-reads the page cache


def test_plan_predicts_a_load_from_s3_in_every_mode(loaded) -> None:
    per_rank, paths = loaded
    _compare(per_rank, "s3", paths["s3"], object_store=True)
    auto, true = ([r[f"s3/{m}"] for r in per_rank] for m in ("auto", "true"))
    assert auto == true and max(row["broadcasts"] for row in auto) > 0  # "auto" broadcasts on object storage
