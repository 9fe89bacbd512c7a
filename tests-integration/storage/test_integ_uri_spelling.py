"""One object-store prefix spelled two ways on two ranks (``s3://b/ck`` and ``s3://b/ck/``)
is one checkpoint directory, as a local path with and without a trailing slash is: a save
on 2 real gloo ranks into moto's S3 server on loopback succeeds and loads back exactly
(before, the save was refused: "checkpoint_id is s3://b/ck/ here but s3://b/ck on rank 0")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_uri_cases as cases  # noqa: E402
import s3_server  # noqa: E402


def test_a_prefix_with_and_without_a_trailing_slash_is_one_directory() -> None:
    server, endpoint = s3_server.start_moto()
    try:
        s3_server.make_bucket(endpoint, "uris")
        out = run_ranks(cases.save_and_load, 2, "s3://uris/ck", env=s3_server.s3_env(endpoint), timeout=300,
                        pg_timeout=120)
    finally:
        server.stop()
    assert [o.get("saved_error") for o in out] == [None, None], out
    assert [o["saved"] for o in out] == ["s3://uris/ck"] * 2 and all(o["loaded"] for o in out), out
