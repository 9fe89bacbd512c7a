"""Peak memory of ``s3://`` loads does not grow with the tensor: a checkpoint of one 256 MiB
tensor and one of 64 tensors of 1 MiB, loaded from a real S3 server on loopback (moto) into
destinations allocated before the measurement, each peak within 64 MiB of the process's
baseline. Each response is copied into the destination as it arrives; before that, every
GET body of a piece was held until the whole piece had arrived (a 256 MiB tensor cost
256 MiB more). Measured from /proc: the loading child's ``RssAnon`` + ``RssShmem``,
sampled every 2 ms from the loaded message on, against the value after a warm-up load (the
imports and the client)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
sys.path.insert(0, str(Path(__file__).parent))
import s3_server  # noqa: E402

MIB = 1 << 20
BUCKET = "memory"
BOUND = 64 * MIB  # 16 GETs in flight x 1 MiB pieces, plus the client's buffers, with room


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5 + seed


# The child loads a tiny checkpoint first, so that the baseline includes what the first load
# imports and the object-store client; the destination is allocated and poisoned before it.
CHILD = """
import sys, torch, dcp_load
shapes = [int(x) for x in sys.argv[2].split(",")]
dst = {f"t{i}": torch.full((n,), float("nan")) for i, n in enumerate(shapes)}
dcp_load.load({"w": torch.zeros(4)}, checkpoint_id=sys.argv[1] + "-warm", no_dist=True)
print("READY", flush=True)
sys.stdin.readline()
dcp_load.load(dst, checkpoint_id=sys.argv[1], no_dist=True)
print("LOADED", flush=True)
sys.stdin.readline()
for i, n in enumerate(shapes):
    want = torch.arange(n, dtype=torch.float32) * 0.5 + i
    assert torch.equal(dst[f"t{i}"], want), f"t{i}"
print("EXACT", flush=True)
"""


def _rss_anon(pid: int) -> int:
    total = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def _peak_extra(uri: str, shapes: list[int]) -> tuple[int, float]:
    """(peak anonymous memory of a child loading ``uri`` minus its baseline, seconds)."""
    with subprocess.Popen([sys.executable, "-c", CHILD, uri, ",".join(map(str, shapes))], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=os.environ.copy()) as proc:
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
        assert proc.stdout.readline().strip() == b"LOADED"
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
        proc.stdin.write(b"check\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"EXACT"
        assert proc.wait(timeout=120) == 0
    return peak - base, seconds


@pytest.fixture(scope="module")
def s3():
    server, endpoint = s3_server.start_moto()
    try:
        s3_server.make_bucket(endpoint, BUCKET)
        with s3_server.env(s3_server.s3_env(endpoint)):
            yield endpoint
    finally:
        server.stop()


def _upload(uri: str, shapes: list[int]) -> None:
    from dcp_reader.storage import ObjectStorage
    from safetensors.torch import save as st_save

    ObjectStorage(uri + "-warm").put("model.safetensors", [st_save({"w": torch.ones(4)})])
    ObjectStorage(uri).put("model.safetensors", [st_save({f"t{i}": _pattern(n, i) for i, n in enumerate(shapes)})])


@pytest.mark.slow
@pytest.mark.parametrize("shapes", [[64 * MIB], [MIB // 4] * 64], ids=["one-256MiB", "64x1MiB"])
def test_peak_memory_of_an_s3_load_is_bounded_whatever_the_tensor_size(s3, shapes):
    uri = f"s3://{BUCKET}/n{len(shapes)}"
    _upload(uri, shapes)
    extra, seconds = _peak_extra(uri, shapes)
    print(f"{len(shapes)} tensor(s), {sum(shapes) * 4 / MIB:.0f} MiB: peak extra anonymous memory "
          f"{extra / MIB:.1f} MiB, {seconds:.1f} s")
    assert extra <= BOUND, f"{extra / MIB:.1f} MiB above the baseline (bound {BOUND / MIB:.0f} MiB)"
