"""``benchmarks/device/gpu_check.py --fake`` runs end to end on the CPU (the fake accelerator), so
that the script is known to run before it meets a GPU: every loader's values exact, the
fake accelerator's checks clean, the one-chip note printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_the_fake_accelerator(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device" / "gpu_check.py"), "--fake", "--no-cold",
                           "--size-gib", "0.01", "--save-gib", "0.005", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "one chip cannot run several NCCL ranks" in proc.stdout
    res = json.loads(out.read_text())
    loads = res["modes"]["warm (page cache)"]["loads"]
    assert loads["dcp"]["n_bad"] == 0 and loads["safetensors load_file(device)"]["n_bad"] == 0, loads
    assert res["save"]["dcp_values_bad"] == 0 and res["fake_violations"] == []
    assert res["save"]["dcp"]["blocked_s"] > 0
