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

sys.path.insert(0, str(Path(__file__).parents[1] / "_support"))  # helpers shared by several areas
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
    server.faults.kind, server.faults.count, server.faults.hook = None, 0, None
    server.faults.select = s3_server.is_ranged_get


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
    # all complete may hold the bytes that did arrive (each response is copied into the
    # destination as it comes, never held whole). No byte holds anything else.
    for k, v in dst.items():
        raw, want = v.reshape(-1).view(torch.uint8), SOURCE[k].reshape(-1).view(torch.uint8)
        poison = poisoned()[k].reshape(-1).view(torch.uint8)
        assert bool(((raw == want) | (raw == poison)).all()), f"{k!r} holds bytes that are neither poison nor its value"


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


# -- consistency: deletes denied, objects replaced mid-read, Range ignored, racing writers ---

def _values(seed: float) -> dict[str, torch.Tensor]:
    return {"a": torch.arange(4096, dtype=torch.float32) + seed, "b": torch.full((33, 7), seed),
            "i": torch.arange(100) * int(seed + 1)}


def _loads_exactly(uri: str, want: dict[str, torch.Tensor]) -> None:
    import dcp_load

    dst = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, -7)
           for k, v in want.items()}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    for k, v in want.items():
        assert torch.equal(dst[k], v), k


def test_leftovers_that_cannot_be_deleted_after_the_commit_are_a_warning(proxy, caplog):
    """A bucket policy denies DeleteObject (403 to DELETE and to POST ?delete): the save
    that replaced the metadata succeeds, warns naming the leftovers, and loads; the next
    save with deletes allowed removes them."""
    import dcp_load
    from dcp_reader.storage import ObjectStorage

    uri = f"s3://{BUCKET}/nodelete"
    dcp_load.save(_values(1.0), checkpoint_id=uri, no_dist=True)
    old = {n for n in ObjectStorage(uri).list() if n != "dcp-metadata.json"}
    proxy.faults.kind, proxy.faults.count, proxy.faults.select = "denied", -1, s3_server.is_delete
    try:
        with caplog.at_level("WARNING", logger="dcp_reader"):
            dcp_load.save(_values(2.0), checkpoint_id=uri, no_dist=True)
    finally:
        proxy.faults.kind, proxy.faults.select = None, s3_server.is_ranged_get
    assert proxy.faults.injected >= 1, "no delete was denied: the test proves nothing"
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert all(n in warned for n in old) and "AccessDenied" in warned and uri in warned, warned
    assert old <= set(ObjectStorage(uri).list())
    _loads_exactly(uri, _values(2.0))
    dcp_load.save(_values(3.0), checkpoint_id=uri, no_dist=True)
    assert not old & set(ObjectStorage(uri).list())
    _loads_exactly(uri, _values(3.0))


def _replacing(upstream: str):
    def hook(method: str, path: str) -> None:
        s3_server.replace_object(upstream, path.split("?")[0])
    return hook


@pytest.mark.parametrize("server_pins", [True, False], ids=["if-match-honoured", "if-match-ignored"])
def test_an_object_replaced_between_gets_is_a_typed_error_naming_it(proxy, server_pins):
    """The object is replaced (same size, every byte inverted) just before one of the load's
    ranged GETs: the read fails with ObjectChangedError naming the object, whether the
    server answers the pinned GET with 412 or ignores If-Match (the response's ETag then
    differs); the destination holds no byte of the other version."""
    import dcp_load
    from dcp_reader.storage import ObjectStorage
    from safetensors.torch import save as st_save

    uri = f"s3://{BUCKET}/changing-{int(server_pins)}"
    ObjectStorage(uri).put("model.safetensors", [st_save(SOURCE)])
    proxy.faults.kind, proxy.faults.count, proxy.faults.hook = "hook", 1, _replacing(proxy.upstream)
    proxy.faults.select = _gets_of(uri) if server_pins else _then_drop_if_match(proxy.faults, uri)
    try:
        dst = poisoned()
        with pytest.raises(dcp_load.LoadError) as e:
            dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    finally:
        proxy.faults.hook, proxy.faults.select = None, s3_server.is_ranged_get
    msg = str(e.value)
    assert proxy.faults.injected >= 1
    assert "ObjectChangedError" in msg and f"{uri}/model.safetensors" in msg and "ETag" in msg, msg
    for k, v in dst.items():
        raw, want = v.reshape(-1).view(torch.uint8), SOURCE[k].reshape(-1).view(torch.uint8)
        poison = poisoned()[k].reshape(-1).view(torch.uint8)
        assert bool(((raw == want) | (raw == poison)).all()), f"{k!r} holds bytes of the replaced object"


def _gets_of(uri: str):
    """Selects the ranged GETs of objects under ``uri`` (not a late one of an earlier test)."""
    prefix = "/" + uri.removeprefix("s3://") + "/"
    return lambda method, path, headers: s3_server.is_ranged_get(method, path, headers) and path.startswith(prefix)


def _then_drop_if_match(faults: s3_server.Faults, uri: str):
    """Select the first ranged GET under ``uri`` for the hook, and every later one for
    "noifmatch"."""
    gets = _gets_of(uri)

    def select(method: str, path: str, headers) -> bool:
        if not gets(method, path, headers):
            return False
        if faults.kind == "hook":
            faults.kind, faults.count = "noifmatch", -1
            faults.hook(method, path)  # replaced now; this GET goes on without its If-Match
        return True
    return select


def test_a_server_that_ignores_range_is_a_permanent_error_at_once(proxy):
    from dcp_reader import StorageError, open_checkpoint

    proxy.faults.kind, proxy.faults.count = "norange", -1
    t0 = time.perf_counter()
    with pytest.raises(StorageError) as e:
        with open_checkpoint(f"s3://{BUCKET}/hf") as r:
            c = r.metadata.tensors["big"].chunks[0]
            r.read("big", c, (0, 0), (3072, 2048))
    took = time.perf_counter() - t0
    msg = str(e.value)
    assert proxy.faults.injected >= 1
    assert "Range" in msg and "206" in msg and f"s3://{BUCKET}/hf/model.safetensors" in msg, msg
    assert "retry later" not in msg and took < 3, (took, msg)


_RIVAL_SAVE = """
import sys, torch, dcp_load
dcp_load.save({"a": torch.arange(4096, dtype=torch.float32) + 9, "b": torch.full((33, 7), 9.0),
               "i": torch.arange(100) * 10}, checkpoint_id=sys.argv[1], no_dist=True)
"""


def _rival(uri: str, outcome: list[int]):
    """A hook that runs a whole second save into ``uri`` (another process) before the
    request it was selected for goes on: a second writer that wins the race to commit.
    Its exit status goes to ``outcome``."""
    def hook(method: str, path: str) -> None:
        done = subprocess.run([sys.executable, "-c", _RIVAL_SAVE, uri], env=os.environ.copy(), timeout=120)
        outcome.append(done.returncode)
    return hook


@pytest.mark.parametrize("first", [True, False], ids=["first-commit", "over-a-committed-one"])
def test_a_second_writer_racing_the_commit_makes_one_save_fail_typed(proxy, first):
    """Two saves into one prefix: the rival commits while this save's metadata PUT is on its
    way. This save fails (WriterLockError: another save committed), the rival's checkpoint
    is the committed one and loads exactly, and this save left no data object behind."""
    import dcp_load
    from dcp_reader.storage import ObjectStorage

    uri = f"s3://{BUCKET}/race-{int(first)}"
    if not first:
        dcp_load.save(_values(1.0), checkpoint_id=uri, no_dist=True)
    rival: list[int] = []
    proxy.faults.kind, proxy.faults.count = "hook", 1
    proxy.faults.select, proxy.faults.hook = s3_server.put_of("dcp-metadata.json"), _rival(uri, rival)
    try:  # the PUT waits for the rival's whole save: no stall timeout may cut it and send it again
        with s3_server.env({"DCP_STORAGE_STALL_TIMEOUT": "120"}), pytest.raises(dcp_load.LoadError) as e:
            dcp_load.save(_values(2.0), checkpoint_id=uri, no_dist=True)
    finally:
        proxy.faults.hook, proxy.faults.select = None, s3_server.is_ranged_get
    msg = str(e.value)
    assert proxy.faults.injected == 1 and rival == [0], rival
    assert "WriterLockError" in msg and "another save" in msg and uri in msg, msg
    _loads_exactly(uri, _values(9.0))
    data = [n for n in ObjectStorage(uri).list() if n.endswith(".safetensors")]
    assert len(data) == 1, data


def test_a_store_without_conditional_writes_is_named_and_can_be_told_to_skip_them(proxy):
    import dcp_load

    uri = f"s3://{BUCKET}/nocond"
    proxy.faults.kind, proxy.faults.count, proxy.faults.select = "nocond", -1, s3_server.is_conditional_put
    try:
        with pytest.raises(dcp_load.LoadError) as e:
            dcp_load.save(_values(1.0), checkpoint_id=uri, no_dist=True)
        msg = str(e.value)
        assert "conditional writes" in msg and "DCP_STORAGE_CONDITIONAL_WRITES" in msg and uri in msg, msg
        with s3_server.env({"DCP_STORAGE_CONDITIONAL_WRITES": "false"}):
            dcp_load.save(_values(1.0), checkpoint_id=uri, no_dist=True)
    finally:
        proxy.faults.kind, proxy.faults.select = None, s3_server.is_ranged_get
    _loads_exactly(uri, _values(1.0))


def test_deletes_denied_after_a_2_rank_commit_leave_every_rank_successful(proxy):
    """The multi-rank form of the warning above: both ranks' save returns (before, rank 0
    raised StorageAuthError and rank 1 LoadError for a committed save)."""
    import dcp_load
    import integ_s3_cases as cases
    from dcp_platform.testing import run_ranks

    uri = f"s3://{BUCKET}/nodelete-2"
    run_env = {**s3_server.s3_env(proxy.endpoint), **FAST_FAIL}
    assert run_ranks(cases.s3_save_outcome, 2, uri, 1.0, env=run_env, timeout=300) == ["ok", "ok"]
    proxy.faults.kind, proxy.faults.count, proxy.faults.select = "denied", -1, s3_server.is_delete
    try:
        outcome = run_ranks(cases.s3_save_outcome, 2, uri, 2.0, env=run_env, timeout=300)
    finally:
        proxy.faults.kind, proxy.faults.select = None, s3_server.is_ranged_get
    assert proxy.faults.injected >= 1 and outcome == ["ok", "ok"], outcome
    dst = {"a": torch.full((4096,), float("nan")), "b": torch.full((4096,), float("nan"))}
    dcp_load.load(dst, checkpoint_id=uri, no_dist=True)
    assert torch.equal(dst["a"], torch.arange(4096, dtype=torch.float32) + 2) and bool((dst["b"] == 2).all())
