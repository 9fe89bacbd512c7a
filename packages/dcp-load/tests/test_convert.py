"""dcp_load.convert and ``dcp convert``: every source format (native, Hugging Face single
file and sharded, torch.distributed.checkpoint, hyper-parallel with row and column chunks)
into both output formats, values checked exactly; the dtype rules; shard sizes and order;
two workers write the same bytes as one; a non-empty destination is refused and untouched;
a conversion killed mid-way leaves nothing a loader takes for a checkpoint; the index is
what transformers' sharded loading reads; ``--sources`` files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load.cli._main import main as cli_main
from dcp_load.conversion._layout import parse_size
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[2] / "dcp-reader" / "tests"))
import hyper_writer as hw  # noqa: E402


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.w": torch.randn(64, 48, generator=g),
        "layers.1.w": torch.randn(48, 64, generator=g).to(torch.bfloat16),
        "emb": torch.randn(100, 32, generator=g).to(torch.float16),
        "ids": torch.arange(37, dtype=torch.int64) * 3,
        "mask": torch.arange(9) % 2 == 0,
        "scalar": torch.tensor(2.5),
        "counts": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


VALUES = {"step": 7, "lr": 0.5}


def _write(fmt: str, path: Path) -> None:
    t = _tensors()
    if fmt == "native":
        dcp_load.save({**t, **VALUES}, checkpoint_id=str(path), no_dist=True)
    elif fmt == "hf":
        path.mkdir()
        save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif fmt == "hf-sharded":
        path.mkdir()
        names = sorted(t)
        parts = {"a.safetensors": names[:3], "b.safetensors": names[3:]}
        for f, ns in parts.items():
            save_file({n: t[n] for n in ns}, str(path / f), metadata={"format": "pt"})
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    elif fmt == "torch-dcp":
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            tdcp.save({**{k: v.clone() for k, v in t.items()}, **VALUES}, checkpoint_id=str(path), no_dist=True)
    elif fmt == "hyper":
        # rank 0 and 1 each saved half: rows of the 2-D tensors, columns of "layers.1.w"
        # (strided destinations), whole small tensors on rank 0
        ranks: dict[int, dict] = {0: {}, 1: {}}
        for n, v in t.items():
            if n == "layers.1.w":
                ranks[0][n] = [((0, 0), v[:, :40].contiguous())]
                ranks[1][n] = [((0, 40), v[:, 40:].contiguous())]
            elif v.dim() == 2 and v.shape[0] > 10:
                h = v.shape[0] // 2
                ranks[0][n] = [((0, 0), v[:h].clone())]
                ranks[1][n] = [((h, 0), v[h:].clone())]
            else:
                ranks[0][n] = [((0,) * v.dim(), v.clone())]
        ranks[0]["step"] = 7
        hw.write_checkpoint(path, ranks, {n: tuple(v.shape) for n, v in t.items()})
    else:
        raise AssertionError(fmt)


def _read_hf(path: Path) -> dict[str, torch.Tensor]:
    """What transformers' sharded loading does: the index's weight map, each shard opened
    with safe_open(framework="pt") and its metadata format checked."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in path.iterdir() if p.suffix == ".safetensors") == files
    out = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as sf:
            assert sf.metadata()["format"] == "pt"
            for k in sf.keys():
                assert index["weight_map"][k] == f
                out[k] = sf.get_tensor(k)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in out.values())
    return out


def _expected(dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in _tensors().items()}


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


SOURCES = ["native", "hf", "hf-sharded", "torch-dcp", "hyper"]


@pytest.mark.parametrize("fmt", SOURCES)
def test_every_source_into_hf(tmp_path, fmt):
    _write(fmt, tmp_path / "src")
    report = dcp_load.convert(tmp_path / "src", tmp_path / "out", to="hf", max_shard_bytes="8KB")
    got = _read_hf(tmp_path / "out")
    _same(got, _expected())
    assert report.tensors == 7 and len(report.files) > 1
    assert report.files == tuple(f"model-{i:05d}-of-{len(report.files):05d}.safetensors"
                                 for i in range(1, len(report.files) + 1))
    skipped = {n for n, _ in report.skipped}
    assert skipped == ({"step", "lr"} if fmt in ("native", "torch-dcp") else {"step"} if fmt == "hyper" else set())
    nbytes = sum(v.numel() * v.element_size() for v in _tensors().values())
    if fmt == "torch-dcp":  # each blob's zip directory and index are read too (~1 KiB)
        assert nbytes <= report.bytes_read <= nbytes + 7 * 2048
    else:
        assert report.bytes_read == nbytes
    assert report.bytes_written == sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    _same(dcp_load.read_state_dict(tmp_path / "out"), _expected())  # dcp reads it back too


@pytest.mark.parametrize("fmt", SOURCES)
def test_every_source_into_native(tmp_path, fmt):
    from dcp_reader import verify_checkpoint

    _write(fmt, tmp_path / "src")
    report = dcp_load.convert(tmp_path / "src", tmp_path / "out", to="native", max_shard_bytes="8KB")
    check = verify_checkpoint(tmp_path / "out")
    assert check.ok, check.problems
    assert check.chunks_with_checksums == 7
    back = dcp_load.read_state_dict(tmp_path / "out")
    values = VALUES if fmt in ("native", "torch-dcp") else {}
    _same({k: v for k, v in back.items() if k in _tensors()}, _expected())
    assert {k: v for k, v in back.items() if k not in _tensors()} == values
    if fmt == "hyper":  # pickled by hyper-parallel: not read without allow_pickle, named as skipped
        assert [n for n, _ in report.skipped] == ["step"]
    assert cli_main(["verify", str(tmp_path / "out")]) == 0


def test_dtype_casts_floating_tensors_only(tmp_path):
    _write("native", tmp_path / "src")
    report = dcp_load.convert(tmp_path / "src", tmp_path / "out", dtype="bf16")
    got = _read_hf(tmp_path / "out")
    _same(got, _expected(torch.bfloat16))
    assert got["ids"].dtype == torch.int64 and got["mask"].dtype == torch.bool and got["counts"].dtype == torch.int32
    assert set(report.cast) == {"layers.0.w", "emb", "scalar"}  # layers.1.w was bfloat16 already
    with pytest.raises(ValueError, match="not a floating dtype"):
        dcp_load.convert(tmp_path / "src", tmp_path / "out2", dtype="int8")
    assert not (tmp_path / "out2").exists()


def test_read_state_dict_with_and_without_keys(tmp_path):
    _write("torch-dcp", tmp_path / "src")
    everything = dcp_load.read_state_dict(tmp_path / "src")
    _same({k: v for k, v in everything.items() if k in _tensors()}, _expected())
    assert everything["step"] == 7 and everything["lr"] == 0.5
    some = dcp_load.read_state_dict(tmp_path / "src", ["layers.*", "ids"], dtype="float16")
    assert sorted(some) == ["ids", "layers.0.w", "layers.1.w"]
    assert some["layers.1.w"].dtype == torch.float16 and some["ids"].dtype == torch.int64
    assert torch.equal(some["layers.0.w"], _tensors()["layers.0.w"].half())
    with pytest.raises(ValueError, match="'layer.9.\\*'"):
        dcp_load.read_state_dict(tmp_path / "src", ["layer.9.*"])


def test_shard_sizes_and_name_order(tmp_path):
    big = {f"t{i:02d}": torch.full((250,), float(i)) for i in range(20)}  # 1000 bytes each
    big["huge"] = torch.zeros(3000)  # 12000 bytes: larger than a shard, alone in its file
    save_file(big, str(tmp_path / "model.safetensors"))
    limit = parse_size("4KB")
    report = dcp_load.convert(tmp_path, tmp_path.parent / (tmp_path.name + "-out"), max_shard_bytes="4KB")
    out = tmp_path.parent / (tmp_path.name + "-out")
    order = []
    for f in report.files:
        size = (out / f).stat().st_size
        with safe_open(str(out / f), framework="pt") as sf:
            keys = list(sf.keys())
            starts = {k: json.loads(_header(out / f))[k]["data_offsets"][0] for k in keys}
        assert size <= limit or keys == ["huge"], (f, size, keys)
        order += sorted(keys, key=starts.get)
    assert order == sorted(big)  # name order across and within files
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6 and parse_size("2GiB") == 2 << 30
    with pytest.raises(ValueError, match="5GB, 500MB, 2GiB"):
        parse_size("5 parsecs")


def _header(path: Path) -> str:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n).decode()


def test_two_workers_write_the_same_bytes_as_one(tmp_path, monkeypatch):
    from dcp_load.conversion import _fill as _convert_fill
    from dcp_load.conversion import _workers as _convert_workers

    def one_then_stop(counter, n):  # this process fills one file, the worker process the others
        real, took = _convert_fill.claimer(counter, n), []
        return lambda: None if took else took.append(real()) or took[0]

    monkeypatch.setattr(_convert_workers, "claimer", one_then_stop)
    _write("hyper", tmp_path / "src")
    one = dcp_load.convert(tmp_path / "src", tmp_path / "one", max_shard_bytes="8KB", dtype="float16")
    two = dcp_load.convert(tmp_path / "src", tmp_path / "two", max_shard_bytes="8KB", dtype="float16", workers=2)
    assert one.files == two.files and two.workers == 2
    for name in [*one.files, "model.safetensors.index.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert one.bytes_read == two.bytes_read


def test_a_non_empty_destination_is_refused_and_untouched(tmp_path):
    _write("native", tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in dst.iterdir()}
    with pytest.raises(FileExistsError, match="not empty.*overwrite"):
        dcp_load.convert(tmp_path / "src", dst)
    assert cli_main(["convert", str(tmp_path / "src"), str(dst), "--to", "hf", "--quiet"]) == 2
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in dst.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporary left behind
    dcp_load.convert(tmp_path / "src", dst, overwrite=True)
    assert not (dst / "keep.txt").exists()
    _same(_read_hf(dst), _expected())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_an_empty_destination_directory_is_used(tmp_path):
    _write("hf", tmp_path / "src")
    (tmp_path / "dst").mkdir()
    dcp_load.convert(tmp_path / "src", tmp_path / "dst", to="native")
    assert (tmp_path / "dst" / "dcp-metadata.json").exists()


def test_sigkill_mid_way_leaves_nothing_a_loader_takes(tmp_path):
    from dcp_reader import CheckpointError, open_checkpoint

    _write("native", tmp_path / "src")
    # the child stops after filling its first file: SIGKILL lands with one file whole and
    # one not started
    script = textwrap.dedent(f"""
        import sys, time
        import dcp_load.conversion._fill as fill
        real = fill.fill_file
        def slow(*a, **k):
            r = real(*a, **k)
            print("FILLED", flush=True)
            time.sleep(60)
            return r
        fill.fill_file = slow
        import dcp_load
        dcp_load.convert({str(tmp_path / 'src')!r}, {str(tmp_path / 'dst')!r}, to=sys.argv[1],
                         max_shard_bytes="8KB")
    """)
    for to in ("hf",):  # the native output takes the same path (a child costs ~10 s to start here)
        with subprocess.Popen([sys.executable, "-c", script, to], stdout=subprocess.PIPE, env=os.environ) as proc:
            try:
                assert proc.stdout.readline().strip() == b"FILLED"
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
        assert not (tmp_path / "dst").exists()
        # the lock file stays (its flock died with the process: the next run takes it)
        leftovers = [p for p in tmp_path.iterdir() if p.name not in ("src", ".dst.dcp-convert.lock")]
        assert len(leftovers) == 1 and leftovers[0].name.startswith(".dst.dcp-convert-")
        names = sorted(p.name for p in leftovers[0].iterdir())
        assert names and all(n.endswith(".partial") for n in names), names
        with pytest.raises(CheckpointError):
            open_checkpoint(leftovers[0])
        for n in names:  # the partial files are not safetensors files anyone would pick up
            assert not n.endswith((".safetensors", ".json"))
        import shutil

        shutil.rmtree(leftovers[0])
    dcp_load.convert(tmp_path / "src", tmp_path / "dst", max_shard_bytes="8KB")  # no stale lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_cli_convert(tmp_path, capsys):
    _write("torch-dcp", tmp_path / "src")
    code = cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "hf", "--dtype", "bfloat16",
                     "--keys", "layers.*", "ids", "--max-shard-size", "4KiB"])
    assert code == 0
    out = capsys.readouterr()
    assert "3 tensors" in out.out
    assert "wrote model-00001-of-" in out.err  # one line per file when stderr is not a terminal
    got = _read_hf(tmp_path / "out")
    assert sorted(got) == ["ids", "layers.0.w", "layers.1.w"]
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "x"), "--to", "hf", "--keys", "nope"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_sources_file_renames(tmp_path):
    _write("native", tmp_path / "src")
    spec = tmp_path / "sources.json"
    spec.write_text(json.dumps({"model.layers.{i}.weight": "layers.{i}.w", "embed.weight": "emb"}))
    report = dcp_load.convert(tmp_path / "src", tmp_path / "out", sources=str(spec))
    got = _read_hf(tmp_path / "out")
    t = _tensors()
    assert sorted(got) == sorted(["model.layers.0.weight", "model.layers.1.weight", "embed.weight", "ids", "mask",
                                  "scalar", "counts"])
    assert torch.equal(got["model.layers.1.weight"], t["layers.1.w"]) and torch.equal(got["embed.weight"], t["emb"])
    assert report.tensors == 7
    py = tmp_path / "sources.py"
    py.write_text("sources = {'E': 'emb'}\n")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out2"), "--to", "native", "--sources",
                     str(py), "--keys", "E", "--quiet"]) == 0
    assert torch.equal(dcp_load.read_state_dict(tmp_path / "out2")["E"], t["emb"])


def test_sources_file_composed(tmp_path):
    """Concat/Stack/Slice are parsed into load's classes and the output shapes computed."""
    from dcp_load.conversion._sources import load_sources_file, map_outputs

    _write("native", tmp_path / "src")
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"fused": {"concat": ["layers.0.w", {"slice": "layers.1.w", "dim": 1, "start": 0,
                                                                  "stop": 48}], "dim": 0}}))
    sources = load_sources_file(spec)
    from dcp_reader import open_checkpoint

    with open_checkpoint(tmp_path / "src") as r:
        mapped = map_outputs(r.metadata, sources, None)
    assert mapped.tensors["fused"] == ((112, 48), "float32")
    assert "layers.0.w" not in mapped.tensors and "layers.1.w" not in mapped.tensors  # read by "fused"
    dcp_load.convert(tmp_path / "src", tmp_path / "out", sources=sources)
    t = _tensors()
    want = torch.cat([t["layers.0.w"], t["layers.1.w"][:, :48].float()])
    assert torch.equal(_read_hf(tmp_path / "out")["fused"], want)


@pytest.mark.parametrize("claims", ["parent", "worker"])
def test_a_failed_read_is_reported_and_cleaned_up(tmp_path, monkeypatch, claims):
    from dcp_load.conversion import _workers as _convert_workers

    _write("native", tmp_path / "src")
    victim = next((tmp_path / "src").glob("*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-64])  # truncated: a read fails
    if claims == "worker":  # this process claims nothing: the worker reads every file
        monkeypatch.setattr(_convert_workers, "claimer", lambda counter, n: lambda: None)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="convert worker failed" if claims == "worker" else "truncated") as err:
        dcp_load.convert(tmp_path / "src", tmp_path / "out", max_shard_bytes="8KB", workers=2)
    assert victim.name in str(err.value)
    assert time.monotonic() - t0 < 120
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch, caplog):
    import io
    import logging

    from dcp_load.conversion import _convert

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    real = _convert.Progress
    monkeypatch.setattr(_convert, "Progress", lambda *a, **k: real(*a, **k, stream=tty, delay_s=0.0))
    _write("native", tmp_path / "src")
    with caplog.at_level(logging.INFO, logger="dcp_load.conversion._convert"):
        dcp_load.convert(tmp_path / "src", tmp_path / "out", max_shard_bytes="8KB")
    assert "dcp convert [" in tty.getvalue() and "100%" in tty.getvalue()
    lines = [r.getMessage() for r in caplog.records if r.name == "dcp_load.conversion._convert"]
    assert not any(m.startswith("wrote ") for m in lines)  # the bar replaces the per-file lines
    assert any(m.startswith("converted ") for m in lines)  # the closing summary
