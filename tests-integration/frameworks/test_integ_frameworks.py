"""Hugging Face Accelerate and Lightning Fabric saving and loading FSDP2 checkpoints with
``dcp_load.torch_compat`` swapped in for torch.distributed.checkpoint's ``save``, ``load``
and ``async_save`` (integ_frameworks_cases), on 2 real gloo ranks: every value each
framework restores into poisoned targets equals what it restores from the same run with
torch DCP, and what was saved. Then torch DCP itself reads the checkpoints dcp wrote:
``torch.distributed.checkpoint.load`` in a new launch, ``FileSystemReader.read_metadata``,
``format_utils.dcp_to_torch_save``, and Accelerate's ``merge_fsdp_weights`` (which reads
with torch's reader); each gives what it gives for torch DCP's checkpoints.

What cannot run on CPU, and so is not covered: Accelerate's FSDP1 path and Fabric's
``FSDPStrategy`` (torch 2.13's FSDP1 refuses CPU). Accelerate on CPU builds a MULTI_CPU
state and ignores its FSDP plugin; the cases set the FSDP type and plugin on its state, as a
GPU launch would, so that ``prepare`` applies FSDP2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is not installed (nox -s tests-frameworks installs it)")
pytest.importorskip("lightning.fabric", reason="Lightning is not installed (nox -s tests-frameworks installs it)")
pytest.importorskip("safetensors", reason="merge_fsdp_weights writes a safetensors file")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from dcp_platform.testing import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "torchtitan"))  # integ_torchtitan_cases._full, POISON
sys.path.insert(0, str(Path(__file__).parent))
import integ_accelerate_cases as accelerate_cases  # noqa: E402
import integ_frameworks_cases as fw  # noqa: E402
import integ_lightning_cases as lightning_cases  # noqa: E402
import integ_torch_reads_cases as torch_reads  # noqa: E402

pytestmark = pytest.mark.frameworks
RUN = {"timeout": 300, "pg_timeout": 240}


def _flat(tree, prefix: str = "") -> dict:
    """Nested dicts and lists as one dict keyed by dotted path."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def assert_same(got, want, where: str) -> None:
    """Exactly the same keys and values (arrays: same dtype and shape and bytes)."""
    got, want = _flat(got), _flat(want)
    assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
    for key, value in want.items():
        if isinstance(value, (np.ndarray, torch.Tensor)):
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=f"{where}: {key}",
                                          strict=True)
        else:
            assert got[key] == value, (where, key, got[key], value)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("frameworks")


@pytest.fixture(scope="module")
def accelerate_run(root):
    return run_ranks(accelerate_cases.round_trip, 2, str(root), **RUN)


@pytest.fixture(scope="module")
def lightning_run(root):
    return run_ranks(lightning_cases.round_trip, 2, str(root), **RUN)


def _poisoned_anywhere(snap) -> bool:
    return any(isinstance(v, np.ndarray) and (v == fw.POISON).any() for v in _flat(snap).values())


def test_accelerate_save_state_load_state(accelerate_run):
    for rank, r in enumerate(accelerate_run):
        assert r["fsdp2"], "prepare() did not apply FSDP2"
        # save_state: the model's folder, then the optimizer's; load_state the same
        assert r["dcp_calls"] == ["save", "save", "load", "load"], r["dcp_calls"]
        assert ".metadata" in r["files"]["torch"][accelerate_cases.MODEL_DIR], r["files"]
        assert not _poisoned_anywhere(r["saved"])
        assert_same(r["torch"], r["saved"], f"rank {rank}: torch DCP")
        assert_same(r["dcp"], r["torch"], f"rank {rank}: dcp")
    assert_same(accelerate_run[1]["saved"], accelerate_run[0]["saved"], "ranks")


def test_lightning_fabric_save_load(lightning_run):
    for rank, r in enumerate(lightning_run):
        assert r["fsdp2"], "ModelParallelStrategy did not apply FSDP2"
        # save: one folder; load: the model, then the optimizer (Fabric loads them apart)
        assert r["dcp_calls"] == ["save", "load", "load"], r["dcp_calls"]
        assert "meta.pt" in r["files"]["dcp"], r["files"]
        assert not _poisoned_anywhere(r["saved"])
        assert r["torch"]["step"] == r["dcp"]["step"] == 2
        assert_same(r["torch"], {**r["saved"], "step": 2, "rest": []}, f"rank {rank}: torch DCP")
        assert_same(r["dcp"], r["torch"], f"rank {rank}: dcp")


#: Each framework's folders written through torch DCP's or dcp's save, under root.
FOLDERS = [f"accelerate-{{impl}}/{accelerate_cases.MODEL_DIR}", f"accelerate-{{impl}}/{accelerate_cases.OPTIM_DIR}",
           "lightning-{impl}"]


def test_torch_dcp_load_resumes_from_dcp_checkpoints(root, accelerate_run, lightning_run):
    """A new launch resumes with torch DCP's own ``load`` from what each framework saved."""
    resumed = run_ranks(torch_reads.resume, 2, str(root), **RUN)
    for rank, r in enumerate(resumed):
        for framework, run in (("accelerate", accelerate_run), ("lightning", lightning_run)):
            assert_same(r[f"{framework}-torch"], run[rank]["saved"], f"rank {rank}: {framework}, torch DCP's")
            assert_same(r[f"{framework}-dcp"], r[f"{framework}-torch"], f"rank {rank}: {framework}, dcp's")


def _entries(metadata) -> dict:
    """What ``read_metadata`` says of each entry, without file names (dcp names its files
    its own way): kind, shape, dtype and chunks, and the state-dict keys it came from."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        said = {"kind": type(entry).__name__, "keys": list(metadata.planner_data[fqn])}
        if isinstance(entry, TensorStorageMetadata):
            said.update(size=list(entry.size), dtype=str(entry.properties.dtype),
                        chunks=sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks))
        out[fqn] = said
    return out


@pytest.mark.parametrize("folder", FOLDERS)
def test_torch_dcp_read_metadata_of_dcp_checkpoints(root, accelerate_run, lightning_run, folder):
    from torch.distributed.checkpoint import FileSystemReader

    torch_meta = FileSystemReader(str(root / folder.format(impl="torch"))).read_metadata()
    dcp_meta = FileSystemReader(str(root / folder.format(impl="dcp"))).read_metadata()
    assert _entries(dcp_meta) == _entries(torch_meta)


@pytest.mark.parametrize("folder", FOLDERS)
def test_torch_dcp_to_torch_save_of_dcp_checkpoints(root, tmp_path, accelerate_run, lightning_run, folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = {}
    for impl in fw.IMPLS:
        dcp_to_torch_save(str(root / folder.format(impl=impl)), tmp_path / f"{impl}.pt")
        saved[impl] = torch.load(tmp_path / f"{impl}.pt", weights_only=True)
    assert saved["torch"], folder
    assert_same(saved["dcp"], saved["torch"], folder)


def test_accelerate_merge_fsdp_weights_of_dcp_checkpoints(root, accelerate_run):
    """``merge_fsdp_weights`` reads with torch DCP's reader on the main process."""
    merged = run_ranks(accelerate_cases.merge, 2, str(root), **RUN)[0]
    assert_same(merged["torch"], accelerate_run[0]["saved"]["model"], "torch DCP's")
    assert_same(merged["dcp"], merged["torch"], "dcp's")
