"""dcp-reader benchmark (not a test): reading a ~1 GiB multi-file checkpoint into
preallocated tensors, side by side in one process, warm page cache:
CheckpointReader.read + copy_ and CheckpointReader.read_into (both read with preadv), each
with block checksums verified and not, against the memory-map path dcp-reader used before
0.2 (a private map of each file cut with the header's offsets, + copy_) and
safetensors.torch.load_file + copy_.

With ``--native`` (the default) the checkpoint is written by NativeWriter (safetensors
files with XXH3-64 block checksums in the metadata, readable by load_file too); with
``--hf`` as Hugging Face writes it (no checksums: the "verify" columns then equal the others).

safetensors 0.8's load_file memory-maps by default (tensors are lazy views, like the
reader's), so a third column times load_file(backend="pread"), which reads whole files.
A last line gives the fixed cost of one small read against indexing
safe_open(...).get_slice(key) directly. Three cases: whole tensors, the first half of every tensor along dim 0, and the first half
along dim 1. Each repetition runs the methods one after the other; the best of the repetitions
(robust to a busy shared machine) and the ratio (other time / reader time) are printed. The checkpoint is written to a
temporary directory under /tmp and deleted afterwards.

    .venv/bin/python benchmarks/storage/bench_reader.py [--gib 1.0] [--files 4] [--reps 5] [--hf]
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from dcp_reader import CheckpointMetadata, ChunkMeta, NativeWriter, TensorMeta, chunk_key, open_checkpoint
from dcp_reader.formats._safetensors_file import read_header_at

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness/

from harness.cli import parser  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

MiB = 1024 * 1024


def _shapes(gib: float, files: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(max(files, round(gib * 1024 / 32))):
        shapes[f"layers.{i}.weight"] = (4096, 4096)
        shapes[f"layers.{i}.norm"] = (4096,)
    return shapes


def write_checkpoint(root: str, gib: float, files: int, hf: bool) -> dict[str, tuple[int, ...]]:
    """bf16 weights of 4096 x 4096 (32 MiB) plus a 4096-element norm per weight, spread over
    ``files`` files: Hugging Face shards with an index, or a native checkpoint."""
    shapes = _shapes(gib, files)
    names = list(shapes)
    per_file = -(-len(names) // files)
    weight_map, metas = {}, {}
    writer = None if hf else NativeWriter(root)
    for f in range(files):
        part = names[f * per_file:(f + 1) * per_file]
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        # distinct constant per tensor: cheap to make, and the copy cost does not depend on values
        data = {n: torch.full(shapes[n], float(names.index(n)), dtype=torch.bfloat16) for n in part}
        if hf:
            save_file(data, os.path.join(root, fname))
            weight_map.update(dict.fromkeys(part, fname))
        else:
            offs = {n: (0,) * len(shapes[n]) for n in part}
            writer.write_file(fname, {chunk_key(n, offs[n]): t for n, t in data.items()})
            for n in part:
                metas[n] = TensorMeta(n, shapes[n], "bfloat16", (ChunkMeta(offs[n], shapes[n], fname,
                                                                           chunk_key(n, offs[n])),))
    if hf:
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    else:
        writer.commit(CheckpointMetadata(tensors=metas, values={}, format="native"))
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


def with_reader(root: str, want, dst, *, verify: bool, into: bool) -> int:
    with open_checkpoint(root, verify_checksums=verify) as r:
        for name, (offs, sizes) in want.items():
            chunk = r.metadata.tensors[name].chunks[0]
            if into:
                r.read_into(name, chunk, offs, sizes, dst[name])
            else:
                dst[name].copy_(r.read(name, chunk, offs, sizes))
        return r.bytes_read


def with_mmap(root: str, want, dst) -> None:
    """The read path of dcp-reader 0.1: a private map per file, views cut at the header's
    offsets, copied into place (page faults fetch the bytes)."""
    with open_checkpoint(root) as r:
        chunks = {n: r.metadata.tensors[n].chunks[0] for n in want}
    by_file: dict[str, list[str]] = {}
    for n, c in chunks.items():
        by_file.setdefault(c.file, []).append(n)
    for fname, names in by_file.items():
        header = read_header_at(root, fname)
        fd = os.open(os.path.join(root, fname), os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        for n in names:
            e = header.entries[chunks[n].key]
            offs, sizes = want[n]
            arr = np.ndarray(e.shape, dtype=np.uint16, buffer=mm, offset=header.data_start + e.start)
            box = arr[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))]
            dst[n].copy_(torch.from_numpy(box).view(torch.bfloat16))
        del arr, box


def with_load_file(root: str, want, dst) -> None:
    for fname in sorted(f for f in os.listdir(root) if f.endswith(".safetensors")):
        for key, t in load_file(os.path.join(root, fname)).items():
            name = key.split("@")[0]
            offs, sizes = want[name]
            dst[name].copy_(t[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))])


METHODS = {
    "read": lambda root, want, dst: with_reader(root, want, dst, verify=False, into=False),
    "read+verify": lambda root, want, dst: with_reader(root, want, dst, verify=True, into=False),
    "read_into": lambda root, want, dst: with_reader(root, want, dst, verify=False, into=True),
    "into+verify": lambda root, want, dst: with_reader(root, want, dst, verify=True, into=True),
    "mmap(0.1)": with_mmap,
    "load_file": with_load_file,
}


def per_read_overhead(root: str, shapes, n: int = 3000) -> None:
    """Fixed cost of one small read (a 2 x 2 box): what dominates checkpoints of many small
    tensors. CheckpointReader.read against indexing safetensors' get_slice directly."""
    from safetensors import safe_open

    name = next(iter(shapes))
    with open_checkpoint(root) as r:
        chunk = r.metadata.tensors[name].chunks[0]
        out = {}
        for fw in ("torch", "numpy"):
            r.read(name, chunk, (5, 5), (2, 2), framework=fw)
            t = time.perf_counter()
            for _ in range(n):
                r.read(name, chunk, (5, 5), (2, 2), framework=fw)
            out[f"reader {fw}"] = (time.perf_counter() - t) / n
        f = safe_open(os.path.join(root, chunk.file), framework="pt")
        f.get_slice(chunk.key)[5:7, 5:7]
        t = time.perf_counter()
        for _ in range(n):
            f.get_slice(chunk.key)[5:7, 5:7]
        out["safe_open('pt').get_slice"] = (time.perf_counter() - t) / n
    print("per small read: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in out.items()))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hf", action="store_true", help="a Hugging Face checkpoint (no checksums)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dcp-bench-reader-", dir="/tmp")
    try:
        t0 = time.perf_counter()
        shapes = write_checkpoint(root, args.gib, args.files, args.hf)
        total = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
        print(f"checkpoint: {'hf' if args.hf else 'native'}, {total / MiB:.0f} MiB in {args.files} files, "
              f"{len(shapes)} tensors (written in {time.perf_counter() - t0:.1f} s); torch threads "
              f"{torch.get_num_threads()}; best of {args.reps}, seconds (ratio to mmap(0.1))")
        for f in os.listdir(root):  # warm the page cache
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(64 * MiB):
                    pass
        print(f"{'case':<10} " + " ".join(f"{m:>18}" for m in METHODS))
        for case in ("full", "dim0-half", "dim1-half"):
            want = boxes(shapes, case)
            dst = {n: torch.empty(sizes, dtype=torch.bfloat16) for n, (_, sizes) in want.items()}
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(args.reps):
                for m, fn in METHODS.items():
                    for d in dst.values():
                        d.fill_(float("nan"))
                    t = time.perf_counter()
                    fn(root, want, dst)
                    times[m].append(time.perf_counter() - t)
                    assert not any(d.isnan().any() for d in dst.values()), m
            base = min(times["mmap(0.1)"])
            print(f"{case:<10} " + " ".join(f"{min(v):>10.3f} ({min(v) / base:4.2f}x)" for v in times.values()))
        per_read_overhead(root, shapes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
