"""Functions that run inside ranks for test_integ_read_once_torch_dcp (not a test module):
the FSDP-style save by torch.distributed.checkpoint itself. The loads are
integ_read_once_cases' (the same tensors, cases and measurement)."""

from __future__ import annotations

import warnings

from integ_read_once_cases import NAMES, full


def save_fsdp(rank: int, world: int, path: str) -> None:
    """Every tensor as a DTensor ``Shard(0)`` over all ranks (what FSDP2 holds), saved with
    torch DCP's default ``FileSystemWriter``: one ``__{rank}_0.distcp`` per rank."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {n: distribute_tensor(full(n) if n != "norm" else full(n)[0], mesh, [Shard(0)], src_data_rank=None)
          for n in NAMES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=path)
