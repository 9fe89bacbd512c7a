"""Functions that run inside gloo ranks for test_integ_device.py (not a test module).

Every rank's destinations are "device" memory of ``dcp_platform.testing.FakeAccelerator``
with ``hold_s=None``: a copy runs only once something waits for it, so a wait the device
path leaves out shows as a wrong value (poison: NaN) on some rank, never by chance;
replicated tensors are read once and broadcast from the reader's device destination.
"""

from __future__ import annotations

from typing import Any

NAMES = [f"t{i}" for i in range(12)]

#: Destinations: float32 as saved, bfloat16 (cast on the device after the transfer), a
#: transposed float32 view (a strided write on the device after the transfer).
LAYOUTS = ("plain", "cast", "strided")


def full(name: str) -> Any:
    import torch

    i = int(name[1:])
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(31 + 7 * i, 64, generator=g)


def expected(name: str, layout: str) -> Any:
    import torch

    return full(name).to(torch.bfloat16) if layout == "cast" else full(name)


def _destination(fake: Any, name: str, layout: str) -> Any:
    """Poisoned (NaN) fake device memory for ``name``: float32, bf16 (a cast on the
    device after the transfer) or a transposed float32 view (a strided write there)."""
    import torch

    rows, cols = full(name).shape
    if layout == "cast":
        out = fake.empty((rows, cols), torch.bfloat16)
    elif layout == "strided":
        out = fake.empty((cols, rows), torch.float32).t()
    else:
        out = fake.empty((rows, cols), torch.float32)
    return out.fill_(float("nan"))


def _result(fake: Any, dst: dict[str, Any], rep: Any, layout: str) -> dict[str, Any]:
    import torch

    return {"exact": [n for n in NAMES if torch.equal(dst[n], expected(n, layout))],
            "nan": [n for n in NAMES if bool(torch.isnan(dst[n].float()).any())],
            "violations": list(fake.violations), "copies": fake.copies, "stream_syncs": fake.stream_syncs,
            "broadcasts": rep.broadcasts, "received": rep.bytes_received, "sent": rep.bytes_sent}


def _save_once(rank: int, path: str) -> None:
    import dcp_load
    import torch.distributed as dist

    if rank == 0:
        dcp_load.save({n: full(n) for n in NAMES}, checkpoint_id=path, no_dist=True)
    dist.barrier()


def _load(path: str, seed: int, layout: str) -> dict[str, Any]:
    """One load with broadcasts into poisoned fake device memory; the values as ``load``
    returned them."""
    import dcp_load
    from dcp_platform.testing import FakeAccelerator

    fake = FakeAccelerator(max_delay_s=0.002, seed=seed, hold_s=None)
    try:
        dst = {n: _destination(fake, n, layout) for n in NAMES}
        rep = dcp_load.load(dst, checkpoint_id=path, broadcast_replicated_tensors=True, platform=fake.platform())
        return _result(fake, dst, rep, layout)
    finally:
        fake.close()


def load_layouts(rank: int, world: int, path: str, seed: int) -> dict[str, Any]:
    """Every layout of ``LAYOUTS`` loaded with broadcasts, each wait in place: {layout: result}."""
    _save_once(rank, path)
    return {layout: _load(path, seed + rank, layout) for layout in LAYOUTS}


def load_broadcast(rank: int, world: int, path: str, seed: int, careless: bool, layout: str = "plain"
                   ) -> dict[str, Any]:
    """Load the replicated tensors with broadcasts; ``careless``: the read-ahead does not
    order broadcasts after their copies (``DeviceLoad.publish`` removed)."""
    from dcp_load.run import _device as run_device

    _save_once(rank, path)
    if careless:
        run_device.DeviceLoad.publish = staticmethod(lambda engine, event: None)  # type: ignore[method-assign]
    return _load(path, seed + rank, layout)


def async_save_replicated(rank: int, world: int, path: str, careless: bool = False) -> dict[str, Any]:
    """async_save of replicated fake device tensors (each box written by one rank), the
    tensors overwritten as soon as the call returns; the checkpoint loaded back.
    ``careless``: staging does not wait for its device-to-host copies (the engine's
    ``wait_event`` removed)."""
    import dcp_load
    import torch
    from dcp_platform.testing import FakeAccelerator

    fake = FakeAccelerator(max_delay_s=0.002, seed=rank, hold_s=None)
    if careless:
        fake.engine.wait_event = lambda event: None  # type: ignore[method-assign]
    try:
        dev = {n: fake.to_device(full(n)) for n in NAMES}
        fut = dcp_load.async_save(dev, checkpoint_id=path, platform=fake.platform())
        for v in dev.values():
            v.fill_(5)
        fut.result()
        out = {n: torch.zeros_like(full(n)) for n in NAMES}
        dcp_load.load(out, checkpoint_id=path)
        return {"exact": [n for n in NAMES if torch.equal(out[n], full(n))],
                "nan": [n for n in NAMES if bool(torch.isnan(out[n]).any())],
                "fives": [n for n in NAMES if bool((out[n] == 5).all())],
                "violations": list(fake.violations), "copies": fake.copies}
    finally:
        fake.close()
        dcp_load.release_staging()
