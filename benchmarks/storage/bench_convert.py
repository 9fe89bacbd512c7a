"""Offline conversion of a torch DCP checkpoint (FSDP, 4 ranks) into Hugging Face bfloat16
shards: ``dcp convert`` with 1 and 2 workers against what users script with torch
(``dcp_to_torch_save``, then ``torch.load`` and ``safetensors.torch.save_file`` per shard),
side by side in one run, at ~1 GiB and ~4 GiB of float32.

Each method runs in a fresh child process that imports what it needs and converts a tiny
checkpoint first (one-time import costs: torch.distributed, safetensors), then waits; the
parent samples the anonymous memory (``RssAnon + RssShmem`` from ``/proc/PID/status``) of
the child and of its descendants (the workers) every 2 ms, and reports the peak of their
sum above the child's own value at the start. File-backed pages (the mapped output files,
the page cache) are not counted. The source is read into the page cache before each
method (warm), and ``sync`` runs between methods. ``dcp convert`` fsyncs its files before
it names them; the torch path's ``torch.save`` and ``save_file`` do not. Every output is
checked: the two dcp outputs byte for byte, the torch path's tensor by tensor.

Run from the repository root (~10 GB of disk under --workdir, removed at the end unless
``--keep``):

    python benchmarks/storage/bench_convert.py [--sizes 1,4] [--workdir /tmp/dcp-convert-bench]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import ints, names, parser, write_json  # noqa: E402
from harness.common import GiB, MiB, ModelSpec, spec_nbytes, warm_files, write_hf_checkpoint  # noqa: E402
from harness.fsdp import write_fsdp_checkpoint  # noqa: E402
from harness.launch import Launcher  # noqa: E402

SHARD = "500MB"  # 2 files at 1 GiB, 5 at 4 GiB: both workers have files
MEMORY_GOAL = 128 * MiB
TIME_GOAL = 0.7


def spec_for(gib: int) -> ModelSpec:
    """A float32 Llama-like model of about ``gib`` GiB (embeddings and lm_head: 0.49 GiB,
    0.17 GiB per layer)."""
    layers = {1: 3, 4: 21}.get(gib) or max(1, round((gib * GiB / 4 - 2 * 32000 * 2048) / 45_088_768))
    return ModelSpec(layers=layers, dtype="float32", file_bytes=512 * MiB)


# -- the child: one method, measured from outside ---------------------------------------------
CHILD = r"""
import json, math, os, sys, tempfile, time
import torch
method, src, dst = sys.argv[1:4]
LIMIT = int(sys.argv[4])

def torch_path(src, dst, limit):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import save_file
    tmp = dst + ".pt"
    dcp_to_torch_save(src, tmp)
    sd = torch.load(tmp, weights_only=True)
    os.makedirs(dst)
    names = sorted(sd)
    groups, size = [[]], 0
    for n in names:
        nb = sd[n].numel() * 2
        if groups[-1] and size + nb > limit:
            groups.append([]); size = 0
        groups[-1].append(n); size += nb
    weight_map, total = {}, 0
    for i, g in enumerate(groups):
        f = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: sd[n].to(torch.bfloat16) for n in g}, os.path.join(dst, f), metadata={"format": "pt"})
        for n in g:
            weight_map[n] = f; total += sd[n].numel() * 2
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    os.unlink(tmp)

def run(src, dst):
    if method == "torch":
        torch_path(src, dst, LIMIT)
    else:
        import dcp_load
        dcp_load.convert(src, dst, to="hf", dtype="bfloat16", max_shard_bytes=LIMIT,
                         workers=int(method.split("-w")[1]))

with tempfile.TemporaryDirectory() as tmp:  # warm-up: the imports a conversion makes
    import torch.distributed.checkpoint as tdcp, warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"w": torch.ones(8, 8)}, checkpoint_id=os.path.join(tmp, "s"), no_dist=True)
    if method == "torch":
        torch_path(os.path.join(tmp, "s"), os.path.join(tmp, "d"), 10**9)
    else:
        import dcp_load
        dcp_load.convert(os.path.join(tmp, "s"), os.path.join(tmp, "d"), dtype="bfloat16")
print("READY", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
run(src, dst)
print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""


def _anon_kib(pid: int) -> int:
    """Proportional anonymous memory of ``pid`` (``Pss_Anon + Pss_Shmem``): pages a worker
    shares with the fork server it came from count once over them, not once per process."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(line.split()[1])
    return total


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:  # children of every thread (a process may start them from any)
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return out


def measure(method: str, src: Path, dst: Path) -> dict[str, float]:
    """Run ``method`` in a child; (seconds, peak extra anonymous bytes of its process tree)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    from dcp_load.conversion._layout import parse_size

    with subprocess.Popen([sys.executable, "-c", CHILD, method, str(src), str(dst), str(parse_size(SHARD))],
                          stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env, text=True) as proc:
        assert proc.stdout.readline().strip() == "READY", f"{method}: the child did not start"
        base = _anon_kib(proc.pid)
        peak, stop = base, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                total = 0
                for p in _tree(proc.pid):
                    try:
                        total += _anon_kib(p)
                    except OSError:
                        pass
                peak = max(peak, total)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        if proc.wait(timeout=600) != 0 or not line:
            raise RuntimeError(f"{method} failed (exit {proc.returncode})")
    return {"seconds": json.loads(line)["seconds"], "wall_s": wall, "extra_anon": (peak - base) * 1024,
            "base_anon": base * 1024}


def check_same(a: Path, b: Path, exact: bool) -> int:
    """Tensors compared (byte for byte when ``exact``: every file identical)."""
    import torch
    from safetensors import safe_open

    ia = json.loads((a / "model.safetensors.index.json").read_text())
    ib = json.loads((b / "model.safetensors.index.json").read_text())
    assert ia == ib or not exact, "indexes differ"
    assert sorted(ia["weight_map"]) == sorted(ib["weight_map"]), "tensor names differ"
    if exact:
        for f in sorted(set(ia["weight_map"].values())):
            assert _same_file(a / f, b / f), f
        return len(ia["weight_map"])
    for name, f in ia["weight_map"].items():
        with safe_open(str(a / f), "pt") as x, safe_open(str(b / ib["weight_map"][name]), "pt") as y:
            assert torch.equal(x.get_tensor(name), y.get_tensor(name)), name
    return len(ia["weight_map"])


def _same_file(x: Path, y: Path, block: int = 64 * MiB) -> bool:
    with open(x, "rb") as fx, open(y, "rb") as fy:
        while True:
            bx, by = fx.read(block), fy.read(block)
            if bx != by:
                return False
            if not bx:
                return True


def main() -> None:
    ap = parser(__doc__, workdir="/tmp/dcp-convert-bench", json_help="also write the rows here")
    ap.add_argument("--sizes", default="1,4", help="checkpoint sizes in GiB of float32")
    ap.add_argument("--methods", default="dcp-w1,dcp-w2,torch")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints for another run")
    args = ap.parse_args()
    work = Path(args.workdir)
    launcher = Launcher()
    rows = []
    try:
        for gib in ints(args.sizes):
            spec = spec_for(gib)
            hf, fsdp = work / f"hf-{gib}", work / f"fsdp4-{gib}"
            write_hf_checkpoint(hf, spec)
            write_fsdp_checkpoint(launcher, hf, fsdp, spec, 1800)
            if not args.keep:
                shutil.rmtree(hf)  # only the torch DCP checkpoint is converted
            nbytes = spec_nbytes(spec)
            print(f"== {nbytes / GiB:.2f} GiB float32 torch DCP checkpoint (FSDP, 4 ranks), {len(spec.tensors())} "
                  f"tensors -> HF bfloat16 shards of {SHARD}", flush=True)
            outs = {}
            for method in names(args.methods):
                dst = work / f"out-{gib}-{method}"
                shutil.rmtree(dst, ignore_errors=True)
                os.sync()
                warm_files(fsdp)
                r = measure(method, fsdp, dst)
                outs[method] = dst
                row = {"gib": gib, "bytes": nbytes, "method": method, **r}
                rows.append(row)
                print(f"{method:7s} {r['seconds']:7.2f} s  peak extra anonymous memory {r['extra_anon'] / MiB:8.1f} MiB",
                      flush=True)
            if "dcp-w1" in outs and "dcp-w2" in outs:
                n = check_same(outs["dcp-w1"], outs["dcp-w2"], exact=True)
                print(f"dcp-w1 and dcp-w2: {n} tensors, every file identical")
            if "dcp-w1" in outs and "torch" in outs:
                n = check_same(outs["dcp-w1"], outs["torch"], exact=False)
                print(f"dcp-w1 and torch: {n} tensors equal")
            by = {r["method"]: r for r in rows if r["gib"] == gib}
            if "torch" in by:
                for m in ("dcp-w1", "dcp-w2"):
                    if m in by:
                        print(f"{m} / torch: time {by[m]['seconds'] / by['torch']['seconds']:.2f}x "
                              f"(goal <= {TIME_GOAL}), peak extra anon {by[m]['extra_anon'] / MiB:.1f} MiB "
                              f"vs {by['torch']['extra_anon'] / MiB:.1f} MiB (goal <= {MEMORY_GOAL / MiB:.0f} MiB)")
            for d in outs.values():
                shutil.rmtree(d, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(fsdp, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
