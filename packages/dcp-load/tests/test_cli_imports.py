"""What the ``dcp`` command imports: ``--version``, ``inspect`` and ``verify`` run in a fresh
interpreter and import neither torch nor NumPy (nor the dcp packages they do not use) for
native, Hugging Face and torch DCP checkpoints (each ``dcp`` command imported torch through
``dcp_load/__init__``: seconds before it printed anything); ``dcp verify`` prints the time
the user waited beside the checking time. The start time itself is measured by
``benchmarks/bench_cli_start.py``, not here."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import dcp_load
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

#: Runs ``dcp ARGS`` as the console script does, then prints on stderr, as JSON, the
#: exit status and which of the heavy modules got imported.
PROBE = """
import json, sys
from dcp_load.cli._main import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = ("torch", "numpy", "safetensors", "obstore", "dcp_platform", "dcp_broadcast")
sys.stderr.write("PROBE " + json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}) + "\\n")
"""


def _dcp(*argv: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE ")]
    assert lines, f"dcp {' '.join(argv)} ended without the probe's line: {proc.stderr[-2000:]}"
    return json.loads(lines[-1][len("PROBE "):]), proc.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-imports")
    native, hf, tdcp = root / "native", root / "hf", root / "tdcp"
    dcp_load.save({"a": torch.randn(300, 64), "b": torch.arange(10), "step": 3, "cfg": {"lr": 0.1}},
                  checkpoint_id=native, no_dist=True)
    hf.mkdir()
    save_file({f"w{i}": torch.randn(8, 8) for i in range(3)}, str(hf / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save({"w": torch.ones(4, 4), "step": 3}, checkpoint_id=str(tdcp))
    return {"native": str(native), "hf": str(hf), "torch-dcp": str(tdcp)}


def test_version_imports_no_package(checkpoints) -> None:
    probe, out = _dcp("--version")
    assert probe == {"code": 0, "imported": []}, probe
    assert out.splitlines()[0] == f"dcp-load {dcp_load.__version__}"
    assert len(out.splitlines()) == 4, out


@pytest.mark.parametrize("kind", ["native", "hf", "torch-dcp"])
def test_verify_imports_neither_torch_nor_numpy(checkpoints, kind) -> None:
    probe, out = _dcp("verify", checkpoints[kind])
    assert probe == {"code": 0, "imported": []}, (probe, out)
    assert f"format {kind}" in out and "OK" in out, out


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("chunks", [False, True])
def test_inspect_imports_neither_torch_nor_numpy(checkpoints, kind, chunks) -> None:
    probe, out = _dcp("inspect", checkpoints[kind], *(["--chunks"] if chunks else []))
    assert probe == {"code": 0, "imported": []}, (probe, out)
    assert f"format {kind}" in out, out
    if kind == "native":  # its values are JSON in the metadata: shown without torch
        values = {" ".join(line.split()) for line in out.splitlines()}
        assert {"step value 3", "cfg.lr value 0.1"} <= values, out


def test_verify_prints_the_wait_and_the_checking(checkpoints) -> None:
    _, out = _dcp("verify", checkpoints["native"])
    tail = out.strip().rsplit(" in ", 1)[1]  # "0.21 s (0.01 s checking)"
    waited, checking = float(tail.split(" s (")[0]), float(tail.split("(")[1].split(" s checking")[0])
    assert tail.endswith(" s checking)") and waited >= checking >= 0, out


def test_public_names_import_on_first_use() -> None:
    """``import dcp_load`` alone imports no torch; a public name brings in what it needs."""
    code = ("import sys, dcp_load, dcp_reader; before = 'torch' in sys.modules; "
            "from dcp_load import transfer, async_save, LoadError; from dcp_reader import open_checkpoint; "
            "print(before, 'torch' in sys.modules, transfer.__module__, sorted(set(dcp_load.__all__) - set(dir(dcp_load))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "True", "dcp_load.transferring._transfer", "[]"], out
