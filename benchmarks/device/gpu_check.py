"""The accelerator check: one process, one GPU, every figure of the device path in one run.

    PYTHONPATH=packages/dcp-platform/src:packages/dcp-reader/src:packages/dcp-broadcast/src:packages/dcp-load/src \\
        python benchmarks/device/gpu_check.py                       # 8 GiB, CUDA (H200: < 8 min)
    ... python benchmarks/device/gpu_check.py --fake --size-gib 0.06   # on CPU, the fake accelerator

It writes an 8 GiB bf16 Hugging Face checkpoint (64 MiB tensors, 2 GiB shards) itself,
then, with a warm page cache and a cold one (``drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` on each file, and labelled so), measures side by side:

* the read bandwidth of the files (``READ_THREADS`` threads, 16 MiB preads into host
  buffers) and the pinned host-to-device bandwidth, in this run;
* dcp's load into preallocated CUDA destinations, against
  ``safetensors.torch.load_file(device="cuda")``, torch DCP's load (its
  ``HuggingFaceStorageReader``) into CUDA tensors, and fastsafetensors (``nogds=True``)
  when it imports; every load's values compared with the source on the GPU, and the GPU
  memory each one allocated beyond the source and destinations;
* ``async_save`` of CUDA tensors (``--save-gib``): dcp's blocking time against torch DCP's
  ``async_save`` with a pinned, blocking stager, and against the plain D2H copy of the
  same bytes into pinned memory (second call of each: the first allocates pinned memory).

Goals: load >= 0.8 x min(read, pinned H2D), faster than every peer; async_save
blocking <= 1.2 x the D2H copy. ``--json PATH`` writes every figure. ``--fake`` runs the
same code on CPU against ``dcp_platform.testing.FakeAccelerator`` (device memory is host
memory), so the script itself can be checked without a GPU; its figures mean nothing.

What the fake cannot check. It runs every copy late, so the CPU tests
(packages/dcp-load/tests/test_device_waits.py, packages/dcp-platform/tests/test_device_copies.py,
tests-integration/device/test_integ_device.py) see a missing ring wait, stream synchronize, cast
ordering, broadcast ordering or async_save staging wait as wrong values: each was removed
from the sources in turn and failed them. On CUDA it leaves unverified:

* ``DeviceCopies.begin`` (the copy stream after the caller's current stream, for loads and
  for async_save's staging): the fake's current stream is the host, so removing it fails
  no CPU test. ``benchmarks/device/gpu_waits.py`` checks it, with the ring wait, the load's
  ``finish`` and staging's wait, on one GPU (results/gpu.md);
* ``DeviceLoad.publish`` as NCCL sees it (the broadcast's stream after the copy event,
  device-side): the fake orders by a host wait; it needs two GPUs;
* engines of two devices in one process (``cuda:0`` and ``cuda:1`` destinations of one load);
* this script's own figures: bandwidths, the pinned ring's overlap, GPU memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
READ_THREADS = 4  # dcp reads on min(4, torch threads) threads in one process
PIECE = 16 * MiB


class Env:
    """The device: CUDA, or the fake accelerator (``--fake``)."""

    def __init__(self, fake: bool):
        import torch

        self.torch, self.fake = torch, None
        if fake:
            from dcp_platform.testing import FakeAccelerator

            self.fake = FakeAccelerator(max_delay_s=0.0)
            self.device, self.platform = "cpu", self.fake.platform()
            self.engine = self.fake.engine
        else:
            if not torch.cuda.is_available():
                sys.exit("gpu_check: no CUDA device visible to torch (use --fake to check the script on CPU)")
            from dcp_platform import get_platform

            self.device = f"cuda:{torch.cuda.current_device()}"
            self.platform = get_platform("torch")
            self.engine = self.platform.device_copies(self.device)
            if self.engine is None:
                sys.exit(f"gpu_check: the torch platform has no copy engine for {self.device} (no pinned memory?)")

    def empty(self, shape: Any, dtype: Any) -> Any:
        if self.fake is not None:
            return self.fake.empty(shape, dtype)
        return self.torch.empty(shape, dtype=dtype, device=self.device)

    def sync(self) -> None:
        if self.fake is None:
            self.torch.cuda.synchronize()
        else:
            self.engine.finish()

    def reset_peak(self) -> int:
        if self.fake is not None:
            return 0
        self.sync()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak_over(self, base: int) -> int:
        return 0 if self.fake is not None else self.torch.cuda.max_memory_allocated() - base

    def describe(self) -> str:
        t = self.torch
        if self.fake is not None:
            return f"FAKE accelerator (host memory), torch {t.__version__}"
        p = t.cuda.get_device_properties(self.device)
        return f"{p.name}, {p.total_memory / GiB:.0f} GiB, torch {t.__version__}, CUDA {t.version.cuda}"


def make_source(env: Env, size: int, rows: int, cols: int) -> dict[str, Any]:
    """bf16 tensors of rows x cols on the device, ``size`` bytes in all, seeded."""
    torch = env.torch
    g = torch.Generator(device="cpu" if env.fake else env.device).manual_seed(0)
    n = max(1, size // (rows * cols * 2))
    out = {}
    for i in range(n):
        t = torch.randn(rows, cols, generator=g, device="cpu" if env.fake else env.device).to(torch.bfloat16)
        out[f"model.layers.{i}.weight"] = env.fake.to_device(t) if env.fake else t
    return out


def write_hf(src: dict[str, Any], path: Path, shard_bytes: int) -> list[Path]:
    """The tensors as an HF checkpoint (shards + model.safetensors.index.json), synced."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = [{}]
    for k, v in src.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + v.nbytes > shard_bytes:
            shards.append({})
        shards[-1][k] = v.cpu()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.sync()
    return [path / n for n in names]


def drop_cache(files: list[Path]) -> str:
    """Drop the files from the page cache: ``drop_caches`` as root, else fadvise."""
    os.sync()
    if os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def read_bandwidth(files: list[Path]) -> float:
    """Bytes per second reading ``files`` with ``READ_THREADS`` threads of 16 MiB preads."""
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, PIECE)]

    def work(k: int) -> int:
        buf, total = bytearray(PIECE), 0
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        try:
            for f, off in jobs[k::READ_THREADS]:
                fd = fds.setdefault(f, os.open(f, os.O_RDONLY))
                total += os.preadv(fd, [view], off)
        finally:
            for fd in fds.values():
                os.close(fd)
        return total

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        total = sum(pool.map(work, range(READ_THREADS)))
    return total / (time.perf_counter() - t0)


def copy_bandwidth(env: Env, nbytes: int, to_device: bool) -> float:
    """Pinned host <-> device bytes per second: one ``nbytes`` copy, best of 3."""
    torch = env.torch
    host = env.engine.host_buffer(nbytes)
    dev = env.empty((nbytes,), torch.uint8)
    best = float("inf")
    for _ in range(3):
        env.sync()
        t0 = time.perf_counter()
        if to_device:
            env.engine.wait_event(env.engine.to_device(dev, host))
        else:
            env.engine.wait_event(env.engine.to_host(host, dev))
        env.sync()
        best = min(best, time.perf_counter() - t0)
    env.engine.give_back(host)
    del dev
    return nbytes / best


def _poisoned(env: Env, src: dict[str, Any]) -> dict[str, Any]:
    out = {k: env.empty(v.shape, v.dtype) for k, v in src.items()}
    for v in out.values():
        v.fill_(float("nan"))
    env.sync()
    return out


def load_dcp(env: Env, src: dict[str, Any], hf: Path, files: list[Path]) -> dict[str, Any]:
    import dcp_load

    dst = _poisoned(env, src)
    t0 = time.perf_counter()
    dcp_load.load(dst, checkpoint_id=str(hf), no_dist=True, platform=env.platform)
    env.sync()
    return {"seconds": time.perf_counter() - t0, "out": dst}


def load_safetensors(env: Env, src: dict[str, Any], hf: Path, files: list[Path]) -> dict[str, Any]:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(f), device=env.device))
    env.sync()
    return {"seconds": time.perf_counter() - t0, "out": out}


def load_torch_dcp(env: Env, src: dict[str, Any], hf: Path, files: list[Path]) -> dict[str, Any]:
    import torch.distributed.checkpoint as tdcp

    dst = _poisoned(env, src)
    t0 = time.perf_counter()
    tdcp.load(dst, storage_reader=tdcp.HuggingFaceStorageReader(str(hf)), no_dist=True)
    env.sync()
    return {"seconds": time.perf_counter() - t0, "out": dst}


def load_fastsafetensors(env: Env, src: dict[str, Any], hf: Path, files: list[Path]) -> dict[str, Any]:
    from fastsafetensors import ParallelLoader  # as benchmarks/harness/loaders.py calls it

    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    loader = ParallelLoader(None, [str(f) for f in files], nogds=True, use_tqdm_on_load=False, device=env.device,
                            set_numa=False, accumulate_resident=False)
    try:
        for k, tensor in loader.iterate_weights():
            out[k] = tensor.clone()  # the loader's buffers go at close
    finally:
        loader.close()
    env.sync()
    return {"seconds": time.perf_counter() - t0, "out": out}


LOADERS = {"dcp": load_dcp, "safetensors load_file(device)": load_safetensors,
           "torch DCP (HF reader)": load_torch_dcp, "fastsafetensors (nogds)": load_fastsafetensors}


def check_values(src: dict[str, Any], out: dict[str, Any]) -> list[str]:
    """Keys whose loaded tensor is missing or not bit-equal to the source."""
    torch = sys.modules["torch"]
    return [k for k, v in src.items()
            if k not in out or out[k].dtype != v.dtype or not torch.equal(out[k].view(torch.int16),
                                                                          v.view(torch.int16))]


def run_loader(env: Env, name: str, src: dict[str, Any], hf: Path, files: list[Path], cold: bool) -> dict[str, Any]:
    """One timed load (the page cache dropped first when ``cold``), values checked."""
    base = env.reset_peak()
    if cold:
        drop_cache(files)
    try:
        got = LOADERS[name](env, src, hf, files)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the run goes on
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out = got.pop("out")
    bad = check_values(src, out)
    nbytes = sum(v.nbytes for v in src.values())
    extra = env.peak_over(base)  # destinations included: the checkpoint's bytes, then each loader's own
    del out
    return {"seconds": got["seconds"], "bps": nbytes / got["seconds"], "bad": bad[:5], "n_bad": len(bad),
            "gpu_peak_extra": extra}


def d2h_seconds(env: Env, tensors: dict[str, Any]) -> float:
    """The plain D2H copy of ``tensors`` into one preallocated pinned buffer, best of 2."""
    torch = env.torch
    total = sum(v.nbytes for v in tensors.values())
    host = env.engine.host_buffer(total)
    best = float("inf")
    for _ in range(2):
        env.sync()
        t0 = time.perf_counter()
        env.engine.begin()
        pos, last = 0, None
        for v in tensors.values():
            last = env.engine.to_host(host[pos:pos + v.nbytes].view(v.dtype).view(v.shape), v)
            pos += v.nbytes
        env.engine.wait_event(last)
        best = min(best, time.perf_counter() - t0)
    env.engine.give_back(host)
    del torch
    return best


def save_dcp(env: Env, sd: dict[str, Any], path: Path) -> tuple[float, float]:
    import dcp_load

    t0 = time.perf_counter()
    fut = dcp_load.async_save(sd, checkpoint_id=str(path), no_dist=True, platform=env.platform)
    blocked = time.perf_counter() - t0
    fut.result()
    return blocked, time.perf_counter() - t0


def save_torch(env: Env, sd: dict[str, Any], path: Path, stager: Any) -> tuple[float, float]:
    import torch.distributed.checkpoint as tdcp

    t0 = time.perf_counter()
    fut = tdcp.async_save(sd, checkpoint_id=str(path), async_stager=stager, no_dist=True)
    blocked = time.perf_counter() - t0
    done = getattr(fut, "upload_completion", fut)
    done.result()
    return blocked, time.perf_counter() - t0


def torch_stager(device: bool) -> Any:
    """torch DCP's stager with pinned memory, staging before async_save returns (so that
    its blocking time, like dcp's, is the time until the snapshot is safe); on the fake
    accelerator (no CUDA) plain memory and blocking copies, which torch requires there."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=device, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=device))


def run_saves(env: Env, src: dict[str, Any], save_bytes: int, work: Path) -> dict[str, Any]:
    """async_save of device tensors: dcp against torch DCP and the D2H copy (second calls)."""
    import dcp_load

    sd, total = {}, 0
    for k, v in src.items():
        if total + v.nbytes > save_bytes and sd:
            break
        sd[k], total = v, total + v.nbytes
    out: dict[str, Any] = {"bytes": total, "d2h_s": d2h_seconds(env, sd)}
    for label, call in (("dcp", lambda p: save_dcp(env, sd, p)), ("torch DCP", None)):
        try:
            if call is None:
                stager = torch_stager(env.fake is None)
                call = lambda p, s=stager: save_torch(env, sd, p, s)  # noqa: E731
            runs = [call(work / f"save-{label.replace(' ', '_')}-{i}") for i in range(2)]
            out[label] = {"blocked_s": runs[1][0], "total_s": runs[1][1], "first_blocked_s": runs[0][0]}
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            out[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    back = _poisoned(env, sd)
    dcp_load.load(back, checkpoint_id=str(work / "save-dcp-1"), no_dist=True, platform=env.platform)
    env.sync()
    out["dcp_values_bad"] = len(check_values(sd, back))
    dcp_load.release_staging()
    return out


def _gbps(x: float) -> str:
    return f"{x / 1e9:7.2f}"


def print_loads(res: dict[str, Any]) -> list[str]:
    """The load table; the goal lines it decides."""
    goals = []
    print(f"\n{'load into device':<30} {'mode':<22} {'GB/s':>7} {'s':>7} {'x bound':>8} {'x dcp':>6} "
          f"{'GPU peak+ GiB':>13}  values")
    for mode, m in res["modes"].items():
        bound = min(m["read_bps"], res["h2d_bps"])
        print(f"{'  read bandwidth':<30} {mode:<22} {_gbps(m['read_bps'])}")
        dcp = m["loads"]["dcp"].get("bps")
        for name, r in m["loads"].items():
            if "error" in r:
                print(f"{name:<30} {mode:<22} {'-':>7}  {r['error']}")
                continue
            vals = "exact" if not r["n_bad"] else f"{r['n_bad']} WRONG: {r['bad']}"
            print(f"{name:<30} {mode:<22} {_gbps(r['bps'])} {r['seconds']:7.2f} {r['bps'] / bound:8.2f} "
                  f"{(dcp or 0) and r['bps'] / dcp:6.2f} {r['gpu_peak_extra'] / GiB:13.2f}  {vals}")
        if dcp:
            peers = [r["bps"] for n, r in m["loads"].items() if n != "dcp" and "bps" in r]
            goals.append(f"{mode}: dcp {dcp / bound:.2f} x min(read, H2D) (goal >= 0.8): "
                         f"{'MET' if dcp >= 0.8 * bound else 'NOT MET'}; faster than every peer: "
                         f"{'MET' if all(dcp > p for p in peers) else 'NOT MET'}")
    return goals


def print_saves(s: dict[str, Any]) -> list[str]:
    print(f"\nasync_save of {s['bytes'] / GiB:.2f} GiB of device tensors (second call; D2H copy "
          f"{s['d2h_s']:.3f} s = {_gbps(s['bytes'] / s['d2h_s'])} GB/s)")
    print(f"{'':<12} {'blocking s':>10} {'x D2H':>6} {'total s':>8} {'first call blocking s':>22}")
    for label in ("dcp", "torch DCP"):
        r = s[label]
        if "error" in r:
            print(f"{label:<12} {r['error']}")
            continue
        print(f"{label:<12} {r['blocked_s']:10.3f} {r['blocked_s'] / s['d2h_s']:6.2f} {r['total_s']:8.3f} "
              f"{r['first_blocked_s']:22.3f}")
    print(f"dcp async_save values loaded back: {'exact' if not s['dcp_values_bad'] else 'WRONG'}")
    r = s["dcp"]
    if "error" in r:
        return ["async_save: dcp failed"]
    return [f"async_save blocking {r['blocked_s'] / s['d2h_s']:.2f} x the D2H copy (goal <= 1.2): "
            f"{'MET' if r['blocked_s'] <= 1.2 * s['d2h_s'] else 'NOT MET'}"]


def measure(env: Env, args: Any, work: Path) -> dict[str, Any]:
    rows, cols = (8192, 4096) if not args.fake else (256, 512)
    t0 = time.perf_counter()
    src = make_source(env, int(args.size_gib * GiB), rows, cols)
    hf = work / "hf"
    files = write_hf(src, hf, max(PIECE, int(args.shard_gib * GiB)))
    nbytes = sum(v.nbytes for v in src.values())
    print(f"checkpoint: {len(src)} bf16 tensors, {nbytes / GiB:.2f} GiB in {len(files)} files, "
          f"written in {time.perf_counter() - t0:.1f} s", flush=True)
    res: dict[str, Any] = {"bytes": nbytes, "device": env.describe(), "modes": {}}
    res["h2d_bps"] = copy_bandwidth(env, min(GiB, nbytes), True)
    res["d2h_bps"] = copy_bandwidth(env, min(GiB, nbytes), False)
    print(f"pinned H2D {_gbps(res['h2d_bps'])} GB/s, D2H {_gbps(res['d2h_bps'])} GB/s", flush=True)
    modes = ["warm"] + ([] if args.no_cold else ["cold"])
    for mode in modes:
        cold = mode == "cold"
        how = drop_cache(files) if cold else "page cache"
        label = f"{mode} ({how})"
        m: dict[str, Any] = {"read_bps": read_bandwidth(files), "loads": {}}
        for name in LOADERS:
            if name.startswith("fastsafetensors") and not _importable("fastsafetensors"):
                m["loads"][name] = {"error": "not importable here"}
                continue
            tries = [run_loader(env, name, src, hf, files, cold) for _ in range(1 if cold else 2)]
            m["loads"][name] = min(tries, key=lambda r: r.get("seconds", float("inf")))
            print(f"  {label}: {name}: {m['loads'][name].get('seconds', m['loads'][name].get('error'))}", flush=True)
        res["modes"][label] = m
    res["save"] = run_saves(env, src, int(args.save_gib * GiB), work)
    return res


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=8.0, help="checkpoint size (default 8)")
    ap.add_argument("--shard-gib", type=float, default=2.0, help="bytes per safetensors file")
    ap.add_argument("--save-gib", type=float, default=4.0, help="bytes of device tensors async_save writes")
    ap.add_argument("--workdir", default=None, help="where files go (default: a temporary folder, removed)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold page cache runs")
    ap.add_argument("--fake", action="store_true", help="CPU and the fake accelerator: checks the script only")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    env = Env(args.fake)
    print(f"device: {env.describe()}")
    print("one chip cannot run several NCCL ranks (NCCL refuses two ranks on one GPU): this check measures one "
          "process on one GPU; broadcasts of device buffers are covered by the fake-accelerator tests on gloo ranks")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dcp-gpu-check-"))
    try:
        res = measure(env, args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    goals = print_loads(res) + print_saves(res["save"])
    print("\ngoals:" + "".join(f"\n  {g}" for g in goals))
    if args.fake:
        print("  (FAKE accelerator: figures check the script, not a device)")
        res["fake_violations"] = list(env.fake.violations)
        print(f"  fake accelerator violations: {env.fake.violations or 'none'}")
    res["seconds"] = time.perf_counter() - start
    print(f"gpu_check: {res['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    bad = any(r.get("n_bad") for m in res["modes"].values() for r in m["loads"].values() if "n_bad" in r)
    return 1 if bad or res["save"]["dcp_values_bad"] or res.get("fake_violations") else 0


if __name__ == "__main__":
    sys.exit(main())
