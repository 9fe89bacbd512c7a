"""The single-writer lock belongs to the process that took it: children forked while it is
held (DataLoader workers, ``os.fork``) do not keep it, so ``release`` in the parent frees
the directory for the next writer while those children still live."""

from __future__ import annotations

import os
import time

import pytest
import torch
from dcp_reader import WriterLock, WriterLockError
from torch.utils.data import DataLoader, Dataset


class _Slow(Dataset):
    """Items that take a while: the workers are alive while the test checks the lock."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.2)
        return torch.tensor([i])


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    lock = WriterLock(str(tmp_path)).acquire()
    read, write = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say it runs, then wait until the parent says it may go
        os.close(write)
        os.write(ready_w, b"r")
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.read(ready_r, 1)  # the child runs (its fork handlers ran before its first line)
    try:
        with pytest.raises(WriterLockError, match=f"pid {os.getpid()}"):
            WriterLock(str(tmp_path)).acquire()  # held by this process, as it should be
        lock.release()
        WriterLock(str(tmp_path)).acquire().release()  # the child lives, the lock is free
    finally:
        os.write(write, b"x")
        os.close(write)
        os.waitpid(pid, 0)


def test_dataloader_workers_started_while_held(tmp_path):
    lock = WriterLock(str(tmp_path)).acquire()
    loader = DataLoader(_Slow(), batch_size=1, num_workers=2, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)  # the workers are forked and running
    lock.release()
    second = WriterLock(str(tmp_path)).acquire()  # refused with 'pid <this pid>' before
    second.release()
    assert sum(1 for _ in batches) == 7
