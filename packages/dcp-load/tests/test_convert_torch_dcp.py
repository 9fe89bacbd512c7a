"""``dcp_load.convert(..., to="torch-dcp")`` and ``dcp convert --to torch-dcp``: native
checkpoints saved on one process and sharded on 2 gloo ranks, a Hugging Face directory and
a torch DCP checkpoint converted into torch.distributed.checkpoint's own format, then read
by torch itself (``load`` into NaN-poisoned tensors, ``read_metadata``,
``dcp_to_torch_save``) and by ``dcp_load.load``, bitwise equal to the source; every blob a
valid zip (its CRC-32s right); a round trip back to native; block checksums catch a flipped
byte; bad input refused by name."""

from __future__ import annotations

import io
import os
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load.cli._main import main as cli_main
from dcp_platform.testing import run_ranks
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

HERE = Path(__file__).parent


def full_state() -> dict[str, Any]:
    """Nested dicts (a numeric string key among them), bf16, float16, int, bool, 0-dim and
    empty tensors, and values."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 48, generator=g).to(torch.bfloat16),
            "layers": {"0": {"w": torch.randn(16, 8, generator=g).to(torch.float16)},
                       "1": {"w": torch.randn(8, 16, generator=g)}},
            "ids": torch.arange(37, dtype=torch.int64) * 3 - 50,
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
        },
        "counts": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "mask": torch.arange(9) % 2 == 0,
        "step": 7,
        "optim": {"lr": 0.5, "name": "adam", "betas": [0.9, 0.99]},
    }


def flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def poisoned(state: Any) -> Any:
    """The same structure, every tensor filled with what no source holds (NaN; integers -7;
    bools flipped), every value replaced."""
    if isinstance(state, dict):
        return {k: poisoned(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        if state.dtype.is_floating_point:
            return torch.full_like(state, float("nan"))
        if state.dtype == torch.bool:
            return ~state
        return torch.full_like(state, -7)
    return None


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal structure; tensors of the same dtype and shape and the same bytes."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got if not isinstance(got, dict) else set(got))
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, got)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (where, got.dtype, got.shape)
        assert got.contiguous().reshape(-1).view(torch.uint8).tolist() == \
            want.contiguous().reshape(-1).view(torch.uint8).tolist(), where
    else:
        assert got == want, (where, got, want)


def torch_load(dst: Path, want: dict[str, Any]) -> dict[str, Any]:
    target = poisoned(want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: torch warns that it loads without one
        tdcp.load(target, checkpoint_id=str(dst), no_dist=True)
    return target


def check_torch_reads(dst: Path, want: dict[str, Any], tmp: Path, keys: dict[str, tuple[Any, ...]] | None = None
                      ) -> None:
    """torch's read_metadata, load and dcp_to_torch_save, and dcp_load.load, of ``dst``, all
    equal to ``want``; every blob a zip whose CRC-32s hold."""
    names = flat(want)
    md = tdcp.FileSystemReader(str(dst)).read_metadata()
    assert set(md.state_dict_metadata) == set(names)
    for name, v in names.items():
        meta = md.state_dict_metadata[name]
        if isinstance(v, torch.Tensor):
            assert isinstance(meta, TensorStorageMetadata), name
            assert (meta.properties.dtype, tuple(meta.size)) == (v.dtype, tuple(v.shape)), name
        else:
            assert isinstance(meta, BytesStorageMetadata), name
    assert md.planner_data == (keys or {n: tuple(n.split(".")) for n in names})
    for index, info in md.storage_data.items():
        with open(dst / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None, index.fqn
    assert_same(torch_load(dst, want), want, "tdcp.load")
    dcp_to_torch_save(str(dst), str(tmp / "whole.pt"))
    assert_same(torch.load(tmp / "whole.pt", weights_only=True), want, "dcp_to_torch_save")
    target = poisoned(want)
    dcp_load.load(target, checkpoint_id=str(dst), no_dist=True)
    assert_same(target, want, "dcp_load.load")


def convert(src: Path, dst: Path, how: str, *extra: str) -> None:
    if how == "cli":
        assert cli_main(["convert", str(src), str(dst), "--to", "torch-dcp", "--quiet", *extra]) == 0
    else:
        kwargs = {"max_shard_bytes": extra[1]} if extra else {}
        report = dcp_load.convert(src, dst, to="torch-dcp", quiet=True, **kwargs)
        assert report.format == "torch-dcp" and report.skipped == ()


@pytest.mark.parametrize("how", ["api", "cli"])
def test_native_one_process(tmp_path, how):
    want = full_state()
    dcp_load.save(want, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    convert(tmp_path / "src", tmp_path / "dst", how)
    files = sorted(os.listdir(tmp_path / "dst"))
    assert len(files) == 4 and re.fullmatch(r"\.metadata __0_([0-9a-f]{12})\.distcp __values_\1\.distcp "
                                            r"dcp-checksums\.json", " ".join(files)), files
    check_torch_reads(tmp_path / "dst", want, tmp_path)


def test_round_trip_native_torch_dcp_native(tmp_path):
    want = full_state()
    dcp_load.save(want, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    dcp_load.convert(tmp_path / "src", tmp_path / "torch", to="torch-dcp", quiet=True)
    report = dcp_load.convert(tmp_path / "torch", tmp_path / "back", to="native", quiet=True)
    assert report.values == 4 and report.skipped == ()
    target = poisoned(want)
    dcp_load.load(target, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert_same(target, want)


def save_sharded(rank: int, world_size: int, path: str) -> None:
    """Runs on each gloo rank: ``full_state()`` with model.w, model.ids and counts sharded
    (DTensor; ids and counts unevenly), the rest replicated, saved natively."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = full_state()
    state["model"]["w"] = distribute_tensor(state["model"]["w"], mesh, [Shard(0)])
    state["model"]["ids"] = distribute_tensor(state["model"]["ids"], mesh, [Shard(0)])
    state["counts"] = distribute_tensor(state["counts"], mesh, [Shard(1)])
    dcp_load.save(state, checkpoint_id=path)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded") / "src"
    sys.path.insert(0, str(HERE))  # the ranks import this module by its name, with this path
    try:
        import test_convert_torch_dcp as cases

        run_ranks(cases.save_sharded, 2, str(path), timeout=180)
    finally:
        sys.path.remove(str(HERE))
    return path


@pytest.mark.parametrize("how", ["api", "cli"])
def test_native_sharded_on_two_ranks(sharded, tmp_path, how):
    from dcp_reader import open_checkpoint

    with open_checkpoint(str(sharded)) as reader:
        chunks = {n: len(t.chunks) for n, t in reader.metadata.tensors.items()}
    assert chunks["model.w"] == chunks["model.ids"] == chunks["counts"] == 2, chunks
    # written whole, in several files (a small shard size)
    convert(sharded, tmp_path / "dst", how, "--max-shard-size", "4000")
    assert len([f for f in os.listdir(tmp_path / "dst") if f.startswith("__")]) > 3
    md = tdcp.FileSystemReader(str(tmp_path / "dst")).read_metadata()
    assert all(len(m.chunks) == 1 for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
    check_torch_reads(tmp_path / "dst", full_state(), tmp_path)


def test_hf_source(tmp_path):
    tensors = {k: v for k, v in flat(full_state()).items() if isinstance(v, torch.Tensor) and v.numel()}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    dcp_load.convert(tmp_path / "hf", tmp_path / "dst", to="torch-dcp", quiet=True)
    want = full_state()
    del want["step"], want["optim"], want["model"]["empty"]
    check_torch_reads(tmp_path / "dst", want, tmp_path)


def test_torch_dcp_source_keeps_the_recorded_keys(tmp_path):
    """torch's own save of a flat dict with dotted keys records one key per name: kept, so
    dcp_to_torch_save gives the flat dict back (the dotted names alone would nest)."""
    g = torch.Generator().manual_seed(1)
    want = {"layers.0.weight": torch.randn(4, 3, generator=g).to(torch.bfloat16), "nested": {"b": torch.arange(5)},
            "epoch": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(want, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="torch_dcp", quiet=True)
    keys = {"layers.0.weight": ("layers.0.weight",), "nested.b": ("nested", "b"), "epoch": ("epoch",)}
    md = tdcp.FileSystemReader(str(tmp_path / "dst")).read_metadata()
    assert md.planner_data == keys
    dcp_to_torch_save(str(tmp_path / "dst"), str(tmp_path / "whole.pt"))
    assert_same(torch.load(tmp_path / "whole.pt", weights_only=True), want)


def test_a_flipped_byte_is_caught_by_the_block_checksums(tmp_path):
    dcp_load.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="torch-dcp", quiet=True)
    md = tdcp.FileSystemReader(str(tmp_path / "dst")).read_metadata()
    (info,) = [i for k, i in md.storage_data.items() if k.fqn == "w"]
    path = tmp_path / "dst" / info.relative_path
    raw = bytearray(path.read_bytes())
    raw[info.offset + info.length - 2048] ^= 1  # inside the data (its tail holds ~1 KB of zip records)
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception, match="(?i)checksum"):
        dcp_load.load({"w": torch.zeros(4096)}, checkpoint_id=str(tmp_path / "dst"), no_dist=True)


@pytest.mark.slow
def test_two_workers_write_what_one_does(tmp_path):
    state = {f"layer{i}": torch.full((256, 64), float(i)) for i in range(6)}
    dcp_load.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="torch-dcp", max_shard_bytes="70KB", workers=2,
                     quiet=True)
    assert len([f for f in os.listdir(tmp_path / "dst") if f.startswith("__0") or f.startswith("__1")]) >= 2
    check_torch_reads(tmp_path / "dst", state, tmp_path)


def test_bad_input_refused_by_name(tmp_path, capsys):
    dcp_load.save({"w": torch.ones(3), "step": 1}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    with pytest.raises(ValueError, match="hf, native, torch-dcp, got 'torch'"):
        dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="torch")
    with pytest.raises(SystemExit):
        cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "torch"])
    assert "'torch-dcp'" in capsys.readouterr().err
    missing = tmp_path / "no-such-checkpoint"
    assert cli_main(["convert", str(missing), str(tmp_path / "dst"), "--to", "torch-dcp"]) == 2
    assert str(missing) in capsys.readouterr().err
    with pytest.raises(Exception, match=str(missing)):
        dcp_load.convert(missing, tmp_path / "dst", to="torch-dcp")
    assert not (tmp_path / "dst").exists()
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="torch-dcp")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "torch-dcp"]) == 2
    assert os.listdir(tmp_path / "dst") == ["keep.txt"]
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "torch-dcp", "--overwrite",
                     "--quiet"]) == 0
    assert "keep.txt" not in os.listdir(tmp_path / "dst")
    assert_same(torch_load(tmp_path / "dst", {"w": torch.ones(3), "step": 1}), {"w": torch.ones(3), "step": 1})


# test_convert_memory.py's child, converting into torch DCP's format (the warm-up too: its
# imports, torch.distributed.checkpoint's metadata classes, are paid once per process)
TORCH_CHILD = """
import os, sys, tempfile, torch, dcp_load
from safetensors.torch import save_file
with tempfile.TemporaryDirectory() as tmp:
    os.mkdir(os.path.join(tmp, "s"))
    save_file({"w": torch.ones(4, 4)}, os.path.join(tmp, "s", "model.safetensors"))
    dcp_load.convert(os.path.join(tmp, "s"), os.path.join(tmp, "d"), to="torch-dcp", dtype="bfloat16")
print("READY", flush=True)
sys.stdin.readline()
dcp_load.convert(sys.argv[1], sys.argv[2], to="torch-dcp", dtype=(sys.argv[3:] or [None])[0], max_shard_bytes="1GB")
"""


@pytest.mark.slow
def test_peak_anonymous_memory_as_the_other_targets(tmp_path, monkeypatch):
    """The bound of test_convert_memory.py holds for torch-dcp: 1 GiB and 4 GiB conversions
    (every piece cast to bfloat16) peak within 32 MiB of each other, under 128 MiB."""
    sys.path.insert(0, str(HERE))
    try:
        import test_convert_memory as mem
    finally:
        sys.path.remove(str(HERE))
    monkeypatch.setattr(mem, "CHILD", TORCH_CHILD)
    peaks = {}
    for gib in (1, 4):
        src, dst = tmp_path / f"src{gib}", tmp_path / f"dst{gib}"
        mem.write_hf(src, gib)
        peaks[gib], _ = mem.peak_extra_anon(src, dst, "bfloat16")
        assert sum(p.stat().st_size for p in dst.iterdir()) > gib * (1 << 29)
        for p in (*src.iterdir(), *dst.iterdir()):
            p.unlink()
    assert abs(peaks[4] - peaks[1]) <= 32 * mem.MIB, peaks
    assert max(peaks.values()) <= 128 * mem.MIB, peaks
