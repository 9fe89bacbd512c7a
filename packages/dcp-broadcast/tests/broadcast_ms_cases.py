"""Functions that run inside MindSpore CPU workers for test_broadcast_mindspore.py (not a
test module; imports no torch). MindSpore on the CPU has no subgroups, so broadcast_items
sends every item over the world group and non-members receive into scratch and drop it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from dcp_broadcast import BroadcastItem, broadcast_items

POISON = 0x7F
# (src, ranks, element count, dtype name): groups smaller than the world, so that every
# rank is a non-member of some items, and dtypes MindSpore's CPU broadcast cannot send.
SPECS = [
    (0, (0, 1), 10, "float32"), (1, (1, 2), 7, "int64"), (2, (0, 2), 33, "uint8"),
    (0, (0, 1, 2), 5, "float16"), (2, (0, 1, 2), 1000, "int32"), (1, (0, 1), 3, "bfloat16"),
    (2, (1, 2), 4097, "float32"), (0, (0, 2), 1, "int64"),
]


def _values(index: int, count: int, np_dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(index)
    raw = rng.integers(0, 255, size=count * np_dtype.itemsize, dtype=np.uint8)
    raw[raw == POISON] = 1  # never the poison byte, so an untouched receiver shows
    return raw.view(np_dtype)


def fallback_cases(rank: int, world: int) -> dict[str, Any]:
    import mindspore as ms
    from dcp_platform import get_platform

    platform = get_platform("mindspore")
    out: dict[str, Any] = {"subgroups": platform.capabilities.subgroups}
    for batch_bytes in (0, 4096):
        refs, hosts, items = [], [], []
        for index, (src, ranks, count, name) in enumerate(SPECS):
            np_dtype = np.dtype(ms.dtype_to_nptype(platform.dtype_from_name(name)))
            ref = _values(index, count, np_dtype)
            refs.append(ref)
            nbytes = ref.nbytes
            if rank not in ranks:
                hosts.append(None)
                items.append(BroadcastItem(src, ranks, nbytes))
                continue
            host = ref.copy() if rank == src else np.full(nbytes, POISON, np.uint8).view(np_dtype)
            hosts.append(host)
            items.append(BroadcastItem(src, ranks, nbytes, ms.Tensor.from_numpy(host)))
        stats = broadcast_items(platform, items, batch_bytes=batch_bytes, check_schedule=True)
        errors = []
        for index, (host, ref) in enumerate(zip(hosts, refs, strict=True)):
            if host is not None and host.tobytes() != ref.tobytes():
                errors.append(f"rank {rank} item {index} {SPECS[index]}: wrong bytes")
        out[f"batch_bytes={batch_bytes}"] = {"stats": dataclasses.asdict(stats), "errors": errors}
    platform.synchronize()
    return out
