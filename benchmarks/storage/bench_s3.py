"""Loading a ~1 GiB Hugging Face checkpoint from S3 on 4 ranks: dcp against torch DCP's
FsspecReader over s3fs and Run:ai Model Streamer, all in one run, through one proxy.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/storage/bench_s3.py
    python benchmarks/storage/bench_s3.py --gib 0.25 --skip-peers      # a smoke run (dcp only)
    python benchmarks/storage/bench_s3.py --concurrency 4,8,16,32      # dcp's GETs in flight, swept
    python benchmarks/storage/bench_s3.py --gib 0.25 --runs dcp:tp,torchdcp:tp   # column shards
    python benchmarks/storage/bench_s3.py --gib 0.25 --latency-ms 30,30 --bandwidth-mbs 40 \
        --runs dcp:one,runai:one,dcp:one,runai:one       # one process each, no process group

The S3 server is moto (``python -m moto.server``, its own process) on loopback; the
proxy (tests-integration/_support/s3_server.py, in this process) adds a per-request latency drawn
from 20-50 ms and caps each connection at ~100 MB/s, and counts GETs, bytes and the
requests in flight. The checkpoint is 32 MiB shards (moto copies a whole object for every
ranged GET, so its rate falls with the object size: measured 70 MiB/s at 64 MiB objects,
25 MiB/s at 256 MiB); torch DCP's copy is its own format of the same tensors (FsspecReader
cannot read safetensors), saved as files of the same size.

Layouts: DP4 (every rank wants every tensor whole), DP2 x TP2 (DTensors [Replicate,
Shard(0)]) and "tp": DP2 x TP2 as Megatron shards a Llama layer (o and down row-parallel:
[Replicate, Shard(1)], one short run per row in the file; the others Shard(0)). Run:ai reads every file on every rank whatever the layout (it has no sharding
outside its per-node CUDA mode), so it runs once. Reported per run: wall time (slowest
rank), GETs, bytes fetched / unique bytes, the most requests in flight, and two floors:
the network floor, bytes / (connections x per-connection bandwidth) + mean latency, and
the server floor, bytes / the server's own ceiling (measured first, without the proxy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests-integration" / "_support"))
sys.path.insert(0, str(HERE.parent))  # benchmarks/: harness/

import s3_server  # noqa: E402
from harness.cli import names, parser, write_json  # noqa: E402
from harness.s3 import BUCKET, MiB, model, server_ceiling, start_server, tensor, upload  # noqa: E402


# -- inside the ranks --------------------------------------------------------------------------
def rank_run(rank: int, world: int, tool: str, layout: str, spec: list[tuple[str, tuple[int, ...]]],
             files: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    phases: dict[str, float] = {}
    dist.barrier()
    t0 = time.perf_counter()
    if tool == "runai":
        n = _runai(files)
    else:
        state = _state(layout, spec)
        if tool == "dcp":
            import dcp_load

            phases = dict(dcp_load.load(state, checkpoint_id=f"s3://{BUCKET}/hf", timeout=900).seconds)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(state, storage_reader=FsspecReader(f"s3://{BUCKET}/torchdcp",
                                                        endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
        n = len(state)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if tool != "runai":
        _check(state, spec, rank)  # outside the timed part
    del torch
    return {"seconds": seconds, "tensors": n, "phases": phases}


def _state(layout: str, spec: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    import torch

    if layout == "dp4":
        return {n: torch.empty(s, dtype=torch.bfloat16) for n, s in spec}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {n: distribute_tensor(torch.empty(s, dtype=torch.bfloat16), mesh, [Replicate(), _tp_shard(layout, n, s)],
                                 src_data_rank=None) for n, s in spec}


def _tp_shard(layout: str, name: str, shape: tuple[int, ...]) -> Any:
    """The TP placement of ``name``: ``Shard(0)`` in "dp2tp2"; in "tp" Megatron's, where the
    row-parallel o and down are ``Shard(1)`` (column shards: one short run per row)."""
    from torch.distributed.tensor import Shard

    row_parallel = layout == "tp" and name.rsplit(".", 1)[-1] in ("o", "down") and len(shape) > 1
    return Shard(1 if row_parallel else 0)


def _check(state: dict[str, Any], spec: list[tuple[str, tuple[int, ...]]], rank: int) -> None:
    """A few tensors compared with their source (the whole check costs more than the load)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    shapes = dict(spec)
    for name in list(state)[rank::max(1, len(state) // 6)]:
        got = state[name]
        want = tensor(name, shapes[name])
        if isinstance(got, DTensor):
            want = distribute_tensor(want, got.device_mesh, list(got.placements), src_data_rank=None).to_local()
            got = got.to_local()
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"{name!r} holds wrong values")


def _processes(files: list[str], env: dict[str, str], count: int = 4, tool: str = "runai",
               spec: Any = ()) -> list[dict[str, Any]]:
    """``tool`` on ``count`` plain processes started together (no process group: Run:ai needs
    none; dcp as ``load(..., no_dist=True)``); each reports its time."""
    code = (f"import json, sys, time; sys.path.insert(0, {str(HERE)!r}); import bench_s3; "
            "a = json.loads(sys.argv[1]); t = time.perf_counter(); n = bench_s3._alone(*a); "
            "print(json.dumps({'seconds': time.perf_counter() - t, 'tensors': n, 'phases': {}}))")
    arg = json.dumps([tool, [[n, list(s)] for n, s in spec], files])
    procs = [subprocess.Popen([sys.executable, "-c", code, arg], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode != 0:
            errors = [ln for ln in stderr.splitlines() if "ERROR" in ln or "rror:" in ln]
            raise RuntimeError(f"{tool} process exited {p.returncode}: {' | '.join(errors[-4:])[-900:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _alone(tool: str, spec: list[list[Any]], files: list[str]) -> int:
    """One process without a process group: Run:ai streaming every file, or dcp's
    ``load(no_dist=True)`` into plain tensors, a few of them compared with their source
    (inside the timed part, a few ms)."""
    if tool == "runai":
        return _runai(files)
    import dcp_load
    import torch

    shapes = [(n, tuple(s)) for n, s in spec]
    state = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes}
    dcp_load.load(state, checkpoint_id=f"s3://{BUCKET}/hf", no_dist=True, timeout=900)
    for name, shape in shapes[::max(1, len(shapes) // 6)]:
        if not torch.equal(state[name].view(torch.int16), tensor(name, shape).view(torch.int16)):
            raise AssertionError(f"{name!r} holds wrong values")
    return len(state)


def _runai(files: list[str]) -> int:
    from runai_model_streamer import SafetensorsStreamer

    n = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"s3://{BUCKET}/hf/{f}" for f in files], device="cpu")
        for _, t in streamer.get_tensors():
            t.clone()  # the tensors are views of the streamer's buffer: keep a copy, as a loader must
            n += 1
    return n


# -- the run -----------------------------------------------------------------------------------
def measure(proxy: s3_server.FaultProxy, tool: str, layout: str, spec: Any, files: list[str], unique: int,
            env: dict[str, str], ceiling: float, latency: tuple[float, float], bandwidth: float) -> dict[str, Any]:
    from dcp_platform.testing import run_ranks

    proxy.faults.reset_counts()
    if layout == "one":  # one plain process, no process group
        per_rank = _processes(files, env, 1, tool, spec)
    elif tool == "runai":  # no collectives: 4 plain processes, each streaming every file
        per_rank = _processes(files, env)
    else:
        per_rank = run_ranks(rank_run, 4, tool, layout, spec, files, env=env, timeout=1800, pg_timeout=1500,
                             threads=1)
    f = proxy.faults
    seconds = max(r["seconds"] for r in per_rank)
    if per_rank[0]["phases"]:
        print("    rank 0 phases: " + ", ".join(f"{k} {v:.2f}" for k, v in per_rank[0]["phases"].items()), flush=True)
    conns = max(1, f.max_inflight)
    net_floor = f.get_bytes / (conns * bandwidth) + sum(latency) / 2
    server_floor = f.get_bytes / MiB / ceiling
    row = {"tool": tool, "layout": layout, "seconds": seconds, "gets": f.gets, "bytes": f.get_bytes,
           "bytes_ratio": f.get_bytes / unique, "max_inflight": f.max_inflight, "lists": f.lists,
           "net_floor_s": net_floor, "server_floor_s": server_floor,
           "vs_net_floor": seconds / net_floor, "vs_server_floor": seconds / server_floor}
    print(f"{tool:8s} {layout:7s} {seconds:7.2f} s  GETs {f.gets:5d}  bytes {f.get_bytes / unique:5.2f} x unique  "
          f"in flight <= {f.max_inflight:3d}  lists {f.lists}  floor: net {net_floor:6.2f} s "
          f"({seconds / net_floor:5.2f} x), server {server_floor:6.2f} s ({seconds / server_floor:5.2f} x)",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, first="paragraph")
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size (default 1 GiB)")
    p.add_argument("--shard-mib", type=int, default=32, help="safetensors shard size (default 32 MiB)")
    p.add_argument("--latency-ms", default="20,50", help="per-request latency range (default 20,50)")
    p.add_argument("--bandwidth-mbs", type=float, default=100.0, help="per-connection cap, MB/s (default 100)")
    p.add_argument("--concurrency", default="", help="dcp: sweep DCP_STORAGE_CONCURRENCY over these values")
    p.add_argument("--readers", default="", help="dcp: sweep DCP_STORAGE_READERS over these values")
    p.add_argument("--skip-peers", action="store_true", help="dcp only")
    p.add_argument("--runai-concurrency", type=int, default=4,
                   help="RUNAI_STREAMER_CONCURRENCY per process (default 4: at its default and at 8, 4 "
                        "processes overloaded moto and Run:ai failed with 'File access error' at 1 GiB)")
    p.add_argument("--runs", default="", help="only these tool:layout runs, e.g. dcp:dp4,runai:any")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    lo, hi = (float(x) / 1000 for x in args.latency_ms.split(","))
    bandwidth = args.bandwidth_mbs * 1e6
    proc, endpoint = start_server()
    rows: list[dict[str, Any]] = []
    try:
        s3_server.make_bucket(endpoint, BUCKET)
        spec = model(args.gib)
        with tempfile.TemporaryDirectory(prefix="bench-s3-") as work, s3_server.env(s3_server.s3_env(endpoint)):
            t0 = time.perf_counter()
            unique, files = upload(spec, args.shard_mib, work)
            print(f"checkpoint: {len(spec)} tensors, {unique / MiB:.0f} MiB in {len(files)} shards "
                  f"(uploaded in {time.perf_counter() - t0:.1f} s)", flush=True)
            ceiling = max(server_ceiling(files, c) for c in (16,))
            print(f"server ceiling (moto alone, 8 MiB GETs, 16 in flight): {ceiling:.0f} MiB/s", flush=True)
        faults = s3_server.Faults(latency_s=(lo, hi), bandwidth=bandwidth)
        with s3_server.FaultProxy(endpoint, faults) as proxy:
            env = _env(proxy, args.runai_concurrency)
            runs = [("dcp", "dp4"), ("dcp", "dp2tp2"), ("dcp", "tp")]
            if not args.skip_peers:
                runs += [("torchdcp", "dp4"), ("torchdcp", "dp2tp2"), ("torchdcp", "tp"), ("runai", "any")]
            if args.runs:
                runs = [tuple(r.split(":")) for r in names(args.runs)]
            for tool, layout in runs:
                try:
                    rows.append(measure(proxy, tool, layout, spec, files, unique, env, ceiling, (lo, hi), bandwidth))
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the others still run
                    print(f"{tool:8s} {layout:7s} FAILED: {str(e).strip().splitlines()[-1][:300]}", flush=True)
                    rows.append({"tool": tool, "layout": layout, "failed": str(e)[-2000:]})
            sweeps = [("DCP_STORAGE_CONCURRENCY", x) for x in names(args.concurrency)]
            sweeps += [("DCP_STORAGE_READERS", x) for x in names(args.readers)]
            for var, value in sweeps:
                print(f"  {var}={value}:", end=" ", flush=True)
                row = measure(proxy, "dcp", "dp4", spec, files, unique, {**env, var: value}, ceiling, (lo, hi),
                              bandwidth)
                row["concurrency"] = f"{var}={value}"
                rows.append(row)
        _ratios(rows)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    write_json(args.json, {"ceiling_mib_s": ceiling, "rows": rows})
    return 0


def _env(proxy: s3_server.FaultProxy, runai_concurrency: int) -> dict[str, str]:
    """The ranks' environment: the proxy's S3 endpoint and Run:ai's settings.

    RUNAI_STREAMER_DIST=0: with torch.distributed initialised Run:ai otherwise enters its
    distributed mode, which failed here on CPU ("File access error"); it is meant for CUDA
    (issue 21: each process reads everything outside that mode).
    """
    return {**s3_server.s3_env(proxy.endpoint), "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "RUNAI_STREAMER_DIST": "0", "RUNAI_STREAMER_CONCURRENCY": str(runai_concurrency),
            "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": "1",
            **{k: v for k, v in os.environ.items() if k.startswith("RUNAI_STREAMER_LOG")}}


def _ratios(rows: list[dict[str, Any]]) -> None:
    runs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if "concurrency" not in r and "seconds" in r:
            runs.setdefault((r["tool"], r["layout"]), []).append(r["seconds"])
    by = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}  # the median of repeated runs
    for layout in ("dp4", "dp2tp2", "tp", "one"):
        mine = by.get(("dcp", layout))
        runai = by.get(("runai", "one" if layout == "one" else "any"))
        if mine is None:
            continue
        parts = [f"dcp {layout}: {mine:.2f} s"]
        if ("torchdcp", layout) in by:
            parts.append(f"{mine / by[('torchdcp', layout)]:.2f} x torch DCP + fsspec")
        if runai:
            parts.append(f"{mine / runai:.2f} x Run:ai")
        print("; ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
