"""``bytes_fetched`` from object storage when the data came with a small object's first
read (a safetensors object below 64 KiB is fetched whole by its header read, by the rank
that parses the index): on 2 gloo ranks, rows and relayed columns, each rank's report is at
least what it read and the job's is what the server sent (the counting proxy in front of
moto). Single process: a hypothesis property over object sizes and boxes, a first and a
second open of each object (the second reads from this process's cache of first bytes)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

from dcp_platform.testing import run_ranks  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_small_objects_cases as cases  # noqa: E402
import s3_server  # noqa: E402

BUCKET = "small"
_PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def proxy():
    with s3_server.bucket_behind_proxy(BUCKET) as proxy:
        yield proxy


def _put(tmp: Path, rows: int, cols: int) -> tuple[str, int]:
    """A one-tensor safetensors object under a new prefix: (its checkpoint URI, its size)."""
    from dcp_reader.storage import ObjectStorage
    from safetensors.torch import save_file

    local = tmp / f"m{rows}x{cols}.safetensors"
    save_file({"w": cases.full(rows, cols)}, str(local))
    uri = f"s3://{BUCKET}/p{next(_PREFIXES)}"
    ObjectStorage(uri).put("model.safetensors", [local.read_bytes()])
    return uri, local.stat().st_size


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns-relayed"])
@pytest.mark.parametrize(("rows", "cols"), [(64, 96), (128, 96)], ids=["25KB", "50KB"])
def test_a_small_object_s_fetched_bytes_are_what_the_store_sent(proxy, tmp_path: Path, dim: int, rows: int,
                                                                cols: int) -> None:
    uri, size = _put(tmp_path, rows, cols)
    proxy.faults.reset_counts()
    per_rank = run_ranks(cases.load_small, 2, uri, rows, cols, dim, env=s3_server.s3_env(proxy.endpoint),
                         timeout=300, pg_timeout=200)
    assert all(r["right"] for r in per_rank), per_rank
    assert per_rank[0]["job_read"] >= rows * cols * 4, per_rank
    for r in per_rank:
        assert r["fetched"] >= r["read"], per_rank
        assert r["job_fetched"] == proxy.faults.get_bytes >= size, (per_rank, proxy.faults.get_bytes, size)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 160), cols=st.integers(1, 160), part=st.data())
def test_bytes_fetched_covers_bytes_read_whatever_the_size(proxy, tmp_path: Path, rows: int, cols: int,
                                                           part: st.DataObject) -> None:
    import torch
    from dcp_reader import open_checkpoint

    uri, _ = _put(tmp_path, rows, cols)
    r0 = part.draw(st.integers(0, rows - 1))
    r1 = part.draw(st.integers(r0 + 1, rows))
    c0 = part.draw(st.integers(0, cols - 1))
    c1 = part.draw(st.integers(c0 + 1, cols))
    for first in (True, False):
        proxy.faults.reset_counts()
        with open_checkpoint(uri) as reader:
            chunk = reader.metadata.tensors["w"].chunks[0]
            out = torch.full((r1 - r0, c1 - c0), float("nan"))
            reader.read_into("w", chunk, (r0, c0), (r1 - r0, c1 - c0), out)
            assert torch.equal(out, cases.full(rows, cols)[r0:r1, c0:c1])
            assert reader.bytes_fetched >= reader.bytes_read == out.numel() * 4
            if first:  # nothing of this object was cached: every byte counted is one the store sent
                assert reader.bytes_fetched == proxy.faults.get_bytes, (reader.bytes_fetched, proxy.faults.get_bytes)
