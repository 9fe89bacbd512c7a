"""dcp-reader benchmark (not a test): reading a ~1 GiB multi-file Hugging Face checkpoint
into preallocated tensors with CheckpointReader.read + copy_, against
safetensors.torch.load_file + copy_, side by side in one process, warm page cache.

safetensors 0.8's load_file memory-maps by default (tensors are lazy views, like the
reader's), so a third column times load_file(backend="pread"), which reads whole files.
A last line gives the fixed cost of one small read against indexing
safe_open(...).get_slice(key) directly. Three cases: whole tensors, the first half of every tensor along dim 0, and the first half
along dim 1. Each repetition runs the methods one after the other; the best of the repetitions
(robust to a busy shared machine) and the ratio (other time / reader time) are printed. The checkpoint is written to a
temporary directory under /tmp and deleted afterwards.

    .venv/bin/python benchmarks/bench_reader.py [--gib 1.0] [--files 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
from dcp_reader import open_checkpoint
from safetensors.torch import load_file, save_file

MiB = 1024 * 1024


def write_checkpoint(root: str, gib: float, files: int) -> dict[str, tuple[int, int]]:
    """bf16 weights of 4096 x 4096 (32 MiB) plus a 4096-element norm per weight, spread over
    ``files`` shards with an index, as Hugging Face writes them."""
    import json

    n_weights = max(files, round(gib * 1024 / 32))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n_weights):
        shapes[f"layers.{i}.weight"] = (4096, 4096)
        shapes[f"layers.{i}.norm"] = (4096,)
    names = list(shapes)
    per_file = -(-len(names) // files)
    weight_map = {}
    for f in range(files):
        part = names[f * per_file:(f + 1) * per_file]
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        # distinct constant per tensor: cheap to make, and the copy cost does not depend on values
        save_file({n: torch.full(shapes[n], float(names.index(n)), dtype=torch.bfloat16) for n in part},
                  os.path.join(root, fname))
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(root, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return shapes


def boxes(shapes, case: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    out = {}
    for name, shape in shapes.items():
        sizes = list(shape)
        if case == "dim0-half":
            sizes[0] = shape[0] // 2
        elif case == "dim1-half" and len(shape) > 1:
            sizes[1] = shape[1] // 2
        out[name] = ((0,) * len(shape), tuple(sizes))
    return out


def with_reader(root: str, want, dst) -> int:
    with open_checkpoint(root) as r:
        for name, (offs, sizes) in want.items():
            chunk = r.metadata.tensors[name].chunks[0]
            dst[name].copy_(r.read(name, chunk, offs, sizes))
        return r.bytes_read


def with_load_file(root: str, want, dst, backend: str = "mmap") -> None:
    for fname in sorted(f for f in os.listdir(root) if f.endswith(".safetensors")):
        sd = load_file(os.path.join(root, fname), backend=backend)
        for name, t in sd.items():
            offs, sizes = want[name]
            dst[name].copy_(t[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))])
        del sd


def per_read_overhead(root: str, shapes, n: int = 3000) -> None:
    """Fixed cost of one small read (a 2 x 2 box): what dominates checkpoints of many small
    tensors. CheckpointReader.read against indexing safetensors' get_slice directly."""
    from safetensors import safe_open

    name = next(iter(shapes))
    fname = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))[0]
    with open_checkpoint(root) as r:
        chunk = r.metadata.tensors[name].chunks[0]
        out = {}
        for fw in ("torch", "numpy"):
            r.read(name, chunk, (5, 5), (2, 2), framework=fw)
            t = time.perf_counter()
            for _ in range(n):
                r.read(name, chunk, (5, 5), (2, 2), framework=fw)
            out[f"reader {fw}"] = (time.perf_counter() - t) / n
    for fw in ("pt",):  # safetensors' numpy framework cannot read bf16
        f = safe_open(os.path.join(root, fname), framework=fw)
        f.get_slice(name)[5:7, 5:7]
        t = time.perf_counter()
        for _ in range(n):
            f.get_slice(name)[5:7, 5:7]
        out[f"safe_open({fw!r}).get_slice"] = (time.perf_counter() - t) / n
    print("per small read: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dcp-bench-reader-", dir="/tmp")
    try:
        t0 = time.perf_counter()
        shapes = write_checkpoint(root, args.gib, args.files)
        total = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
        print(f"checkpoint: {total / MiB:.0f} MiB in {args.files} files, {len(shapes)} tensors "
              f"(written in {time.perf_counter() - t0:.1f} s); torch threads {torch.get_num_threads()}")
        for f in os.listdir(root):  # warm the page cache
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(64 * MiB):
                    pass
        print(f"{'case':<10} {'reader s':>9} {'load_file s':>12} {'ratio':>6} {'pread s':>8} "
              f"{'ratio':>6} {'GB/s reader':>12}")
        for case in ("full", "dim0-half", "dim1-half"):
            want = boxes(shapes, case)
            dst = {n: torch.empty(sizes, dtype=torch.bfloat16) for n, (_, sizes) in want.items()}
            mine, theirs, pread = [], [], []
            nbytes = 0
            for _ in range(args.reps):
                for d in dst.values():
                    d.fill_(float("nan"))
                t = time.perf_counter()
                nbytes = with_reader(root, want, dst)
                mine.append(time.perf_counter() - t)
                for d in dst.values():
                    d.fill_(float("nan"))
                t = time.perf_counter()
                with_load_file(root, want, dst)
                theirs.append(time.perf_counter() - t)
                t = time.perf_counter()
                with_load_file(root, want, dst, backend="pread")
                pread.append(time.perf_counter() - t)
                assert not any(d.isnan().any() for d in dst.values())
            a, b, c = min(mine), min(theirs), min(pread)
            print(f"{case:<10} {a:>9.3f} {b:>12.3f} {b / a:>5.2f}x {c:>8.3f} {c / a:>5.2f}x "
                  f"{nbytes / a / 1e9:>12.2f}")
        per_read_overhead(root, shapes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
