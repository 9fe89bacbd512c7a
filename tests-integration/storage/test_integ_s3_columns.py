"""Column shards from object storage: a Hugging Face checkpoint in a real S3 server on
loopback (moto, behind the counting proxy), loaded on 4 gloo ranks (DP2 x TP2) with every
weight sharded on its last dimension (row-parallel halves, a conv kernel, experts, a
narrow embedding). A column shard's rows are interleaved with the other ranks' columns in
the file: read by each holder, they fetched the other columns too (1.33 x the unique
bytes at the default gap budget) or cost a GET per row. One rank reads each row slab whole
and relays the columns it does not hold: the job fetches each byte once (at most 1.05 x the
unique bytes, with the files' headers) in few GETs, and every rank holds the saved values
(targets poisoned first), also when ``sources=`` renames every key. Measured here before
the relay: 6,163 GETs and 2.02 x the unique
bytes from the server; with it: 12 GETs, 1.03 x (the headers included)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

from dcp_platform.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import integ_s3_columns_cases as cases  # noqa: E402
import s3_server  # noqa: E402

BUCKET = "columns"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import save_file

    with s3_server.bucket_behind_proxy(BUCKET) as proxy:
        from dcp_reader.storage import ObjectStorage

        local = tmp_path_factory.mktemp("columns") / "model.safetensors"
        save_file({n: cases.full(n) for n in cases.SPECS}, str(local))
        ObjectStorage(f"s3://{BUCKET}/hf").put("model.safetensors", [local.read_bytes()])
        yield proxy, f"s3://{BUCKET}/hf"


@pytest.mark.parametrize("rename", [False, True], ids=["names", "sources-renamed"])
def test_column_shards_fetch_each_byte_once_in_few_gets(s3, rename: bool) -> None:
    proxy, uri = s3
    proxy.faults.reset_counts()
    per_rank = run_ranks(cases.columns, 4, uri, rename, env=s3_server.s3_env(proxy.endpoint), timeout=300, pg_timeout=200)
    assert all(not r["wrong"] for r in per_rank), [r["wrong"] for r in per_rank]
    unique = cases.unique()
    assert per_rank[0]["unique"] == unique
    assert per_rank[0]["fetched"] <= 1.05 * unique, (per_rank[0]["fetched"], unique)
    # what the server sent, headers included: 4 ranks' ranged GETs
    assert proxy.faults.get_bytes <= 1.05 * unique, (proxy.faults.get_bytes, unique)
    # the rows of each slab in one GET (8 MiB parts), plus each rank's header reads
    assert proxy.faults.gets <= 40, proxy.faults.gets
    assert sum(r["read"] for r in per_rank) >= unique  # every byte some rank read



def test_the_reader_counts_what_the_store_sent(s3) -> None:
    # A column half read alone: each row's run is fetched with the other half as the gap
    # its GET reads through. bytes_fetched counts what the store sent, not only the box.
    import torch
    from dcp_reader import open_checkpoint

    proxy, uri = s3
    with open_checkpoint(uri) as reader:
        chunk = reader.metadata.tensors["down"].chunks[0]
        out = torch.empty(512, 1024)
        read0, fetched0 = reader.bytes_read, reader.bytes_fetched
        proxy.faults.reset_counts()
        reader.read_into("down", chunk, (0, 0), (512, 1024), out)
        box = out.numel() * 4
        assert torch.equal(out, cases.full("down")[:, :1024])
        assert reader.bytes_read - read0 == box
        assert reader.bytes_fetched - fetched0 == proxy.faults.get_bytes >= 1.9 * box
