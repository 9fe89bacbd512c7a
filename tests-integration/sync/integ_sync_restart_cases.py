"""Functions that run inside ranks for test_integ_sync_restart (not a test module).

Each job is its own ``run_ranks`` launch (its own default gloo group); a job's ranks join a
transfer group through a TCPStore on 127.0.0.1 (``dcp_load.transfer_group``). These cases
re-create groups on one port: a trainer that restarts, both sides rejoining after
``close()``, a second group or a second process claiming a taken place, and the store's
owner gone. Destinations are poisoned (NaN, which no source holds) before each transfer.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import dcp_load
import torch

#: Bound of every wait in these cases: a failure is expected within it, never a hang.
TIMEOUT_S = 10.0


def join(side: str, rank: int, port: int, sizes: tuple[int, int] = (1, 1), name: str = "weights",
         timeout: float = TIMEOUT_S) -> Any:
    return dcp_load.transfer_group("127.0.0.1", port, side=side, rank=rank, world_sizes=sizes, timeout=timeout,
                                   name=name)


def value(launch: int, step: int) -> float:
    return float(100 * launch + step)


def send(side: str, group: Any, launch: int, step: int) -> tuple[Any, float]:
    """One transfer of ``w`` (all ``value(launch, step)``): (what the engine got, or the
    error's text; seconds)."""
    src = {"w": torch.full((4, 4), value(launch, step))} if side == "trainer" else {}
    dst = {"w": torch.full((4, 4), float("nan"))} if side == "engine" else {}
    start = time.monotonic()
    try:
        dcp_load.transfer(src, dst, process_group=group, timeout=TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    got = sorted(set(dst["w"].flatten().tolist())) if dst else None
    return got, time.monotonic() - start


def trainer_launch(rank: int, world: int, port: int, launch: int, steps: int) -> list[Any]:
    """One launch of a trainer: join, ``steps`` transfers, close (then the process exits)."""
    group = join("trainer", rank, port)
    out = [send("trainer", group, launch, s) for s in range(steps)]
    group.close()
    return out


def _until_refused(port: int) -> None:
    """Until nothing listens on ``port`` (the old trainer exited), at most ``TIMEOUT_S``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return
        time.sleep(0.05)


def long_lived_engine(rank: int, world: int, port: int, first: int, second: int, wait: bool) -> list[Any]:
    """An engine that outlives a trainer: ``first`` transfers, close, rejoin (at once, while
    the old trainer may still serve its store, or once it exited: ``wait``) and ``second``
    transfers with the new one."""
    group = join("engine", rank, port, timeout=60)
    out = [send("engine", group, 1, s) for s in range(first)]
    group.close()
    if wait:
        _until_refused(port)
    group = join("engine", rank, port, timeout=60)
    out += [send("engine", group, 2, s) for s in range(second)]
    group.close()
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rejoin_cycles(rank: int, world: int, side: str, port: int, cycles: int) -> dict[str, Any]:
    """Both sides: join, transfer, close, drop the group, ``cycles`` times on one port."""
    from dcp_load.transferring import _kept

    got, fds, kept = [], [], []
    for cycle in range(cycles):
        start = time.monotonic()
        try:
            group = join(side, rank, port)
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            got.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
            break
        got.append(send(side, group, 1, cycle))
        group.close()
        kept.append(group.dcp_group_key in _kept._PLANS)
        del group
        fds.append(_fds())
    return {"got": got, "fds": fds, "kept": kept}


def two_names_one_port(rank: int, world: int, side: str, port: int) -> dict[str, Any]:
    """Group "policy" holds the port; both sides then ask for group "ref" on it."""
    group = join(side, rank, port, name="policy")
    start = time.monotonic()
    try:
        join(side, rank, port, name="ref", timeout=5)
        message = None
    except dcp_load.TransferGroupError as exc:
        message = str(exc)
    seconds = time.monotonic() - start
    policy = send(side, group, 1, 0)  # the first group still works
    group.close()
    return {"message": message, "seconds": seconds, "policy": policy}


def duplicate_engine(rank: int, world: int, side: str, port: int, marks: str) -> dict[str, Any]:
    """Both processes of the engine job pass rank=0 (world_sizes=(1, 1)); the trainer keeps
    the group open until both have their result."""
    start = time.monotonic()
    mine = Path(marks) / f"engine-{rank}"
    try:
        group = join(side, 0, port)
    except dcp_load.TransferGroupError as exc:
        mine.touch()
        return {"message": str(exc), "seconds": time.monotonic() - start}
    got = send(side, group, 1, 0)
    if side == "engine":
        mine.touch()
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while side == "trainer" and len(list(Path(marks).glob("engine-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    group.close()
    return {"got": got, "seconds": time.monotonic() - start}


def owner_dies(rank: int, world: int, side: str, port: int) -> dict[str, Any]:
    """Trainer rank 0, which serves the store, exits right after joining; the engine then
    calls transfer."""
    group = join(side, rank, port)
    store = group.get_group_store()
    if side == "trainer":  # leaves once the engine has joined too (its join reads the store to the end)
        deadline = time.monotonic() + TIMEOUT_S
        while store.add("owner-test/engine-joined", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(0)
    store.add("owner-test/engine-joined", 1)
    _until_refused(port)
    got, seconds = send(side, group, 1, 0)
    return {"got": got, "seconds": seconds}
