"""What the benchmarks measure inside a process: storage bytes, memory, collectives, time, the
page cache and the disk.

``read_bytes`` (``/proc/self/io``) counts the bytes really fetched from the block device;
``MemorySampler`` the peak resident memory of a block; ``CollectiveCounter`` the
torch.distributed calls made in a block; ``drop_page_cache`` / ``fadvise_dontneed`` make the
next read cold; ``readahead_probe`` / ``loader_probe`` what a cold range costs.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from harness.files import checkpoint_files, warm_files
from harness.spec import MiB


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


def set_cache(dirs: list[Path], warm: bool) -> None:
    """Every file of ``dirs`` read into the page cache (``warm``), else evicted from it
    (``posix_fadvise(POSIX_FADV_DONTNEED)`` after a sync: the next load reads cold)."""
    if warm:
        for d in dirs:
            warm_files(d)
        return
    os.sync()
    fadvise_dontneed([f for d in dirs for f in checkpoint_files(d)])


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
