"""The restricted unpickler for torch DCP's ``.metadata`` is bounded: a corrupted memo index
is refused before the unpickler sizes its memo table by it, and a small pickle that reuses
shared containers to build millions of elements is refused once past its budget. Both are
UnsafePickleError (a CheckpointError), raised within milliseconds and a few MB."""

from __future__ import annotations

import io
import pickle
import time
import tracemalloc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_reader import CheckpointError, UnsafePickleError, open_checkpoint


def _bomb(reps: int, width: int = 1000) -> bytes:
    """``[torch.Size(L), torch.Size(L), ...]`` with one shared list L of ``width`` ints."""
    out = io.BytesIO()
    out.write(b"\x80\x04")
    out.write(b"]" + b"q\x00" + b"(" + b"K\x01" * width + b"e")  # memo 0: the shared list
    out.write(b"c" + b"torch\nSize\n" + b"q\x01")               # memo 1: torch.Size
    out.write(b"]q\x02(")
    for _ in range(reps):
        out.write(b"h\x01h\x00\x85R")  # Size(L)
    out.write(b"e.")
    return out.getvalue()


def test_memo_index_reproducer_is_refused_without_allocating(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04}r\x00\x00\x00\x08.")
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(UnsafePickleError, match="memo index 134217728"):
            open_checkpoint(tmp_path)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024, peak
    assert seconds < 5


def test_get_of_an_unset_memo_index_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04h\x05.")
    with pytest.raises(UnsafePickleError, match="memo index 5"):
        open_checkpoint(tmp_path)


def test_shared_reference_bomb_is_refused(tmp_path):
    data = _bomb(20000)  # 20 million elements from ~120 KB
    assert len(data) < 130_000
    (tmp_path / ".metadata").write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(UnsafePickleError, match="more than .* elements"):
        open_checkpoint(tmp_path)
    assert time.perf_counter() - t0 < 5


def test_small_reuse_is_within_budget(tmp_path):
    # A few copies of a shared list are what real pickles do: not refused by the bound
    # (the pickle then fails as "not a Metadata", a MetadataError).
    (tmp_path / ".metadata").write_bytes(_bomb(10))
    with pytest.raises(CheckpointError, match="not a Metadata"):
        open_checkpoint(tmp_path)


def test_real_metadata_still_loads(tmp_path):
    sd = {f"w{i}": torch.randn(8, 4) for i in range(50)}
    with pytest.warns(UserWarning):  # torch warns when saving without a process group
        dcp.save(sd, checkpoint_id=str(tmp_path))
    with open_checkpoint(tmp_path) as r:
        assert len(r.metadata.tensors) == 50
        c = r.metadata.tensors["w7"].chunks[0]
        assert torch.equal(r.read("w7", c, (0, 0), (8, 4)), sd["w7"])


def test_subclass_extends_the_allow_list():
    from dcp_reader.formats._torch_dcp import _RestrictedUnpickler

    class Extra(_RestrictedUnpickler):
        allowed = {**_RestrictedUnpickler.allowed, ("builtins", "complex"): complex}

    data = pickle.dumps(complex(1, 2), protocol=4)
    assert Extra(io.BytesIO(data), "x").load() == complex(1, 2)
    with pytest.raises(UnsafePickleError, match="builtins.complex"):
        _RestrictedUnpickler(io.BytesIO(data), "x").load()
    bad = b"\x80\x04}r\x00\x00\x00\x08."
    with pytest.raises(UnsafePickleError, match="memo index"):
        Extra(io.BytesIO(bad), "x").load()
