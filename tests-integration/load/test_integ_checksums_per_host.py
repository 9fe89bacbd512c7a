"""Block checksums are verified once per host: in the default "auto" mode, the rank that
fetches a box for its host verifies it and the ranks that re-read it from that host's page
cache do not hash it again; a corrupt block still fails the load on every rank. With
``broadcast_replicated_tensors=False`` every rank verifies what it reads. 2 gloo ranks on
one host, plain (replicated) tensors, a native checkpoint written by ``save``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dcp_platform.testing import run_ranks

sys.path.insert(0, str(Path(__file__).parent))
import integ_checksum_cases as cases  # noqa: E402

BLOCKS = len(cases.NAMES)  # one 4 MiB block per tensor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    import dcp_load

    root = tmp_path_factory.mktemp("sums") / "ckpt"
    dcp_load.save({n: cases.full(n) for n in cases.NAMES}, checkpoint_id=str(root), no_dist=True)
    return str(root)


def _run(root: str, mode):
    return run_ranks(cases.checksum_cases, 2, root, mode, timeout=240, pg_timeout=180, env={"DCP_HOST_ID": "one"})


def test_auto_verifies_each_block_once_per_host(checkpoint):
    outs = _run(checkpoint, "auto")
    assert all(o["exact"] for o in outs), outs
    assert sum(o["verified"] for o in outs) == BLOCKS, outs  # each block hashed by one rank
    assert all(o["verified"] < BLOCKS for o in outs), outs  # and the work is shared


def test_every_rank_verifies_what_it_reads_without_broadcast(checkpoint):
    outs = _run(checkpoint, False)
    assert all(o["exact"] for o in outs), outs
    assert all(o["verified"] == BLOCKS for o in outs), outs


def test_a_corrupt_block_fails_the_load_on_every_rank(checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    data = sorted(p for p in bad.iterdir() if p.suffix == ".safetensors")[0]
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # a byte of the last tensor's block
    data.write_bytes(bytes(raw))
    outs = _run(str(bad), "auto")
    for o in outs:
        assert o["error"] is not None and "checksum" in o["error"].lower(), o
