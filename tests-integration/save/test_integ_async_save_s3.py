"""``async_save`` into object storage, against a real S3 server on loopback (moto, as in
test_integ_s3.py): on 4 gloo ranks (DP2 x TP2), every tensor changed right after the call,
the prefix holds the values at the call, save after save; in one process, a multipart data
file and a failed upload that keeps the committed checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

import torch  # noqa: E402
from dcp_platform.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_async_save_cases as cases  # noqa: E402
import s3_server  # noqa: E402

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def endpoint():
    server, url = s3_server.start_moto()
    try:
        s3_server.make_bucket(url, BUCKET)
        with s3_server.env(s3_server.s3_env(url)):
            yield url
    finally:
        server.stop()


def test_async_saves_into_s3_on_4_ranks_hold_the_values_at_each_call(endpoint):
    outs = run_ranks(cases.s3_snapshot, 4, f"s3://{BUCKET}/async/dp2tp2", env=s3_server.s3_env(endpoint),
                     timeout=400, pg_timeout=300)
    for out in outs:
        assert out == {"holds_1": True, "staged_1": True, "holds_2": True, "staged_2": True, "threads": []}, out


def test_one_process_async_save_into_s3_multipart_then_a_failed_upload(endpoint, monkeypatch):
    import dcp_load
    from dcp_reader import NativeWriter

    uri = f"s3://{BUCKET}/async/one"
    big = torch.randn(4096, 1024)  # 16 MiB: a multipart upload
    src = {"big": big.clone(), "step": 1}
    fut = dcp_load.async_save(src, checkpoint_id=uri, no_dist=True)
    src["big"].neg_()
    fut.result(timeout=120)
    dst = {"big": torch.full_like(big, float("nan")), "step": None}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert torch.equal(dst["big"], big) and dst["step"] == 1

    def refused(self, name, tensors):
        raise OSError("upload refused")

    monkeypatch.setattr(NativeWriter, "write_file", refused)
    with pytest.raises(dcp_load.LoadError, match="upload refused"):
        dcp_load.async_save({"big": torch.zeros(4096, 1024), "step": 2}, checkpoint_id=uri,
                            no_dist=True).result(timeout=120)
    monkeypatch.undo()
    dst = {"big": torch.full_like(big, float("nan")), "step": None}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert torch.equal(dst["big"], big) and dst["step"] == 1
