"""A non-tensor value already serialised by ``torch.save`` on the rank that holds it.

torch DCP stores a non-tensor value from whichever rank holds it; dcp's torch-format save
writes values from rank 0 (``dcp_load.saving._rank_values`` sends rank 0 the values only other
ranks hold). A value that is not plain data is serialised by its holder, and rank 0 writes
the holder's bytes as they are (``TorchDcpWriter.write_values``): bytes from another process
are never unpickled.
"""

from __future__ import annotations

__all__ = ["TorchSavedValue"]


class TorchSavedValue:
    """``blob``: the bytes ``torch.save(value)`` wrote on the holding rank (``rank``)."""

    __slots__ = ("blob", "rank")

    def __init__(self, blob: bytes, rank: int):
        self.blob, self.rank = bytes(blob), int(rank)

    def __reduce__(self):  # the writer's own encode step pickles values within one process
        return (TorchSavedValue, (self.blob, self.rank))

    def __repr__(self) -> str:
        return f"TorchSavedValue({len(self.blob)} bytes from rank {self.rank})"
