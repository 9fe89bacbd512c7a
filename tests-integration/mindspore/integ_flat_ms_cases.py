"""The function that runs inside MindSpore CPU workers for test_integ_load_flat_mindspore
(not a test module): ``Flat`` destinations over MindSpore buffers (``flat_views``), whose
slices do not write through on the CPU, so each view names its part of the one buffer."""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np

# The flat space (float32), in order: uneven, a 3-D and a 0-dim tensor.
SPACE = [("a", (7, 5)), ("b", (12,)), ("c", (3, 4, 3)), ("s", ())]
TOTAL = sum(int(np.prod(s)) for _, s in SPACE)
ZERO2 = [(0, 37), (37, TOTAL - 37)]  # (offset, numel) of each worker's partition: cut inside rows
REPLICA = (10, 50)  # an interval both workers hold (DP2): read once, broadcast


def values() -> dict[str, np.ndarray]:
    return {n: ((np.arange(int(np.prod(s)), dtype=np.float32) * (k + 3)) % 101).reshape(s)
            for k, (n, s) in enumerate(SPACE)}


def space_values() -> np.ndarray:
    return np.concatenate([v.reshape(-1) for v in values().values()])


def _buffer(n: int) -> Any:
    import mindspore as ms

    return ms.Tensor(np.full((n,), np.nan, dtype=np.float32))


def ms_flat_case(rank: int, world: int, hf_path: str, save_path: str) -> dict[str, Any]:
    import dcp_load
    import mindspore as ms

    os.environ["DCP_HOST_ID"] = f"node{rank}"  # a node each: replicated boxes are broadcast
    out: dict[str, Any] = {"errors": []}
    want = space_values()

    def check(buf: Any, offset: int, where: str) -> None:
        got = buf.asnumpy()
        if not np.array_equal(got, want[offset:offset + got.size]):
            out["errors"].append(f"rank {rank} {where}: {got[:6]}..., expected {want[offset:offset + 6]}...")

    try:
        offset, numel = ZERO2[rank]
        buf = _buffer(numel)
        views = dcp_load.flat_views(SPACE, buf, offset)
        out["names"] = sorted(views)
        r = dcp_load.load(views, checkpoint_id=hf_path)
        check(buf, offset, "zero2")
        out["zero2"] = {"bytes_read": r.bytes_read, "bytes_needed": r.bytes_needed}

        rep = _buffer(REPLICA[1])
        chunk = ms.Tensor(np.full((2, 5), np.nan, dtype=np.float32))  # mixed with a Chunk
        state = {**dcp_load.flat_views(SPACE, rep, REPLICA[0])}
        state["a"] = dcp_load.Chunk(chunk, (7, 5), (5, 0))  # in place of a's flat view: rows 5-6 only
        r = dcp_load.load(state, checkpoint_id=hf_path, broadcast_replicated_tensors=True)
        got = rep.asnumpy()
        if not np.array_equal(got[25:], want[35:60]) or not np.isnan(got[:25]).all():
            out["errors"].append(f"rank {rank} replica: {got}")
        if not np.array_equal(chunk.asnumpy(), values()["a"][5:7]):
            out["errors"].append(f"rank {rank} replica chunk: {chunk.asnumpy()}")
        out["replica"] = {"bytes_read": r.bytes_read, "bytes_received": r.bytes_received,
                          "broadcasts": r.broadcasts, "job_unique_bytes": r.job_unique_bytes}

        buf.asnumpy()[...] = want[offset:offset + numel]
        saved = dcp_load.save(dcp_load.flat_views(SPACE, buf, offset), checkpoint_id=save_path)
        out["saved_chunks"] = saved.chunks_written
        whole = {n: ms.Tensor(np.full(s, np.nan, dtype=np.float32)) for n, s in SPACE}
        dcp_load.load(whole, checkpoint_id=save_path)
        for n, v in values().items():
            if not np.array_equal(whole[n].asnumpy(), v):
                out["errors"].append(f"rank {rank} saved flat -> whole: {n!r} holds {whole[n].asnumpy()}")
    except Exception:  # noqa: BLE001 - returned for the test to show
        out["errors"].append(traceback.format_exc())
    return out
