"""Run the dcp load benchmarks side by side with torch.distributed.checkpoint.

    python benchmarks/run_all.py                  # every scenario, 3 repeats (~25-30 min here)
    python benchmarks/run_all.py --quick          # small sizes, 1 repeat: a smoke run
    python benchmarks/run_all.py --scenarios replicated --layouts dp4 --modes warm

Scenarios: replicated (1a warm, 1b simulated multi-node cold, 1c cold on one host, and 4
peak memory, sampled in the same runs; layouts include the resharding case fsdp4-dp2tp2),
throttled (6: simulated nodes cold under a block-I/O read cap B, per-node link and shared
file system; skipped with the reason where the cgroup v1 blkio throttle is unavailable),
small (2: 2000 x 16 KiB tensors, DP4), single (3: one process, 1 GiB),
plan (5: the global plan for 1024 and 4096 simulated ranks, no processes),
checksums (the cost of verifying block checksums in a whole warm load of a 1 GiB native
checkpoint: one process, DP2 and DP4; the report's "Checksum cost" section).

Results go to bench-results/<UTC time>.json (and bench-results/latest.json); the report
(every number computed from the results; its sections are the files of benchmarks/results/,
its figures those of BENCHMARKS.md's tables) is printed and written to
bench-results/<UTC time>.md; plots go to benchmarks/plots/*.png.
Checkpoints are written under --workdir and deleted at the end unless --keep is given.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# harness/, and the areas whose scripts a full run imports (their rank functions travel by these names).
sys.path[:0] = [str(HERE), str(HERE / "load"), str(HERE / "storage")]

import bench_checksums  # noqa: E402
import bench_load_plan  # noqa: E402
import bench_load_replicated  # noqa: E402
import bench_load_single  # noqa: E402
import bench_load_small  # noqa: E402
import bench_load_throttled  # noqa: E402
from harness.cli import RANK_TIMEOUT_S, ints, names, stamped, write_json  # noqa: E402
from harness.common import MiB, can_drop_caches  # noqa: E402
from harness.launch import Launcher  # noqa: E402
from harness.throttle import parse_bps  # noqa: E402

SCENARIOS = {
    "replicated": bench_load_replicated,
    "throttled": bench_load_throttled,
    "small": bench_load_small,
    "single": bench_load_single,
    "plan": bench_load_plan,
    "checksums": bench_checksums,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and 1 repeat (smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per measurement (default 3; 1 with --quick)")
    ap.add_argument("--scenarios", default="replicated,throttled,small,single,plan,checksums",
                    help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--layouts", default="dp4,dp2tp2,dp4tp2,fsdp4-dp2tp2",
                    help=f"replicated layouts: {','.join(bench_load_replicated.LAYOUTS)}")
    ap.add_argument("--modes", default="warm,cold,coldhost",
                    help="replicated modes: warm (one host), coldhost (one host, cache dropped), "
                         "cold (simulated nodes, a copy each, cache dropped)")
    ap.add_argument("--methods", default="dcp,dcp-reread,dcp-auto,torch",
                    help="methods in the warm mode: dcp (broadcast, batch --batch-bytes), dcp-64k, "
                         "dcp-reread, dcp-auto (load()'s default), torch")
    ap.add_argument("--coldhost-methods", default="dcp,dcp-reread",
                    help="methods in coldhost mode (add torch to compare it there too)")
    ap.add_argument("--cold-methods", default="dcp,dcp-auto,torch,fastsafetensors",
                    help="methods in the simulated multi-node cold mode (dcp-reread there reads "
                         "what torch DCP reads; left out by default to keep a full run short)")
    ap.add_argument("--throttle-bps", default="100M,400M",
                    help="throttled scenario: read caps B, comma-separated (M = MiB/s, G = GiB/s)")
    ap.add_argument("--throttle-layouts", default="dp4,dp2tp2",
                    help="throttled scenario: layouts (each cap x both storage models x methods)")
    ap.add_argument("--throttle-methods", default="dcp-auto,torch,fastsafetensors",
                    help="throttled scenario: methods")
    ap.add_argument("--throttle-repeats", type=int, default=1,
                    help="throttled scenario: repeats (default 1: the cap makes times steady, and "
                         "torch DCP at 100 MiB/s shared takes ~45 s per DP4 load)")
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="ranks per simulated node in cold runs (default: the TP size)")
    ap.add_argument("--batch-bytes", type=int, default=6 * MiB, help="dcp broadcast_batch_bytes")
    ap.add_argument("--plan-ranks", default="1024,4096", help="world sizes for the plan scenario")
    ap.add_argument("--workdir", default="/tmp/dcp-bench", help="where checkpoints are written")
    ap.add_argument("--out", default=None, help="results folder (default <repo>/bench-results)")
    ap.add_argument("--plots", default=str(HERE / "plots"), help="folder for the PNG plots ('' = none)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    ap.add_argument("--verify-all", action="store_true",
                    help="check loaded values after every run (default: the first repeat only)")
    ap.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S, help="seconds per multi-rank run")
    a = ap.parse_args(argv)
    for key in ("scenarios", "layouts", "modes", "methods", "cold_methods", "coldhost_methods",
                "throttle_layouts", "throttle_methods"):
        setattr(a, key, names(getattr(a, key)))
    a.plan_ranks = ints(a.plan_ranks)
    try:
        a.throttle_bps = [parse_bps(s) for s in names(a.throttle_bps)]
    except ValueError as e:
        ap.error(str(e))
    _check(ap, a)
    return a


def _check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every name given is known and the repeats are positive, else ``ap.error`` says which."""
    for s in a.scenarios:
        if s not in SCENARIOS:
            ap.error(f"--scenarios: unknown {s!r}; choose from {','.join(SCENARIOS)}")
    for s in a.layouts + a.throttle_layouts:
        if s not in bench_load_replicated.LAYOUTS:
            ap.error(f"--layouts: unknown {s!r}; choose from {','.join(bench_load_replicated.LAYOUTS)}")
    for s in a.modes:
        if s not in ("warm", "coldhost", "cold"):
            ap.error(f"--modes: unknown {s!r}; choose from warm,coldhost,cold")
    for s in a.methods + a.cold_methods + a.coldhost_methods + a.throttle_methods:
        if s not in bench_load_replicated.METHODS:
            ap.error(f"--methods: unknown {s!r}; choose from {','.join(bench_load_replicated.METHODS)}")
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.repeats < 1 or a.throttle_repeats < 1:
        ap.error(f"--repeats and --throttle-repeats must be >= 1, got {a.repeats}, {a.throttle_repeats}")


def machine() -> dict[str, Any]:
    import safetensors
    import torch

    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    mem = sh("awk '/MemTotal/ {print $2}' /proc/meminfo")
    try:
        import dcp_load
        dcp_version = getattr(dcp_load, "__version__", "?")
    except ImportError:
        dcp_version = None
    return {
        "cpus": os.cpu_count(), "cpu_model": sh("awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo"),
        "mem_gib": round(int(mem) / 2**20, 1) if mem else None, "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__,
        "safetensors": safetensors.__version__, "dcp_load": dcp_version,
        "peers": {p: _version(p) for p in bench_load_replicated.PEERS},
        "disk": sh("df -h --output=source,size,fstype / | tail -1"),
        "git": sh(f"git -C {HERE.parent} rev-parse --short HEAD"),
        "loadavg_start": sh("cat /proc/loadavg"),
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out_dir = Path(args.out) if args.out else HERE.parent / "bench-results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    start = time.perf_counter()
    log = stamped(7)

    if any(s in args.scenarios for s in ("replicated", "throttled", "single")) and not can_drop_caches():
        log("cannot write /proc/sys/vm/drop_caches (not root?): cold runs evict the checkpoint "
            "files with posix_fadvise(POSIX_FADV_DONTNEED) instead (recorded per run as 'drop')")
    results: dict[str, Any] = {"machine": machine(), "argv": sys.argv[1:], "stamp": stamp,
                               "args": dict(vars(args))}
    log(f"machine: {results['machine']}")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    args.launcher = Launcher()
    try:
        for name in args.scenarios:
            t = time.perf_counter()
            log(f"scenario {name}")
            results[name] = SCENARIOS[name].run(args, log)
            results[name]["elapsed_s"] = time.perf_counter() - t
            _write(out_dir, stamp, results)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    results["elapsed_s"] = time.perf_counter() - start
    results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    from harness import report

    md = report.render(results)
    print("\n" + md)
    (out_dir / f"{stamp}.md").write_text(md)  # the report of this run (benchmarks/results/)
    (out_dir / "latest.md").write_text(md)
    _write(out_dir, stamp, results)
    if args.plots:
        try:
            from harness import plot
        except ImportError as e:  # matplotlib missing: say so, the numbers are still written
            log(f"no plots: {e}")
        else:
            for p in plot.plot(results, Path(args.plots)):
                log(f"plot {p}")
    log(f"results: {out_dir / (stamp + '.json')}")
    return 0


def _write(out_dir: Path, stamp: str, results: dict[str, Any]) -> None:
    for name in (f"{stamp}.json", "latest.json"):
        write_json(out_dir / name, results)


if __name__ == "__main__":
    sys.exit(main())
