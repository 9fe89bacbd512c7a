"""Functions that run inside gloo ranks for test_integ_device.py (not a test module).

Every rank's destinations are "device" memory of ``dcp_platform.testing.FakeAccelerator``;
replicated tensors are read once and broadcast from the reader's device destination.
"""

from __future__ import annotations

from typing import Any

NAMES = [f"t{i}" for i in range(12)]


def full(name: str) -> Any:
    import torch

    i = int(name[1:])
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(31 + 7 * i, 64, generator=g)


def _result(fake: Any, dst: dict[str, Any], rep: Any) -> dict[str, Any]:
    import torch

    return {"exact": [n for n in NAMES if torch.equal(dst[n], full(n))], "violations": list(fake.violations),
            "copies": fake.copies, "stream_syncs": fake.stream_syncs, "broadcasts": rep.broadcasts,
            "received": rep.bytes_received, "sent": rep.bytes_sent}


def load_broadcast(rank: int, world: int, path: str, seed: int, careless: bool) -> dict[str, Any]:
    """Load the replicated tensors into poisoned fake device memory with broadcasts;
    ``careless``: the read-ahead does not order broadcasts after their copies."""
    import dcp_load
    import torch
    import torch.distributed as dist
    from dcp_load.run import _device as run_device
    from dcp_platform.testing import FakeAccelerator

    if rank == 0:
        dcp_load.save({n: full(n) for n in NAMES}, checkpoint_id=path, no_dist=True)
    dist.barrier()
    if careless:
        run_device.DeviceLoad.publish = staticmethod(lambda engine, event: None)  # type: ignore[method-assign]
    fake = FakeAccelerator(max_delay_s=0.02 if careless else 0.003, seed=seed + rank)
    try:
        dst = {n: fake.empty(full(n).shape, torch.float32).fill_(float("nan")) for n in NAMES}
        rep = dcp_load.load(dst, checkpoint_id=path, broadcast_replicated_tensors=True, platform=fake.platform())
        return _result(fake, dst, rep)
    finally:
        fake.close()


def async_save_replicated(rank: int, world: int, path: str) -> dict[str, Any]:
    """async_save of replicated fake device tensors (each box written by one rank), the
    tensors overwritten as soon as the call returns; the checkpoint loaded back."""
    import dcp_load
    import torch
    from dcp_platform.testing import FakeAccelerator

    fake = FakeAccelerator(max_delay_s=0.01, seed=rank)
    try:
        dev = {n: fake.to_device(full(n)) for n in NAMES}
        fut = dcp_load.async_save(dev, checkpoint_id=path, platform=fake.platform())
        for v in dev.values():
            v.fill_(5)
        report = fut.result()
        out = {n: torch.zeros_like(full(n)) for n in NAMES}
        dcp_load.load(out, checkpoint_id=path)
        return {"exact": [n for n in NAMES if torch.equal(out[n], full(n))], "violations": list(fake.violations),
                "copies": fake.copies, "staged": report.staged_bytes if hasattr(report, "staged_bytes") else None}
    finally:
        fake.close()
        dcp_load.release_staging()
