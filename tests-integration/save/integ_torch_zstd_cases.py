"""In-rank functions of test_integ_torch_zstd: integ_torch_format_cases' state dict (DTensors
sharded on rows, on a trailing dim and unevenly, replicated ones, bf16 and int64, a plain
tensor, nested keys, values) saved on 2 real gloo ranks through torch's ZStandard extension
by torch DCP's own ``save`` and by ``dcp_load.torch_compat`` (``save``, ``async_save``), then
loaded by torch DCP's ``load``, ``dcp_load.load`` and ``torch_compat.load`` into poisoned
targets of another sharding."""

from __future__ import annotations

import os
from typing import Any

import integ_torch_format_cases as plain_cases

#: Checkpoint directories under the test's root, by who wrote them.
DIRS = ("torch", "dcp", "dcp-async")


def _writer(root: str, d: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    return FileSystemWriter(os.path.join(root, d), _extensions=[ZStandard()])


def save_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every directory of ``DIRS`` saved compressed from the same state; the files each holds."""
    import dcp_load.torch_compat as compat
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = plain_cases._state(mesh, plain_cases._placements(False), poison=False)
    tdcp.save(state, storage_writer=_writer(root, "torch"))
    compat.save(state, storage_writer=_writer(root, "dcp"))
    compat.async_save(state, storage_writer=_writer(root, "dcp-async")).result()
    return {d: sorted(os.listdir(os.path.join(root, d))) for d in DIRS}


def load_all(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each directory loaded by torch DCP, dcp and torch_compat into poisoned targets of another sharding."""
    import dcp_load
    import dcp_load.torch_compat as compat
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for d in DIRS:
        for who, load in (("torch", tdcp.load), ("dcp", dcp_load.load), ("compat", compat.load)):
            target = plain_cases._state(mesh, plain_cases._placements(True), poison=True)
            target["extra"] = {k: None for k in plain_cases.VALUES}
            load(target, checkpoint_id=os.path.join(root, d))
            out[f"{who}<-{d}"] = plain_cases._plain(target)
    return out
