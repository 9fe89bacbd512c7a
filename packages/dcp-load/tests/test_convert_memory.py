"""Peak anonymous memory of ``dcp convert`` does not grow with the model: converting a
1 GiB and a 4 GiB checkpoint (float32 Hugging Face shards into bfloat16 ones, so every
piece is cast) peaks within 32 MiB of each other, and under 128 MiB above the process's
baseline. Measured from /proc: the converting process's ``RssAnon`` sampled every 2 ms
(file-backed pages of the mapped output files are ``RssFile`` and do not count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

MIB = 1 << 20
ROWS, COLS = 4096, 4096  # 64 MiB per float32 tensor


def write_hf(path: Path, gib: int) -> None:
    """A float32 checkpoint of ``gib`` GiB in 1 GiB safetensors shards, written in 64 MiB
    pieces (never held whole)."""
    path.mkdir()
    per_file = (1 << 30) // (ROWS * COLS * 4)
    weight_map = {}
    block = np.random.default_rng(0).standard_normal(ROWS * COLS, dtype=np.float32).tobytes()
    for f in range(gib):
        name = f"part-{f}.safetensors"
        header, pos = {}, 0
        for i in range(per_file):
            key = f"layers.{f * per_file + i:03d}.weight"
            header[key] = {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [pos, pos + ROWS * COLS * 4]}
            weight_map[key] = name
            pos += ROWS * COLS * 4
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / name, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for _ in range(per_file):
                out.write(block)  # the values do not matter here, only the bytes moved
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# The child converts a tiny checkpoint first, so that the baseline includes what the first
# conversion imports (torch.distributed, safetensors: ~120 MiB, paid once per process).
CHILD = """
import os, sys, tempfile, torch, dcp_load
from safetensors.torch import save_file
with tempfile.TemporaryDirectory() as tmp:
    os.mkdir(os.path.join(tmp, "s"))
    save_file({"w": torch.ones(4, 4)}, os.path.join(tmp, "s", "model.safetensors"))
    dcp_load.convert(os.path.join(tmp, "s"), os.path.join(tmp, "d"), dtype="bfloat16")
print("READY", flush=True)
sys.stdin.readline()
dcp_load.convert(sys.argv[1], sys.argv[2], to="hf", dtype=(sys.argv[3:] or [None])[0], max_shard_bytes="1GB")
"""


def _rss_anon(pid: int) -> int:
    """Resident anonymous memory of ``pid``: ``RssAnon`` plus ``RssShmem`` (an anonymous
    shared mapping is counted there); not ``RssFile``, the mapped output files' pages."""
    total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def peak_extra_anon(src: Path, dst: Path, *extra: str) -> tuple[int, float]:
    """(peak anonymous memory during the conversion minus that after a warm-up conversion,
    seconds) of a child process converting ``src`` into ``dst``."""
    with subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(dst), *extra], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=os.environ) as proc:
        assert proc.stdout.readline().strip() == b"READY"
        base = _rss_anon(proc.pid)
        peak, stop = base, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                try:
                    peak = max(peak, _rss_anon(proc.pid))
                except OSError:
                    return
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=600) == 0
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
    return peak - base, seconds


@pytest.mark.slow
def test_peak_anonymous_memory_does_not_grow_with_the_model(tmp_path):
    peaks = {}
    for gib in (1, 4):
        src, dst = tmp_path / f"src{gib}", tmp_path / f"dst{gib}"
        write_hf(src, gib)
        peaks[gib], seconds = peak_extra_anon(src, dst, "bfloat16")
        print(f"{gib} GiB: peak extra anonymous memory {peaks[gib] / MIB:.1f} MiB, {seconds:.1f} s")
        assert sum(p.stat().st_size for p in dst.iterdir()) > gib * (1 << 29)  # bf16: half the bytes
        for p in (*src.iterdir(), *dst.iterdir()):
            p.unlink()
    assert abs(peaks[4] - peaks[1]) <= 32 * MIB, peaks
    assert max(peaks.values()) <= 128 * MIB, peaks
