"""Shared pieces of the load benchmarks: checkpoints, measurement, and the per-rank load.

Everything a rank does is in ``rank_load``: it builds its (poisoned) destination state dict,
synchronises with the other ranks, optionally drops the page cache, then measures one load
(wall clock, ``/proc/self/io`` read_bytes, resident memory, collectives called) with dcp or
with torch.distributed.checkpoint, and afterwards checks every loaded value against the
files. Ranks are real gloo processes started by ``_bench_launch.Launcher``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import _bench_throttle as _throttle

MiB = 1024 * 1024
GiB = 1024 * MiB

# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama-like decoder saved as a Hugging Face safetensors checkpoint (bf16).

    ``tensors()`` gives (name, shape, tp_dim): tp_dim 0 for column-parallel weights
    (q/k/v/gate/up, embeddings, lm_head), 1 for row-parallel ones (o/down), None for
    replicated ones (norms).
    """

    layers: int = 10
    hidden: int = 2048
    kv_dim: int = 512  # GQA: 4 KV heads of 128
    intermediate: int = 5632
    vocab: int = 32000
    dtype: str = "bfloat16"
    file_bytes: int = 512 * MiB  # target size of one safetensors file

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        h, kv, i, v = self.hidden, self.kv_dim, self.intermediate, self.vocab
        out: list[tuple[str, tuple[int, ...], int | None]] = [("model.embed_tokens.weight", (v, h), 0)]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,), None),
                (p + "self_attn.q_proj.weight", (h, h), 0),
                (p + "self_attn.k_proj.weight", (kv, h), 0),
                (p + "self_attn.v_proj.weight", (kv, h), 0),
                (p + "self_attn.o_proj.weight", (h, h), 1),
                (p + "post_attention_layernorm.weight", (h,), None),
                (p + "mlp.gate_proj.weight", (i, h), 0),
                (p + "mlp.up_proj.weight", (i, h), 0),
                (p + "mlp.down_proj.weight", (h, i), 1),
            ]
        out += [("model.norm.weight", (h,), None), ("lm_head.weight", (v, h), 0)]
        return out


@dataclasses.dataclass(frozen=True)
class SmallSpec:
    """Many small replicated tensors (float32), e.g. 2000 x 16 KiB."""

    count: int = 2000
    nbytes: int = 16 * 1024
    dtype: str = "float32"
    file_bytes: int = 512 * MiB

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        return [(f"small.{n:05d}.weight", (self.nbytes // 4,), None) for n in range(self.count)]


_ITEMSIZE = {"bfloat16": 2, "float32": 4, "float16": 2}


def warmup_spec(spec: ModelSpec | SmallSpec) -> ModelSpec | SmallSpec:
    """A tiny checkpoint with the same names, dtypes and sharding as ``spec``."""
    if isinstance(spec, ModelSpec):
        return dataclasses.replace(spec, hidden=64, kv_dim=16, intermediate=128, vocab=256)
    return dataclasses.replace(spec, count=min(spec.count, 64), nbytes=64)


def spec_nbytes(spec: ModelSpec | SmallSpec) -> int:
    item = _ITEMSIZE[spec.dtype]
    return sum(math.prod(shape) * item for _, shape, _ in spec.tensors())


def write_hf_checkpoint(path: Path, spec: ModelSpec | SmallSpec, seed: int = 0) -> int:
    """Write ``spec`` as HF safetensors shards plus ``model.safetensors.index.json``.

    Reuses an existing checkpoint written from the same spec (a ``bench-spec.json``
    marker is written last). Returns the bytes of tensor data.
    """
    import torch
    from safetensors.torch import save_file

    marker = path / "bench-spec.json"
    want = json.dumps({"type": type(spec).__name__, **dataclasses.asdict(spec), "seed": seed},
                      sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return spec_nbytes(spec)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape, _ in spec.tensors():
        nb = math.prod(shape) * _ITEMSIZE[spec.dtype]
        if groups[-1] and size + nb > spec.file_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nb
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in group}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    os.sync()
    marker.write_text(want)
    return total


def write_warmup_checkpoint(workdir: Path, spec: ModelSpec | SmallSpec) -> str:
    """The tiny checkpoint each rank loads before the measured load (see rank_load)."""
    import hashlib

    tag = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]  # quick and full runs apart
    path = workdir / f"warmup-{type(spec).__name__.lower()}-{tag}"
    write_hf_checkpoint(path, warmup_spec(spec), seed=1)
    return str(path)


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name != "bench-spec.json")


def copy_checkpoint(src: Path, dst: Path) -> None:
    """A byte-identical copy: a simulated node's own copy of the files."""
    marker = src / "bench-spec.json"
    if (dst / "bench-spec.json").exists() and (dst / "bench-spec.json").read_text() == marker.read_text():
        return
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in checkpoint_files(src):
        shutil.copyfile(f, dst / f.name)
    os.sync()
    shutil.copyfile(marker, dst / "bench-spec.json")


def warm_files(path: Path) -> None:
    """Pull every file of ``path`` into the page cache."""
    buf = bytearray(16 * MiB)
    for f in checkpoint_files(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# ---------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------

def drop_page_cache(dirs: list[str] | list[Path] | tuple[str, ...] = ()) -> str:
    """Evict the checkpoint files from the page cache; returns the method used.

    As root: ``sync; echo 3 > /proc/sys/vm/drop_caches`` (works on this machine). Where
    that is not permitted: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of ``dirs``
    (evicts those files' clean pages; other files stay cached).
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        if not dirs:
            raise
    for d in dirs:
        fadvise_dontneed(checkpoint_files(Path(d)))
    return "fadvise_dontneed"


def fadvise_dontneed(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def can_drop_caches() -> bool:
    """Whether /proc/sys/vm/drop_caches is writable here (else cold runs use fadvise)."""
    try:
        drop_page_cache()
        return True
    except OSError:
        return False


def read_bytes() -> int:
    """Bytes this process (all its threads) really fetched from storage so far."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


def _status_kib(fields: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                out[key] = int(rest.split()[0])
    return out


class MemorySampler:
    """Peak resident memory of this process during a block.

    VmHWM (exact peak of the whole RSS) is reset through ``/proc/self/clear_refs`` before
    the block; anonymous (private) memory has no kernel high-water mark, so a thread
    samples ``RssAnon`` every ``interval`` seconds (file-backed pages of memory-mapped
    checkpoint files are page cache the kernel can drop, so they are counted apart).
    """

    _FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.base: dict[str, int] = {}
        self.peak_anon = 0
        self.peak_file = 0

    def __enter__(self) -> MemorySampler:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.base = _status_kib(self._FIELDS)
        self.peak_anon = self.base["RssAnon"]
        self.peak_file = self.base["RssFile"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            s = _status_kib(("RssAnon", "RssFile"))
            self.peak_anon = max(self.peak_anon, s["RssAnon"])
            self.peak_file = max(self.peak_file, s["RssFile"])

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        end = _status_kib(self._FIELDS)
        self.peak_anon = max(self.peak_anon, end["RssAnon"])
        self.result = {
            "base_rss": self.base["VmRSS"] * 1024,
            "base_anon": self.base["RssAnon"] * 1024,
            "peak_rss": end["VmHWM"] * 1024,
            "peak_anon": self.peak_anon * 1024,
            "peak_file": self.peak_file * 1024,
            "extra_rss": (end["VmHWM"] - self.base["VmRSS"]) * 1024,
            "extra_anon": (self.peak_anon - self.base["RssAnon"]) * 1024,
        }


_COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "all_gather_object", "gather_object", "scatter_object_list",
    "broadcast_object_list", "send", "recv", "isend", "irecv", "new_group",
    "monitored_barrier",
)


class CollectiveCounter:
    """Counts top-level calls to torch.distributed collectives made during a block.

    Both loaders call collectives as ``dist.<name>(...)``, so replacing the module
    attributes sees them; calls made from inside a counted call (all_gather_object uses
    all_gather) are not counted again. ``new_group`` is counted apart from data collectives.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # time inside top-level calls, by name
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.counts[name] = self.counts.get(name, 0) + 1
            self._local.depth = depth + 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._local.depth = depth
                if depth == 0:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

        return counted

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    @property
    def data_collectives(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "new_group")


def now() -> float:
    """CLOCK_MONOTONIC is system-wide on Linux, so stamps compare across ranks."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------------------------------
# the per-rank load
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured load. ``method``: one of ``_bench_loaders.METHODS``.

    ``simulate_hosts``: each simulated node gets its own ``DCP_HOST_ID``, so dcp's "auto"
    mode sees the nodes as separate hosts (as on a cluster). ``fmt``: the files' format,
    ``hf`` (safetensors + index) or ``torch_dcp`` (torch.distributed.checkpoint's default
    writer). ``verify_dir``: the HF checkpoint holding the same tensors, to check the loaded
    values against (default: the node's own checkpoint, which must then be HF).
    ``cgroups``: blkio cgroup directories (``_bench_throttle``); node k's ranks run the
    measured load inside ``cgroups[k]``, or all inside ``cgroups[0]`` when there is one.
    """

    method: str
    spec: ModelSpec | SmallSpec
    dp: int
    tp: int
    ckpt_dirs: tuple[str, ...]  # one per simulated node
    ranks_per_node: int
    cold: bool = False
    batch_bytes: int = 6 * MiB
    verify: bool = True
    sample_memory: bool = True
    warmup_dir: str | None = None  # a checkpoint of warmup_spec(spec), loaded first
    simulate_hosts: bool = False
    fmt: str = "hf"
    verify_dir: str | None = None
    cgroups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from _bench_loaders import METHODS

        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.fmt not in ("hf", "torch_dcp"):
            raise ValueError(f"unknown checkpoint format {self.fmt!r}: hf or torch_dcp")
        if self.fmt != "hf" and self.verify and self.verify_dir is None:
            raise ValueError(f"a {self.fmt} checkpoint is verified against an HF copy: give verify_dir")
        if self.cgroups and len(self.cgroups) not in (1, len(self.ckpt_dirs)):
            raise ValueError(f"{len(self.cgroups)} cgroups for {len(self.ckpt_dirs)} nodes: give one "
                             "per node (per-node link) or one for all (shared file system)")
        if len(self.ckpt_dirs) * self.ranks_per_node < self.dp * self.tp:
            raise ValueError(f"{len(self.ckpt_dirs)} node copies x {self.ranks_per_node} ranks "
                             f"cannot hold {self.dp * self.tp} ranks")


def _box(shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int
         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets = [0] * len(shape)
    sizes = list(shape)
    if tp_dim is not None and tp > 1:
        if shape[tp_dim] % tp:
            raise ValueError(f"dim {tp_dim} of {shape} does not divide by tp={tp}")
        sizes[tp_dim] = shape[tp_dim] // tp
        offsets[tp_dim] = tp_rank * sizes[tp_dim]
    return tuple(offsets), tuple(sizes)


def make_mesh(run: Run, distributed: bool) -> Any:
    """A (dp, tp) DeviceMesh when tp > 1 (DTensors), else None (plain tensors, as in DDP)."""
    if not (distributed and run.tp > 1):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (run.dp, run.tp), mesh_dim_names=("dp", "tp"))


def build_state_dict(spec: ModelSpec | SmallSpec, run: Run, rank: int, mesh: Any
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Poisoned (NaN) destinations for ``spec``: DTensors on ``mesh``, or plain tensors.

    Returns (state_dict, local tensors by name): the local tensors are the memory the load
    must fill.
    """
    import torch

    dtype = getattr(torch, spec.dtype)
    sd: dict[str, Any] = {}
    local: dict[str, Any] = {}
    tp_rank = mesh.get_local_rank("tp") if mesh is not None else rank % run.tp
    for name, shape, tp_dim in spec.tensors():
        _, sizes = _box(shape, tp_dim, run.tp, tp_rank)
        t = torch.empty(sizes, dtype=dtype).fill_(float("nan"))
        local[name] = t
        if mesh is None:
            sd[name] = t
        else:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placement = Replicate() if tp_dim is None else Shard(tp_dim)
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            sd[name] = DTensor.from_local(t, mesh, [Replicate(), placement], run_check=False,
                                          shape=torch.Size(shape), stride=stride)
    return sd, local


def verify_state_dict(run: Run, ckpt: str, local: dict[str, Any], tp_rank: int) -> int:
    """Compare every destination with the file contents; returns tensors checked."""
    import torch
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    handles: dict[str, Any] = {}
    bad: list[str] = []
    try:
        for name, shape, tp_dim in run.spec.tensors():
            fname = index[name]
            if fname not in handles:
                handles[fname] = safe_open(str(Path(ckpt) / fname), framework="pt")
            offsets, sizes = _box(shape, tp_dim, run.tp, tp_rank)
            want = handles[fname].get_slice(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))]
            if not torch.equal(local[name], want):
                bad.append(name)
    finally:
        handles.clear()
    if bad:
        raise AssertionError(f"{run.method}: {len(bad)} tensors differ from the checkpoint "
                             f"after the load, first {bad[:3]}")
    return len(run.spec.tensors())


def rank_load(rank: int, world: int, run: Run) -> dict[str, Any]:
    """Entry point of every rank (module level so the launcher can pickle it)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")  # torch DCP warns about no_dist / HF reader details
    distributed = world > 1
    from _bench_loaders import do_load, import_for

    import_for(run.method)  # module loading is not measured
    node = rank // run.ranks_per_node
    ckpt = run.ckpt_dirs[node]
    if run.simulate_hosts:
        os.environ["DCP_HOST_ID"] = f"bench-node-{node}"  # read by dcp_load's "auto" mode
    stamps = {"start": now()}
    mesh = make_mesh(run, distributed)
    tp_rank = mesh.get_local_rank("tp") if mesh is not None else rank % run.tp
    stamps["mesh"] = now()
    if run.warmup_dir:
        # A load of a tiny checkpoint with the same structure first, by the same method:
        # first-call costs (lazy imports, library code paged in after a cache drop) stay
        # out of the measured load; both loaders get the same warm-up.
        wsd, wlocal = build_state_dict(warmup_spec(run.spec), run, rank, mesh)
        do_load(dataclasses.replace(run, spec=warmup_spec(run.spec)), wsd, wlocal, run.warmup_dir,
                distributed, tp_rank)
        del wsd, wlocal
    stamps["warmup"] = now()
    sd, local = build_state_dict(run.spec, run, rank, mesh)
    stamps["build"] = now()
    import gc

    gc.collect()
    left = _throttle.join(run.cgroups[node % len(run.cgroups)]) if run.cgroups else None
    if distributed:
        dist.barrier()
    drop = None
    if run.cold:
        if rank == 0:
            drop = drop_page_cache(run.ckpt_dirs)
        if distributed:
            dist.barrier()
    counter = CollectiveCounter()
    sampler = MemorySampler() if run.sample_memory else None
    io0 = read_bytes()
    if sampler:
        sampler.__enter__()
    with counter:
        cpu0 = cpu_seconds()
        t0 = now()
        info = do_load(run, sd, local, ckpt, distributed, tp_rank)
        t1 = now()
        cpu1 = cpu_seconds()
    if sampler:
        sampler.__exit__(None, None, None)
    io1 = read_bytes()
    if left is not None:
        _throttle.leave(left)  # verification below is not throttled
    if distributed:
        dist.barrier()
    stamps["load"] = now()
    checked = verify_state_dict(run, run.verify_dir or ckpt, local, tp_rank) if run.verify else 0
    stamps["verify"] = now()
    dest = sum(t.numel() * t.element_size() for t in local.values())
    del sd, local
    return {
        "rank": rank, "node": node, "t0": t0, "t1": t1, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0,
        "read_bytes": io1 - io0, "dest_bytes": dest, "collectives": dict(counter.counts),
        "data_collectives": counter.data_collectives,
        "collective_seconds": dict(counter.seconds), "drop": drop, "verified": checked,
        "memory": sampler.result if sampler else None, "stamps": stamps, **info,
    }


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread (gloo's included), in seconds."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def measure_disk_bandwidth(path: Path) -> dict[str, float]:
    """Cold sequential read of every file of ``path`` (page cache dropped first)."""
    files = checkpoint_files(path)
    method = drop_page_cache([path])
    buf = bytearray(16 * MiB)
    io0 = read_bytes()
    t0 = now()
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    dt = now() - t0
    return {"bytes": total, "seconds": dt, "bytes_per_s": total / dt,
            "read_bytes": read_bytes() - io0, "drop": method}


def read_ahead_kb(path: Path) -> int | None:
    """The block device readahead (KiB) of the file system holding ``path``, if visible."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for q in (base / "queue" / "read_ahead_kb", base.parent / "queue" / "read_ahead_kb"):
        try:
            return int(q.read_text())
        except (OSError, ValueError):
            continue
    return None


def readahead_probe(path: Path, box: int = 4 * MiB) -> dict[str, Any]:
    """Bytes fetched from storage to copy one ``box``-byte range out of a cold file.

    The same range is read cold four ways: through a memory map (what safetensors'
    get_slice does), a memory map with MADV_RANDOM, and preadv with and without
    POSIX_FADV_RANDOM. The difference is the kernel's readahead around page faults.
    """
    import mmap

    f = max(checkpoint_files(path), key=lambda p: p.stat().st_size)
    off = (f.stat().st_size // 2) & ~(mmap.PAGESIZE - 1)

    def via_mmap(advice: int | None) -> None:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mp:
            if advice is not None:
                mp.madvise(advice)
            bytes(mp[off:off + box])

    def via_pread(advice: int | None) -> None:
        fd = os.open(f, os.O_RDONLY)
        try:
            if advice is not None:
                os.posix_fadvise(fd, 0, 0, advice)
            os.preadv(fd, [bytearray(box)], off)
        finally:
            os.close(fd)

    out: dict[str, Any] = {"box_bytes": box, "file": f.name, "read_ahead_kb": read_ahead_kb(f)}
    out["loaders"] = loader_probe(path)
    for name, fn in (("mmap", lambda: via_mmap(None)),
                     ("mmap MADV_RANDOM", lambda: via_mmap(mmap.MADV_RANDOM)),
                     ("preadv", lambda: via_pread(None)),
                     ("preadv FADV_RANDOM", lambda: via_pread(os.POSIX_FADV_RANDOM))):
        drop_page_cache([path])
        before = read_bytes()
        fn()
        out[name] = read_bytes() - before
    return out


def loader_probe(path: Path) -> dict[str, Any]:
    """Bytes each loader's reader fetches cold for one row-half (dim-0) box of one tensor.

    The box is the first half of the rows of an MLP weight (what a TP2 rank of a
    column-parallel weight holds): dcp_reader's ``read`` and
    safetensors' ``get_slice`` (what torch DCP's HF reader calls), each copied out.
    """
    import torch  # noqa: F401 - imported before the cache is dropped
    from dcp_reader import open_checkpoint
    from safetensors import safe_open

    with open_checkpoint(str(path)) as r:
        # A layer's MLP weight when there is one (the typical size), else the largest matrix.
        name, tm = max(r.metadata.tensors.items(),
                       key=lambda kv: (".mlp." in kv[0], kv[1].nbytes if len(kv[1].shape) == 2 else 0))
        chunk = tm.chunks[0]
        sizes = (tm.shape[0] // 2, *tm.shape[1:])
        nbytes = math.prod(sizes) * tm.itemsize
        fname = chunk.file
        r.read(name, chunk, (0,) * len(sizes), (1,) * len(sizes))  # open the file before timing
    out: dict[str, Any] = {"tensor": name, "box_bytes": nbytes}
    drop_page_cache([path])
    with open_checkpoint(str(path)) as r:
        before = read_bytes()
        r.read(name, r.metadata.tensors[name].chunks[0], (0,) * len(sizes), sizes).clone()
        out["dcp_reader"] = read_bytes() - before
    drop_page_cache([path])
    with safe_open(str(path / fname), framework="pt") as fh:
        before = read_bytes()
        fh.get_slice(name)[: sizes[0]].clone()
        out["safetensors get_slice"] = read_bytes() - before
    return out
