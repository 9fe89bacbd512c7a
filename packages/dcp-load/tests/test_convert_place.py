"""Where ``convert`` lands: a destination that became non-empty while converting is left
untouched (the file created in it survives); a second conversion into one destination is
refused at once with ``WriterLockError`` naming the first, and a killed one leaves no stale
lock; ``--overwrite`` swaps the new directory in (and still does where the kernel cannot
exchange two paths); an ``s3://`` destination is refused before anything is read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import dcp_load
import pytest
import torch
from dcp_load.cli._main import main as cli_main
from dcp_reader import WriterLockError
from safetensors.torch import save_file


def _src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file({f"t{i}": torch.full((300,), float(i)) for i in range(4)}, str(src / "model.safetensors"))
    return src


def _values(path: Path) -> dict[str, float]:
    return {k: float(v[0]) for k, v in dcp_load.read_state_dict(path).items()}


def test_a_destination_that_became_non_empty_is_left_untouched(tmp_path, monkeypatch):
    from dcp_load.conversion import _fill

    src, dst = _src(tmp_path), tmp_path / "dst"
    real = _fill.fill_file

    def meanwhile(*args, **kwargs):  # someone else writes into DST while the files fill
        dst.mkdir(exist_ok=True)
        (dst / "theirs.txt").write_text("keep me")
        return real(*args, **kwargs)

    monkeypatch.setattr(_fill, "fill_file", meanwhile)
    with pytest.raises(FileExistsError, match=r"became non-empty during the conversion \(1 entries, e.g. "
                                              r"'theirs.txt'\); it is left untouched"):
        dcp_load.convert(src, dst, max_shard_bytes="1KB")
    assert [p.name for p in dst.iterdir()] == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporary, no lock left


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_replaces_the_old_destination_whole(tmp_path, monkeypatch, exchange):
    from dcp_load.conversion import _place

    if not exchange:  # a kernel or filesystem without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(_place, "_exchange", lambda a, b: False)
    src, dst = _src(tmp_path), tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    dcp_load.convert(src, dst, overwrite=True, max_shard_bytes="1KB")
    assert _values(dst) == {f"t{i}": float(i) for i in range(4)} and not (dst / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_a_second_conversion_into_one_destination_is_refused(tmp_path, capsys):
    src, dst = _src(tmp_path), tmp_path / "dst"
    # the first conversion stops after filling its first file, holding DST's lock
    script = textwrap.dedent(f"""
        import time
        import dcp_load.conversion._fill as fill
        real = fill.fill_file
        def slow(*a, **k):
            r = real(*a, **k)
            print("FILLED", flush=True)
            time.sleep(120)
            return r
        fill.fill_file = slow
        import dcp_load
        dcp_load.convert({str(src)!r}, {str(dst)!r}, max_shard_bytes="1KB")
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=os.environ) as first:
        try:
            assert first.stdout.readline().strip() == b"FILLED"
            with pytest.raises(WriterLockError, match=rf"dst '{dst}' is being written by another conversion "
                                                      rf"\(pid {first.pid} on host"):
                dcp_load.convert(src, dst)
            assert cli_main(["convert", str(src), str(dst), "--to", "hf", "--quiet"]) == 2
            assert "WriterLockError" in capsys.readouterr().err
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
    for p in tmp_path.glob(".dst.dcp-convert-*"):  # the killed run's temporary directory
        import shutil

        shutil.rmtree(p)
    dcp_load.convert(src, dst, max_shard_bytes="1KB")  # the dead holder's lock is gone with it
    assert _values(dst) == {f"t{i}": float(i) for i in range(4)}


def test_an_object_storage_destination_is_refused_at_once(tmp_path, capsys):
    src = _src(tmp_path)
    code = cli_main(["convert", str(src), "s3://bucket/out", "--to", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "dst 's3://bucket/out' is not a local directory" in err and "upload it" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert not Path("s3:").exists()


@pytest.mark.parametrize("length", [200, 255])
def test_a_long_valid_destination_name_converts(tmp_path, length):
    """A DST name of up to 255 bytes is valid; the lock and temporary names beside it must
    not exceed the limit (they failed with ENAMETOOLONG naming the temporary path)."""
    src = _src(tmp_path)
    dst = tmp_path / ("d" * length)
    dcp_load.convert(str(src), str(dst), to="native")
    # the new name is left as asked, nothing else beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src", dst.name])
    loaded = dcp_load.read_state_dict(str(dst))
    assert all(torch.equal(loaded[f"t{i}"], torch.full((300,), float(i))) for i in range(4))
