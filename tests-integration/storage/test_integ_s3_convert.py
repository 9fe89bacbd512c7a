"""``convert`` and ``dcp convert`` from ``s3://`` against a real S3 server on loopback
(moto's ThreadedMotoServer, started here): a native and a Hugging Face checkpoint in a
bucket converted into both output formats, values exact, with one and two workers; an
``s3://`` destination refused before anything is read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_s3_cases as cases  # noqa: E402
import s3_server  # noqa: E402

BUCKET = "convert"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"layers.0.w": torch.randn(64, 32, generator=g), "layers.1.w": torch.randn(32, 64, generator=g).half(),
            "ids": torch.arange(50, dtype=torch.int64), "mask": torch.arange(7) % 3 == 0}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """{format: s3:// uri} of one checkpoint uploaded in each format, the server's env set."""
    import dcp_load
    from safetensors.torch import save_file

    server, endpoint = s3_server.start_moto()
    try:
        s3_server.make_bucket(endpoint, BUCKET)
        with s3_server.env(s3_server.s3_env(endpoint)):
            root = tmp_path_factory.mktemp("s3convert")
            dcp_load.save({**_tensors(), "step": 4}, checkpoint_id=str(root / "native"), no_dist=True)
            (root / "hf").mkdir()
            save_file(_tensors(), str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
            uris = {f: f"s3://{BUCKET}/{f}" for f in ("native", "hf")}
            for f, uri in uris.items():
                cases.upload(str(root / f), uri)
            yield uris
    finally:
        server.stop()


@pytest.mark.parametrize("fmt", ["native", "hf"])
@pytest.mark.parametrize("to", ["hf", "native"])
def test_convert_from_s3(s3, tmp_path, fmt, to):
    import dcp_load

    report = dcp_load.convert(s3[fmt], tmp_path / "out", to=to, max_shard_bytes="8KB",
                              workers=2 if (fmt, to) == ("native", "hf") else 1)
    assert report.src == s3[fmt] and len(report.files) > 1
    got = dcp_load.read_state_dict(tmp_path / "out")
    want = _tensors()
    if to == "native" and fmt == "native":
        want["step"] = 4
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_dcp_convert_from_s3_and_into_s3(s3, tmp_path, capsys):
    import dcp_load
    from dcp_load.cli._main import main

    assert main(["convert", s3["hf"], str(tmp_path / "out"), "--to", "native", "--quiet"]) == 0
    assert torch.equal(dcp_load.read_state_dict(tmp_path / "out")["ids"], _tensors()["ids"])
    assert main(["convert", s3["hf"], f"s3://{BUCKET}/converted", "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "dst 's3://convert/converted' is not a local directory" in err and "Traceback" not in err
