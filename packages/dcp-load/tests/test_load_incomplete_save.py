"""A native save killed before its first commit leaves its temporary data files
(``rank-*.tmp-PID``) and the writer's lock, and no metadata: ``load`` and ``dcp inspect``
say it is an incomplete native save, naming the directory, the files and what to do
(before: "no checkpoint found ... Check the path"). The save is a real one, in a child
process whose data file's final rename never happens, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

_SAVER = """
import os, sys, time
import torch
import dcp_load
real = os.replace
def stuck(src, dst, *a, **k):  # the data file is written; its rename, then the commit, never come
    if ".tmp-" in os.fspath(src):
        print("written", flush=True)
        time.sleep(600)
    return real(src, dst, *a, **k)
os.replace = stuck
dcp_load.save({"w": torch.arange(64.0)}, checkpoint_id=sys.argv[1], no_dist=True)
"""


@pytest.fixture()
def killed_save(tmp_path):
    path = tmp_path / "step-1"
    with subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout.readline().strip() == "written"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
    names = sorted(os.listdir(path))
    assert any(".safetensors.tmp-" in n for n in names) and ".dcp-save.lock" in names, names
    return str(path)


def test_load_says_the_save_did_not_commit(killed_save) -> None:
    import dcp_load

    state = {"w": torch.full((64,), float("nan"))}
    with pytest.raises(dcp_load.LoadError) as info:
        dcp_load.load(state, checkpoint_id=killed_save, no_dist=True)
    text = str(info.value)
    assert os.path.realpath(killed_save) in text and "incomplete native checkpoint" in text, text
    assert ".safetensors.tmp-" in text and "Re-run the save into this directory" in text, text
    assert "MissingMetadataError" in text and "no checkpoint found" not in text
    assert torch.isnan(state["w"]).all()


def test_inspect_says_the_same(killed_save, capsys) -> None:
    from dcp_load.cli._main import main

    start = time.monotonic()
    assert main(["inspect", killed_save]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "incomplete native checkpoint" in err, err
    assert time.monotonic() - start < 30
