"""``save``/``async_save(format="torch_dcp")`` write torch DCP's own on-disk format, on 2 real
gloo ranks (integ_torch_format_cases): torch DCP's ``load`` and dcp's load what dcp wrote into
poisoned targets of another sharding exactly as they load torch DCP's own save of the same
state; torch's ``read_metadata`` says the same of both (entries, chunks, dtypes, planner
keys); ``dcp_to_torch_save`` gives the same file contents; a second save of the same holdings
(the remembered layout) and a format switch between saves stay whole. Bad input: an unknown
format, ``overwrite=False`` over a checkpoint, a torn or foreign ``.metadata``: a clear error
naming it, and the old checkpoint kept."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from dcp_platform.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import integ_torch_format_cases as cases  # noqa: E402

RUN = {"timeout": 240, "pg_timeout": 180}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-format")
    files = run_ranks(cases.save_all, 2, str(root), **RUN)
    return root, files


def test_dcp_writes_torch_dcp_files_with_checksums_beside(saved):
    _, files = saved
    for d in ("dcp", "dcp-again", "dcp-async"):
        names = files[0][d]
        assert ".metadata" in names and "dcp-checksums.json" in names, names
        assert sum(n.startswith("__0_") and n.endswith(".distcp") for n in names) == 1, names
        assert sum(n.startswith("__1_") and n.endswith(".distcp") for n in names) == 1, names
        assert not [n for n in names if n.endswith(".index.json") or n == "dcp-metadata.json"], names
    assert "dcp-metadata.json" in files[0]["native"] and ".metadata" not in files[0]["native"]


def test_torch_and_dcp_load_what_dcp_wrote_resharded(saved):
    root, _ = saved
    want = cases.expected()
    for rank, got in enumerate(run_ranks(cases.load_all, 2, str(root), **RUN)):
        for label, plain in got.items():
            assert plain == want, f"rank {rank}: {label}"


def _entries(path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    out = {}
    for fqn, entry in md.state_dict_metadata.items():
        said = {"kind": type(entry).__name__, "keys": list(md.planner_data[fqn])}
        if isinstance(entry, TensorStorageMetadata):
            said.update(size=list(entry.size), dtype=str(entry.properties.dtype),
                        chunks=sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks))
        out[fqn] = said
    return out


@pytest.mark.parametrize("d", ["dcp", "dcp-again", "dcp-async"])
def test_torch_read_metadata_says_the_same_as_of_its_own_save(saved, d):
    root, _ = saved
    assert _entries(root / d) == _entries(root / "torch")


@pytest.mark.parametrize("d", ["dcp", "dcp-async"])
def test_dcp_to_torch_save_of_dcp_files_equals_torch_dcps(saved, tmp_path, d):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _ = saved
    out = {}
    for who in ("torch", d):
        dcp_to_torch_save(str(root / who), str(tmp_path / f"{who}.pt"))
        out[who] = torch.load(tmp_path / f"{who}.pt", weights_only=True)
    assert set(out[d]) == set(out["torch"]) == {"model", "optim", "extra"}
    assert cases._plain(out[d]) == cases._plain(out["torch"]) == cases.expected()


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized")
def test_load_state_dict_from_keys_reads_dcp_files(saved):
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    root, _ = saved
    got = _load_state_dict_from_keys({"model.bias", "extra.step"}, checkpoint_id=str(root / "dcp"))
    assert torch.equal(got["model"]["bias"], cases.full_values()["bias"]) and got["extra"]["step"] == 3


def _one(path, fmt, **kw):
    import dcp_load

    return dcp_load.save({"t": torch.arange(4.0), "v": {"k": 1}}, checkpoint_id=str(path), no_dist=True,
                         format=fmt, **kw)


def test_format_switches_between_saves_of_one_process(tmp_path):
    import dcp_load

    for i, fmt in enumerate(["torch_dcp", "native", "torch_dcp", "native"]):
        _one(tmp_path / f"c{i}", fmt)
        got = {"t": torch.full((4,), -1.0), "v": {"k": None}}
        dcp_load.load(got, checkpoint_id=str(tmp_path / f"c{i}"), no_dist=True)
        assert got["t"].tolist() == [0.0, 1.0, 2.0, 3.0] and got["v"] == {"k": 1}, fmt


def test_an_unknown_format_is_named_and_nothing_written(tmp_path):
    with pytest.raises(Exception) as exc:
        _one(tmp_path / "c", "torch-dcp-v9")
    assert "torch-dcp-v9" in str(exc.value) and "format" in str(exc.value)
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


def test_overwrite_false_refuses_and_keeps_the_old_checkpoint(tmp_path):
    import dcp_load.torch_compat as compat
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "c"
    compat.save({"t": torch.arange(4.0)}, checkpoint_id=str(path), no_dist=True)
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(CheckpointException) as exc:
        compat.save({"t": torch.zeros(4)}, storage_writer=compat.FileSystemWriter(str(path), overwrite=False),
                    no_dist=True)
    assert "overwrite" in str(exc.value), exc.value
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before


@pytest.mark.parametrize("damage", ["torn", "foreign", "empty"])
def test_a_torn_or_foreign_metadata_is_named_by_dcp(tmp_path, damage):
    import dcp_load

    path = tmp_path / "c"
    _one(path, "torch_dcp")
    raw = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes({"torn": raw[: len(raw) // 2], "foreign": os.urandom(len(raw)),
                                      "empty": b""}[damage])
    with pytest.raises(Exception) as exc:
        dcp_load.load({"t": torch.zeros(4)}, checkpoint_id=str(path), no_dist=True)
    assert ".metadata" in str(exc.value), exc.value
