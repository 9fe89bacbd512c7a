"""The demo: write a ~256 MB checkpoint, then load it on 4 local gloo ranks (DP2 x TP2).

``python -m dcp_load.demo`` (or ``dcp demo``) writes ~200 tensors of mixed sizes and dtypes
with ``dcp_load.save`` into a temporary directory, launches 4 ranks holding DP2 x TP2
DTensors, poisons them, loads them three times (reading every byte once and broadcasting
replicas; every rank reading what it holds; the default "auto" mode, which on one host
re-reads from the shared page cache), checks every value, and prints
per rank and in total the bytes read against the bytes needed, the broadcasts and the
time. The temporary directory is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import Any

MB = 1e6
# Boxes below this travel packed. The library default (6 MiB) is tuned for accelerators,
# where a broadcast's fixed cost is high; on gloo, packing copies cost more than they save
# for boxes above ~64 KiB. Measured here with this demo's checkpoint on 4 ranks (warm
# cache, one run each): 64 KiB 0.68 s, 1 MiB 0.82 s, 6 MiB 1.16 s; every rank reading
# took 0.84 s.
GLOO_BATCH_BYTES = 64 * 1024
HIDDEN, FFN, VOCAB, LAYERS = 512, 1536, 16001, 24
#: --modes name -> (the heading printed, broadcast_replicated_tensors)
MODES: dict[str, tuple[str, Any]] = {
    "broadcast": ("read once + broadcast (broadcast_replicated_tensors=True)", True),
    "every-rank": ("every rank reads (broadcast_replicated_tensors=False)", False),
    "auto": ('default "auto": all ranks on one host, so each re-reads from the shared page cache', "auto"),
}


def _specs() -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, dtype, placement on the (dp, tp) mesh: "RS0", "RS1" or "RR")."""
    out: dict[str, tuple[tuple[int, ...], str, str]] = {
        "embed.weight": ((VOCAB, HIDDEN), "float32", "RS0"),  # 16001 rows: uneven TP shards
        "final_norm.weight": ((HIDDEN,), "float32", "RR"),
        "step": ((), "int64", "RR"),
        "router.mask": ((64, 77), "uint8", "RS1"),
        "head.scale": ((256, 64), "float8_e4m3fn", "RS0"),
    }
    for i in range(LAYERS):
        p = f"layers.{i}."
        out[p + "attn.wq"] = ((HIDDEN, HIDDEN), "bfloat16", "RS0")
        out[p + "attn.wk"] = ((HIDDEN, HIDDEN), "bfloat16", "RS0")
        out[p + "attn.wv"] = ((HIDDEN, HIDDEN), "bfloat16", "RS0")
        out[p + "attn.wo"] = ((HIDDEN, HIDDEN), "bfloat16", "RS1")
        out[p + "mlp.w1"] = ((FFN, HIDDEN), "float32", "RS0")
        out[p + "mlp.w2"] = ((HIDDEN, FFN), "float32", "RS1")
        out[p + "mlp.w3"] = ((FFN + 3, HIDDEN), "float16", "RS0")  # uneven rows
        out[p + "norm.weight"] = ((HIDDEN,), "float32", "RR")
    return out


def _value(name: str, shape: tuple[int, ...], dtype: str, offsets: tuple[int, ...] | None = None,
           sizes: tuple[int, ...] | None = None) -> Any:
    """The box ``[offsets, offsets+sizes)`` (default: all) of the tensor saved under ``name``.

    A pattern of the global coordinates, ``(seed + sum(coord[d] * coef[d])) % modulus``: small
    ints, exact in every dtype used, and built with one full-size pass per step in int32
    (an int64 flat-index version took ~5x longer here) so that every rank can check its box.
    """
    import torch

    offsets = offsets if offsets is not None else (0,) * len(shape)
    sizes = sizes if sizes is not None else shape
    seed = sum(map(ord, name)) % 97 + 1
    modulus = 15 if dtype.startswith("float8") else 251
    value = torch.tensor(seed, dtype=torch.int32)
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        coef = (seed * (d + 2)) % modulus + 1
        value = value.unsqueeze(-1) + (torch.arange(o, o + n, dtype=torch.int32) * coef) % modulus
    return value.remainder_(modulus).to(getattr(torch, dtype))


def _placements(code: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {"RS0": [Replicate(), Shard(0)], "RS1": [Replicate(), Shard(1)], "RR": [Replicate(), Replicate()]}[code]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def _rank_main(rank: int, world: int, path: str, batch_bytes: int, modes: tuple[str, ...]) -> dict[str, Any]:
    """Runs in each of the 4 ranks: poison DTensors, load once per mode (in ``modes``' order), verify, report."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import dcp_load

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # The mesh's data-parallel group is the replica group of [R, S] tensors: supplying it
    # saves creating (and destroying) the same group inside every load (~0.3 s here).
    dp = mesh.get_group("dp")
    groups = {tuple(sorted(torch.distributed.get_process_group_ranks(dp))): dp}
    # Warm-up (imports and first-call costs), so that neither measured mode pays for them.
    warm = {"final_norm.weight": torch.empty(HIDDEN)}
    for broadcast in (True, False):
        dcp_load.load(warm, checkpoint_id=path, strict=False, broadcast_replicated_tensors=broadcast)
    out: dict[str, Any] = {}
    for name in modes:
        mode, broadcast = MODES[name]
        state: dict[str, Any] = {}
        boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for name, (shape, dtype, code) in _specs().items():
            placements = _placements(code)
            local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
            boxes[name] = (tuple(offsets), tuple(local_shape))
            local = torch.empty(local_shape, dtype=getattr(torch, dtype))
            local.view(-1).view(torch.uint8).fill_(0x7F)  # poison: no saved value has these bytes
            state[name] = (DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                              stride=_contiguous_stride(shape)) if shape else local)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        report = dcp_load.load(state, checkpoint_id=path, broadcast_replicated_tensors=broadcast,
                               broadcast_groups=groups if broadcast else None, broadcast_batch_bytes=batch_bytes)
        seconds = time.perf_counter() - t0
        bad = []
        for name, (shape, dtype, _) in _specs().items():
            value = state[name].to_local() if shape else state[name]
            expected = _value(name, shape, dtype, *boxes[name])
            if not torch.equal(value.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):
                bad.append(name)
        out[mode] = {"needed": report.bytes_needed, "read": report.bytes_read, "received": report.bytes_received,
                     "broadcasts": report.broadcasts, "seconds": seconds, "bad": bad,
                     "phases": dict(report.seconds)}
    return out


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(filter(None, (n.strip() for n in text.split(","))))
    bad = [n for n in names if n not in MODES]
    if bad or not names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"--modes {text!r}: give each of {', '.join(MODES)} at most once, "
                                         "comma-separated" + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoint into DIR and keep it")
    parser.add_argument("--batch-bytes", type=int, default=GLOO_BATCH_BYTES,
                        help=f"broadcast_batch_bytes for the broadcast mode (default {GLOO_BATCH_BYTES})")
    parser.add_argument("--modes", default=",".join(MODES), type=_modes,
                        help=f"the modes to run, in this order (default {','.join(MODES)}): the first one "
                        "also finds the page cache as the save left it, so rotate the order to compare modes")
    args = parser.parse_args(argv)

    import torch
    from dcp_platform.testing import run_ranks

    import dcp_load

    specs = _specs()
    path = args.keep or tempfile.mkdtemp(prefix="dcp-demo-")
    try:
        t0 = time.perf_counter()
        state = {name: _value(name, shape, dtype) for name, (shape, dtype, _) in specs.items()}
        saved = dcp_load.save(state, checkpoint_id=path, no_dist=True)
        del state
        print(f"checkpoint: {len(specs)} tensors, {saved.job_bytes / MB:.1f} MB (bfloat16, float16, float32, "
              f"float8_e4m3fn, int64, uint8), written to {path} in {time.perf_counter() - t0:.1f} s")
        print("loading on 4 gloo ranks as DP2 x TP2 DTensors (targets poisoned with 0x7F bytes), "
              f"broadcast_batch_bytes={args.batch_bytes}")
        t0 = time.perf_counter()
        results = run_ranks(_rank_main, 4, path, args.batch_bytes, args.modes, timeout=600)
        print(f"(4 ranks started, all loads run and verified in {time.perf_counter() - t0:.1f} s)")
        failed = False
        for mode in results[0]:
            rows = [r[mode] for r in results]
            print(f"\n== {mode} ==")
            print(f"{'rank':>4} {'needed MB':>10} {'read MB':>9} {'received MB':>12} {'broadcasts':>10} "
                  f"{'seconds':>8}  verified")
            for rank, row in enumerate(rows):
                ok = "all values" if not row["bad"] else f"WRONG: {', '.join(row['bad'][:5])}"
                failed |= bool(row["bad"])
                print(f"{rank:>4} {row['needed'] / MB:>10.1f} {row['read'] / MB:>9.1f} {row['received'] / MB:>12.1f} "
                      f"{row['broadcasts']:>10} {row['seconds']:>8.2f}  {ok}")
            needed = sum(r["needed"] for r in rows)
            read = sum(r["read"] for r in rows)
            print(f"{'all':>4} {needed / MB:>10.1f} {read / MB:>9.1f} "
                  f"{sum(r['received'] for r in rows) / MB:>12.1f} {sum(r['broadcasts'] for r in rows):>10} "
                  f"{max(r['seconds'] for r in rows):>8.2f}")
            print(f"read from storage: {read / MB:.1f} MB for {saved.job_bytes / MB:.1f} MB of distinct data "
                  f"(read amplification {read / saved.job_bytes:.2f}); ranks needed {needed / MB:.1f} MB in total")
        del torch
        return 1 if failed else 0
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
