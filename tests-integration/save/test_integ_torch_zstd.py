"""torch's ZStandard extension on 2 real gloo ranks (integ_torch_zstd_cases): what torch DCP's
own ``save`` and ``dcp_load.torch_compat``'s ``save`` / ``async_save`` write through
``FileSystemWriter(_extensions=[ZStandard()])`` records torch's descriptor for every item, and
torch DCP's ``load``, ``dcp_load.load`` and ``torch_compat.load`` load each into poisoned
targets of another sharding, equal to the saved state; ``verify_checkpoint`` passes on all
three, dcp's checking the checksums of the bytes as stored."""

from __future__ import annotations

import os
import sys

import pytest
from dcp_platform.testing import run_ranks

pytest.importorskip("zstandard")
sys.path.insert(0, os.path.dirname(__file__))
import integ_torch_format_cases as plain_cases  # noqa: E402
import integ_torch_zstd_cases as cases  # noqa: E402

RUN = {"timeout": 240, "pg_timeout": 180}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-zstd")
    files = run_ranks(cases.save_all, 2, str(root), **RUN)
    return root, files


def test_every_item_is_stored_through_zstd(saved):
    from torch.distributed.checkpoint import FileSystemReader

    root, files = saved
    for d in cases.DIRS:
        md = FileSystemReader(str(root / d)).read_metadata()
        assert {tuple(i.transform_descriptors or ()) for i in md.storage_data.values()} == {("stream.zstd/1",)}, d
    for d in ("dcp", "dcp-async"):
        assert "dcp-checksums.json" in files[0][d] and ".metadata" in files[0][d], files[0][d]


def test_torch_and_dcp_load_every_compressed_save_resharded(saved):
    root, _ = saved
    want = plain_cases.expected()
    for rank, got in enumerate(run_ranks(cases.load_all, 2, str(root), **RUN)):
        assert len(got) == 9, sorted(got)
        for label, plain in got.items():
            assert plain == want, f"rank {rank}: {label}"


def test_verify_passes_and_checks_what_dcp_stored(saved):
    from dcp_reader import verify_checkpoint

    root, _ = saved
    for d in cases.DIRS:
        report = verify_checkpoint(root / d)
        assert report.ok, (d, report.problems)
        assert (report.chunks_with_checksums == report.chunks > 0) == (d != "torch"), (d, report)
