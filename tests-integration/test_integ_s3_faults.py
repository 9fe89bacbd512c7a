"""Object-store faults, injected by a proxy between the reader and a real S3 server on
loopback: 503 SlowDown, connection resets and bodies cut half way are retried and the
values come out exact; a stalled response is abandoned after the stall timeout and
retried, and one that never ends fails within the total timeout; a missing object names
its URI; refused credentials name the endpoint and the bucket; a save killed with SIGKILL
leaves no metadata object. On every error the destination holds its poison, untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (nox installs it)")
pytest.importorskip("obstore", reason="the S3 tests need obstore (nox installs it)")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import s3_server  # noqa: E402

BUCKET = "faults"
# 24 MiB + small tensors: the big one is read as three 8 MiB GETs
SOURCE = {"big": torch.randn(3072, 2048), "w": torch.randn(64, 33), "ints": torch.arange(1000),
          "half": torch.randn(16, 16).to(torch.bfloat16)}
FAST_FAIL = {"DCP_STORAGE_STALL_TIMEOUT": "1", "DCP_STORAGE_TOTAL_TIMEOUT": "6"}


@pytest.fixture(scope="module")
def server():
    srv, endpoint = s3_server.start_moto()
    try:
        s3_server.make_bucket(endpoint, BUCKET)
        with s3_server.FaultProxy(endpoint) as proxy, s3_server.env({**s3_server.s3_env(proxy.endpoint), **FAST_FAIL}):
            import dcp_load

            dcp_load.save(SOURCE, checkpoint_id=f"s3://{BUCKET}/native", no_dist=True)
            from dcp_reader.storage import ObjectStorage
            from safetensors.torch import save as st_save

            ObjectStorage(f"s3://{BUCKET}/hf").put("model.safetensors", [st_save(SOURCE)])
            yield proxy
    finally:
        srv.stop()


@pytest.fixture
def proxy(server):
    server.faults.kind, server.faults.count = None, 0
    server.faults.reset_counts()
    yield server
    server.faults.kind, server.faults.count = None, 0


def poisoned() -> dict[str, torch.Tensor]:
    return {k: (torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, -7))
            for k, v in SOURCE.items()}


def exact(dst: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(dst[k].view(torch.uint8) if dst[k].dim() else dst[k], SOURCE[k].view(torch.uint8)
                           if SOURCE[k].dim() else SOURCE[k]) for k in SOURCE)


def untouched(dst: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isnan(v.float()).all()) if v.is_floating_point() else bool((v == -7).all())
               for v in dst.values())


@pytest.mark.parametrize("kind", ["slowdown", "reset", "cut"])
@pytest.mark.parametrize("fmt", ["native", "hf"])
def test_transient_faults_are_retried_and_values_are_exact(proxy, kind, fmt):
    import dcp_load

    proxy.faults.kind, proxy.faults.count = kind, 4
    dst = poisoned()
    dcp_load.load(dst, checkpoint_id=f"s3://{BUCKET}/{fmt}", no_dist=True)
    assert proxy.faults.injected == 4, "the faults were not hit: the test proves nothing"
    assert exact(dst)


def test_a_stalled_response_is_abandoned_after_the_stall_timeout_and_retried(proxy):
    import dcp_load

    proxy.faults.kind, proxy.faults.count, proxy.faults.stall_s = "stall", 2, 60.0
    dst = poisoned()
    t0 = time.perf_counter()
    dcp_load.load(dst, checkpoint_id=f"s3://{BUCKET}/native", no_dist=True)
    assert proxy.faults.injected == 2 and exact(dst)
    assert time.perf_counter() - t0 < 30, "a stall was not cut by DCP_STORAGE_STALL_TIMEOUT=1"


def test_a_response_that_never_ends_fails_within_the_total_timeout(proxy):
    import dcp_load

    proxy.faults.kind, proxy.faults.count, proxy.faults.stall_s = "stall", -1, 120.0
    dst = poisoned()
    t0 = time.perf_counter()
    with pytest.raises(dcp_load.LoadError) as e:
        dcp_load.load(dst, checkpoint_id=f"s3://{BUCKET}/hf", no_dist=True)
    took = time.perf_counter() - t0
    assert "StorageError" in str(e.value) and f"s3://{BUCKET}/hf/model.safetensors" in str(e.value)
    assert took < 40, f"took {took:.1f} s with DCP_STORAGE_TOTAL_TIMEOUT=6"
    # Found while reading data (phase "execute") or before it: a piece read before the
    # stall (the small tensors lie in the header's first 64 KiB, which an earlier open of
    # the same object may have cached) holds its exact values; a piece whose GETs did not
    # all complete is not written at all. No byte holds anything else.
    for k, v in dst.items():
        raw, want = v.reshape(-1).view(torch.uint8), SOURCE[k].reshape(-1).view(torch.uint8)
        poison = poisoned()[k].reshape(-1).view(torch.uint8)
        assert bool(((raw == want) | (raw == poison)).all()), f"{k!r} holds bytes that are neither poison nor its value"
    assert untouched({"big": dst["big"]}), "a piece whose GETs failed was written"


def test_persistent_slowdown_is_a_storage_error_naming_the_object(proxy):
    from dcp_reader import StorageError, open_checkpoint

    with open_checkpoint(f"s3://{BUCKET}/hf") as r:
        proxy.faults.kind, proxy.faults.count = "slowdown", -1
        c = r.metadata.tensors["big"].chunks[0]
        t0 = time.perf_counter()
        with pytest.raises(StorageError) as e:
            r.read("big", c, (0, 0), (3072, 2048))
    assert time.perf_counter() - t0 < 30
    msg = str(e.value)
    assert f"s3://{BUCKET}/hf/model.safetensors" in msg and "SlowDown" in msg and "retry later" in msg, msg


def test_a_missing_object_names_its_uri(proxy):
    import dcp_load
    from dcp_reader import MissingFileError, MissingMetadataError, open_checkpoint
    from dcp_reader.storage import ObjectStorage

    uri = f"s3://{BUCKET}/missing"
    dcp_load.save(SOURCE, checkpoint_id=uri, no_dist=True)
    store = ObjectStorage(uri)
    [data] = [n for n in store.list() if n.endswith(".safetensors")]
    store.delete(data)
    with pytest.raises(MissingFileError) as e:
        open_checkpoint(uri)
    assert data in str(e.value) and uri in str(e.value)
    dst = poisoned()
    with pytest.raises(dcp_load.LoadError) as le:
        dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert "MissingFileError" in str(le.value) and untouched(dst)
    with pytest.raises(MissingMetadataError) as e:
        open_checkpoint(f"s3://{BUCKET}/nothing-here")
    assert f"s3://{BUCKET}/nothing-here" in str(e.value)


def test_wrong_credentials_name_the_endpoint_and_the_bucket(proxy):
    import dcp_load
    from dcp_reader import StorageAuthError, open_checkpoint

    with s3_server.env({"AWS_ACCESS_KEY_ID": s3_server.BAD_KEY}):
        with pytest.raises(StorageAuthError) as e:
            open_checkpoint(f"s3://{BUCKET}/hf")
        msg = str(e.value)
        assert proxy.endpoint in msg and repr(BUCKET) in msg and "AWS_ACCESS_KEY_ID" in msg
        assert "Traceback" not in msg and len(msg) < 1200
        dst = poisoned()
        with pytest.raises(dcp_load.LoadError) as le:
            dcp_load.load(dst, checkpoint_id=f"s3://{BUCKET}/native", no_dist=True)
        assert "StorageAuthError" in str(le.value) and untouched(dst)


_KILLED_SAVE = """
import torch, dcp_load
dcp_load.save({"big": torch.ones(8192, 4096), "w": torch.ones(3)}, checkpoint_id=%r, no_dist=True)
"""


def test_a_save_killed_mid_upload_leaves_the_committed_checkpoint(proxy):
    import dcp_load
    from dcp_reader import open_checkpoint
    from dcp_reader.storage import ObjectStorage

    uri = f"s3://{BUCKET}/killed"
    dcp_load.save({"w": torch.zeros(3)}, checkpoint_id=uri, no_dist=True)  # an older, committed save
    assert "dcp-metadata.json" in ObjectStorage(uri).list()
    proxy.faults.bandwidth = 8e6  # 128 MiB at 8 MB/s per connection: the upload takes seconds
    try:
        child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE % uri], env=os.environ.copy())
        deadline = time.monotonic() + 120
        while proxy.faults.requests < 8 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # HEAD/DELETE of the old metadata, then the upload's first parts
        time.sleep(1.0)
        assert child.poll() is None, "the save finished before it could be killed"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        proxy.faults.bandwidth = 0.0
    # The new save's data objects carry its own save id and its metadata goes up last, in one
    # PUT: the committed checkpoint is untouched and loads its own values.
    names = ObjectStorage(uri).list()
    assert "dcp-metadata.json" in names, names
    with open_checkpoint(uri) as r:
        assert sorted(r.metadata.tensors) == ["w"]
    dst = {"w": torch.full((3,), float("nan"))}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert torch.equal(dst["w"], torch.zeros(3))
    # The next save removes the killed one's leftovers.
    dcp_load.save({"w": torch.ones(3)}, checkpoint_id=uri, no_dist=True)
    left = sorted(ObjectStorage(uri).list())
    assert len([n for n in left if n.endswith(".safetensors")]) == 1, left
