"""Checkpoints in object storage, against a real S3 server on loopback (moto's
ThreadedMotoServer, started here) behind a counting proxy: every format (native, Hugging
Face, torch DCP, hyper-parallel) loaded from ``s3://`` on one process and on 4 gloo ranks
(DP2 x TP2) into poisoned targets, exact values; save -> load round trips on one process and
on 4 ranks; ``dcp inspect``, ``dcp verify`` and ``dcp plan --checkpoint`` on ``s3://``; and of
4 ranks only one lists the bucket."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

import torch  # noqa: E402
from dcp_platform.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "packages" / "dcp-reader" / "tests"))
import integ_s3_cases as cases  # noqa: E402
import s3_server  # noqa: E402

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """(proxy, {format: s3:// uri}): the server, a proxy in front, every format uploaded."""
    with s3_server.bucket_behind_proxy(BUCKET) as proxy:
        local = cases.build_local(str(tmp_path_factory.mktemp("s3src")))
        uris = {f: f"s3://{BUCKET}/formats/{f}" for f in cases.FORMATS}
        for f, d in local.items():
            cases.upload(d, uris[f])
        yield proxy, uris


@pytest.mark.parametrize("fmt", cases.FORMATS)
def test_every_format_loads_from_s3_on_one_process(s3, fmt):
    import dcp_load

    proxy, uris = s3
    names = cases.HF_NAMES if fmt == "hf" else cases.MESH_NAMES
    state = cases.plain_state(names)
    report = dcp_load.load(state, checkpoint_id=uris[fmt], no_dist=True)
    assert report.format.startswith(fmt.split("-")[0]) or report.format == fmt
    for n in names:
        assert torch.equal(state[n].reshape(-1).view(torch.uint8), cases.full(n).reshape(-1).view(torch.uint8)), n


def test_every_format_loads_from_s3_on_4_ranks_and_a_4_rank_save_round_trips(s3):
    proxy, uris = s3
    lists_before = _lists(proxy)
    per_rank = run_ranks(cases.s3_mesh_cases, 4, uris, f"s3://{BUCKET}/saved/dp2tp2", s3_server.BAD_KEY,
                         env=s3_server.s3_env(proxy.endpoint), timeout=400, pg_timeout=300)
    problems = {f"rank {r} {case}": res["errors"] for r, out in enumerate(per_rank)
                for case, res in out.items() if res["errors"]}
    assert not problems, problems
    assert set(per_rank[0]) == {f"{f}_{p}" for f in cases.FORMATS for p in ("RS0", "S0S1")} | {
        "save_then_load", "one_rank_refused"}
    # 9 loads, rank 0 listing at most twice for each (the top level to find the format, then
    # the whole prefix to check the files exist), and one save by rank 0 (a check that the
    # prefix holds no other format's checkpoint, its commit's check of the files, the
    # removal of leftovers after it): every rank listing would make 4 x that
    assert _lists(proxy) - lists_before <= 2 * 9 + 3


def _lists(proxy: s3_server.FaultProxy) -> int:
    return proxy.faults.lists


def test_save_then_load_on_one_process_multipart_and_metadata_last(s3):
    import dcp_load
    from dcp_reader.storage import ObjectStorage

    proxy, _ = s3
    uri = f"s3://{BUCKET}/saved/one"
    big = torch.randn(4096, 1024)  # 16 MiB: a multipart upload in 8 MiB parts
    src = {"big": big, "small": torch.arange(7), "nested": {"w": torch.ones(3, 3, dtype=torch.bfloat16)},
           "step": 12}
    dcp_load.save(src, checkpoint_id=uri, no_dist=True)
    listed = ObjectStorage(uri).list()
    assert "dcp-metadata.json" in listed and any(n.endswith(".safetensors") for n in listed)
    dst = {"big": torch.full_like(big, float("nan")), "small": torch.full((7,), -1),
           "nested": {"w": torch.zeros(3, 3, dtype=torch.bfloat16)}, "step": 0}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert torch.equal(dst["big"], big) and torch.equal(dst["small"], src["small"])
    assert torch.equal(dst["nested"]["w"], src["nested"]["w"]) and dst["step"] == 12


def test_cli_inspect_verify_and_plan_on_s3(s3):
    from dcp_load.cli._main import main

    _, uris = s3
    for fmt in ("native", "hf"):
        out = io.StringIO()
        assert _run(main, ["inspect", uris[fmt]], out) == 0, out.getvalue()
        assert uris[fmt] in out.getvalue() and "tensors" in out.getvalue()
        out = io.StringIO()
        assert _run(main, ["verify", uris[fmt]], out) == 0, out.getvalue()
        assert "ok" in out.getvalue().lower()
    out = io.StringIO()
    assert _run(main, ["plan", "--checkpoint", uris["hf"], "--mesh", "tp=2,dp=2"], out) == 0, \
        out.getvalue()


def _run(main, argv: list[str], out: io.StringIO) -> int:
    import contextlib

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return main(argv)
        except SystemExit as e:
            return int(e.code or 0)


def test_a_corrupt_block_in_s3_is_a_checksum_error(s3):
    """Block checksums are verified as for files: one flipped byte is ChecksumError."""
    import dcp_load
    from dcp_reader import ChecksumError
    from dcp_reader.storage import ObjectStorage

    uri = f"s3://{BUCKET}/saved/corrupt"
    dcp_load.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=uri, no_dist=True)
    store = ObjectStorage(uri)
    [data_file] = [n for n in store.list() if n.endswith(".safetensors")]
    f = store.open(data_file)
    raw = bytearray(f.size)
    f.read_into(raw, 0, key=None)
    raw[-5] ^= 0xFF
    store.put(data_file, [bytes(raw)])
    dst = {"w": torch.full((4096,), float("nan"))}
    with pytest.raises(dcp_load.LoadError) as e:
        dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert "ChecksumError" in str(e.value) and data_file in str(e.value)
    with pytest.raises(ChecksumError):
        from dcp_reader import open_checkpoint

        with open_checkpoint(uri) as r:
            c = r.metadata.tensors["w"].chunks[0]
            r.read("w", c, (0,), (4096,))
