"""One rank reads a checkpoint's index; the others receive it.

In an object store, every rank listing the bucket and reading the index and headers costs
N x the requests (S3 answers 503 SlowDown when many ranks list at once). Rank 0 opens the
checkpoint; its metadata (JSON) reaches the others in one exchange, which also carries any
rank's failure to every rank; they open a reader on it without listing or reading anything.
"""

from __future__ import annotations

from typing import Any

from ._coordinate import Coordinator
from ._validate import exchange


def open_shared(coord: Coordinator, platform: Any, checkpoint_id: str, errors: list[str], *,
                allow_pickle: bool) -> Any:
    """This rank's reader of ``checkpoint_id`` (call on every rank, collectively). A failure
    on any rank (``errors``, or rank 0's open) raises ``LoadError`` on every rank."""
    from dcp_reader import CheckpointMetadata, open_checkpoint

    reader = payload = None
    if platform.rank() == 0 and not errors:
        try:
            reader = open_checkpoint(checkpoint_id, allow_pickle=allow_pickle, rank=0)
            payload = reader.metadata.to_json()
        except Exception as exc:  # noqa: BLE001 - reaches every rank through the exchange
            errors.append(f"{type(exc).__name__}: {exc}")
    try:
        gathered = coord.exchange(exchange, errors, "validate", collective=True, payload=payload)
        if reader is None:
            reader = open_checkpoint(checkpoint_id, allow_pickle=allow_pickle,
                                     metadata=CheckpointMetadata.from_json(gathered[0]))
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    return reader


def local_storage(checkpoint_id: Any) -> bool:
    """Whether the checkpoint's storage is ``local`` (a directory, not an object store), as
    ``dcp_reader.storage`` answers it without opening anything (None: a directory)."""
    from dcp_reader.storage import storage_type

    return storage_type(checkpoint_id).local
