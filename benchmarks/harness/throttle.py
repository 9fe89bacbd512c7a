"""Storage with a cluster's bandwidth: the kernel's block-I/O throttle (cgroup v1 blkio).

On a cluster each node reaches storage through its own link, or all nodes share one
file system; either caps read bandwidth well below this machine's local disk. The
benchmark models both with ``blkio.throttle.read_bps_device``:

- *per-node link*: one cgroup per simulated node, each capped at B bytes/s; the ranks of
  node k move into cgroup k for the measured load;
- *shared file system*: every rank moves into one cgroup capped at B.

The host side (``Throttle``) creates the cgroups under ``<blkio mount>/dcp-bench-<pid>``,
writes the caps for the block device that holds the checkpoints, and removes them on exit,
on success and on failure (a task still inside is moved back to the root cgroup first).
The rank side (``join``/``leave``) writes the rank's pid into ``cgroup.procs``: every
thread of the process moves with it, and page faults on memory maps and readahead are
charged to the cgroup of the task that triggers them.

Checked on this machine: a cold 64 MiB file read with ``dd`` took 0.66 s under a
100 MiB/s cap and 0.11 s without (root may write the cgroup v1 files here).

Writes (``Throttle(..., write=True)``, ``blkio.throttle.write_bps_device``): cgroup v1
charges a write to the task that submits it, so the cap holds for data a rank flushes
itself with ``fsync`` (as checkpoint writers do) and not for dirty pages the kernel's
flusher writes back on its own. Checked here under a 100 MiB/s write cap: ``dd ...
conv=fsync`` of 256 MiB took 2.55 s, and so did four such ``dd`` of 64 MiB at once; the
cgroup's io_service_bytes counted the 256 MiB as "Write".
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

PREFIX = "dcp-bench-"


def parse_bps(text: str) -> int:
    """``"100M"`` -> 104857600 (K, M, G are powers of 1024); a plain number is bytes/s."""
    t = text.strip().upper().removesuffix("/S").removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = float(num) * scale
    except ValueError:
        raise ValueError(f"--throttle-bps: cannot read {text!r} as a bandwidth; write e.g. 100M "
                         "(MiB/s), 1G or 52428800 (bytes/s)") from None
    if value < 1024 * 1024:
        raise ValueError(f"--throttle-bps: {text!r} is {value:.0f} bytes/s; give at least 1M")
    return int(value)


def blkio_mount() -> Path | None:
    """Where the cgroup v1 blkio hierarchy is mounted, from /proc/self/mounts."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and "blkio" in parts[3].split(","):
            return Path(parts[1])
    return None


def block_device(path: str | os.PathLike[str]) -> str:
    """``major:minor`` of the whole disk holding ``path`` (throttle rules name disks)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if not sys_dev.exists():
        raise OSError(errno.ENODEV, f"{path} is on device {dev}, which is not a block device "
                      f"(no {sys_dev}: tmpfs, overlay or a network file system?)")
    if (sys_dev / "partition").exists():  # a partition: the rule goes on its disk
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return dev


def unavailable(path: str | os.PathLike[str], *, write: bool = False) -> str | None:
    """Why the throttle cannot be used for files under ``path`` here, or None (``write``:
    a write cap is needed, and probed, as well as a read cap)."""
    mount = blkio_mount()
    if mount is None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        return ("no cgroup v1 blkio hierarchy is mounted (/proc/self/mounts lists none)"
                + ("; this machine has cgroup v2 only, whose io.max is not implemented here"
                   if v2.exists() else ""))
    try:
        dev = block_device(path)
    except OSError as e:
        return f"cannot find the block device of {path}: {e.strerror or e}"
    probe = mount / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        for d in ("read", "write") if write else ("read",):
            (probe / f"blkio.throttle.{d}_bps_device").write_text(f"{dev} {100 * 1024 * 1024}\n")
    except OSError as e:
        return (f"cannot set a {'read or write' if write else 'read'} cap on device {dev} in {mount} "
                f"({e.strerror or e}; "
                "the throttle needs root and a writable cgroup v1 blkio hierarchy)")
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


class Throttle:
    """Cgroups capped at ``bps`` for ``device``, named ``names``; removed on exit.

    ``read`` / ``write``: which direction to cap (``read_bps_device`` /
    ``write_bps_device``); reads only by default. A write cap holds for the writes the
    cgroup's tasks submit themselves (``fsync``, direct I/O); pages the kernel's flusher
    writes back on its own are charged to the root cgroup in cgroup v1.
    """

    def __init__(self, device: str, bps: int, names: list[str], *, read: bool = True,
                 write: bool = False) -> None:
        mount = blkio_mount()
        if mount is None:
            raise RuntimeError("no cgroup v1 blkio hierarchy mounted; call unavailable() first")
        if not (read or write):
            raise ValueError("Throttle: cap reads, writes or both (read=False and write=False caps nothing)")
        self.mount, self.device, self.bps = mount, device, bps
        self.caps = [f"blkio.throttle.{d}_bps_device" for d, on in (("read", read), ("write", write)) if on]
        self.base = mount / f"{PREFIX}{os.getpid()}"
        self.paths = {n: self.base / n for n in names}

    def __enter__(self) -> Throttle:
        try:
            self.base.mkdir(exist_ok=True)
            for p in self.paths.values():
                p.mkdir()
                for cap in self.caps:
                    (p / cap).write_text(f"{self.device} {self.bps}\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def path(self, name: str) -> str:
        return str(self.paths[name])

    def bytes_served(self) -> dict[str, int]:
        """Bytes each cgroup read from the device (blkio.throttle.io_service_bytes)."""
        return {n: service_bytes(p, self.device) for n, p in self.paths.items()}

    def bytes_written(self) -> dict[str, int]:
        """Bytes each cgroup wrote to the device (the "Write" lines of io_service_bytes)."""
        return {n: service_bytes(p, self.device, "Write") for n, p in self.paths.items()}

    def close(self) -> None:
        remove_tree(self.base, self.mount)


def service_bytes(cg: str | os.PathLike[str], device: str, op: str = "Read") -> int:
    """Bytes the cgroup ``cg`` moved to or from ``device`` in direction ``op`` ("Read" or
    "Write") since it was made (blkio.throttle.io_service_bytes); 0 when unreadable."""
    try:
        for line in Path(cg, "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == device and parts[1] == op:
                return int(parts[2])
    except OSError:
        pass
    return 0


def remove_tree(base: Path, mount: Path) -> None:
    """Remove ``base`` and its child cgroups, moving any task left inside to the root."""
    if not base.exists():
        return
    for child in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [base]:
        if not child.is_dir():
            continue
        _evacuate(child, mount)
        try:
            child.rmdir()
        except OSError as e:
            # A cgroup directory holds only kernel files; rmdir fails only while a task is
            # still inside (it is moved out above) or the directory is gone already.
            if e.errno != errno.ENOENT:
                raise RuntimeError(f"cannot remove cgroup {child}: {e.strerror}; remove it with "
                                   f"`rmdir {child}` once its tasks have exited") from e


def _evacuate(cg: Path, mount: Path) -> None:
    try:
        pids = (cg / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(OSError):  # the task exited meanwhile
            (mount / "cgroup.procs").write_text(pid)


def remove_stale() -> list[str]:
    """Remove cgroups an earlier, killed benchmark run left behind (their pid is gone)."""
    mount = blkio_mount()
    removed: list[str] = []
    if mount is None:
        return removed
    for d in mount.glob(f"{PREFIX}*"):
        pid = d.name.removeprefix(PREFIX).removeprefix("probe-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_tree(d, mount)
            removed.append(str(d))
    return removed


# --- the rank side --------------------------------------------------------------------

def current(controller: str = "blkio") -> str:
    """This process's cgroup path in ``controller``'s hierarchy (from /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    raise RuntimeError(f"/proc/self/cgroup lists no {controller} hierarchy")


def join(cgroup: str) -> str:
    """Move this process (all its threads) into ``cgroup``; returns the cgroup it left."""
    mount = blkio_mount()
    assert mount is not None
    old = str(mount / current().lstrip("/"))
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    return old


def leave(old: str) -> None:
    Path(old, "cgroup.procs").write_text(str(os.getpid()))

