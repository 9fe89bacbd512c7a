"""The S3 benchmark's checkpoint and server: the model, its shards, the upload, moto's server
and its own ceiling (``bench_s3`` measures the loads against them).

The server is moto (``python -m moto.server``, its own process) on loopback; the checkpoint
is a Llama-like bf16 stack as Hugging Face safetensors shards plus torch DCP's own format of
the same tensors (its ``FsspecReader`` cannot read safetensors), both uploaded to ``BUCKET``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

MiB = 1024 * 1024
BUCKET = "bench"
HIDDEN = 2048


def model(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-like stack in bf16: per layer q, k, v, o (2048 x 2048), gate, up (5632 x 2048),
    down (2048 x 5632), two norms; as many layers as make ``gib``."""
    per_layer = [("q", (HIDDEN, HIDDEN)), ("k", (HIDDEN, HIDDEN)), ("v", (HIDDEN, HIDDEN)), ("o", (HIDDEN, HIDDEN)),
                 ("gate", (5632, HIDDEN)), ("up", (5632, HIDDEN)), ("down", (HIDDEN, 5632)),
                 ("in_norm", (HIDDEN,)), ("post_norm", (HIDDEN,))]
    layer_bytes = sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for _, s in per_layer)
    layers = max(1, round(gib * 1024 * MiB / layer_bytes))
    return [(f"layers.{i}.{n}", s) for i in range(layers) for n, s in per_layer]


def tensor(name: str, shape: tuple[int, ...]) -> Any:
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def shards(spec: list[tuple[str, tuple[int, ...]]], shard_mib: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in spec:
        nbytes = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        if out[-1] and size + nbytes > shard_mib * MiB:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def upload(spec: list[tuple[str, tuple[int, ...]]], shard_mib: int, workdir: str) -> tuple[int, list[str]]:
    """The HF checkpoint (shards + index) and torch DCP's copy, uploaded; (unique bytes, HF files)."""
    import torch.distributed.checkpoint as dcp
    from dcp_reader.storage import ObjectStorage
    from safetensors.torch import save as st_save

    shapes = dict(spec)
    hf = ObjectStorage(f"s3://{BUCKET}/hf")
    files, weight_map, unique = [], {}, 0
    groups = shards(spec, shard_mib)
    for i, names in enumerate(groups):
        f = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: tensor(n, shapes[n]) for n in names}
        unique += sum(t.nbytes for t in tensors.values())
        hf.put(f, [st_save(tensors)])
        files.append(f)
        weight_map.update({n: f for n in names})
    hf.put("model.safetensors.index.json", [json.dumps({"metadata": {}, "weight_map": weight_map}).encode()])
    local = os.path.join(workdir, "torchdcp")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({n: tensor(n, s) for n, s in spec}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(local, thread_count=len(groups)))
    tdcp = ObjectStorage(f"s3://{BUCKET}/torchdcp")
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as fh:
            tdcp.put(name, [fh.read()])
    return unique, files


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto.server did not start")


def server_ceiling(files: list[str], concurrency: int) -> float:
    """MiB/s of the server alone: every HF file fetched once in 8 MiB GETs, ``concurrency`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    from dcp_reader.storage import ObjectStorage

    store = ObjectStorage(f"s3://{BUCKET}/hf")
    jobs = []
    for f in files:
        size = store.size(f)
        jobs += [(f, lo, min(size, lo + 8 * MiB)) for lo in range(0, size, 8 * MiB)]
    import obstore

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        got = sum(pool.map(lambda j: len(obstore.get_range(store.store, store.key(j[0]), start=j[1], end=j[2])), jobs))
    return got / MiB / (time.perf_counter() - t0)
