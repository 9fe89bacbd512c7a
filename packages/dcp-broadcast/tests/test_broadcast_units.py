"""Single-process checks: BroadcastItem validation, the plan (batching, threshold, flush
order, 16-byte alignment, items needing no transfer), argument validation and the error
messages, and broadcast_items on a non-distributed platform."""

from __future__ import annotations

import pytest
import torch
from dcp_broadcast import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    BroadcastItem,
    GroupManager,
    broadcast_items,
)
from dcp_broadcast._plan import build_plan
from dcp_platform import get_platform


def test_broadcast_item_normalises_and_validates():
    item = BroadcastItem(1, [0, 1, 3], 8)
    assert item.ranks == (0, 1, 3) and item.tensor is None
    with pytest.raises(ValueError, match=r"sorted and unique.*\(0, 1, 3\)"):
        BroadcastItem(1, (3, 1, 0), 8)
    with pytest.raises(ValueError, match="sorted and unique"):
        BroadcastItem(1, (1, 1), 8)
    with pytest.raises(ValueError, match="src 2 is not in ranks"):
        BroadcastItem(2, (0, 1), 8)
    with pytest.raises(ValueError, match="empty"):
        BroadcastItem(0, (), 8)
    with pytest.raises(TypeError, match="nbytes"):
        BroadcastItem(0, (0, 1), -1)
    with pytest.raises(TypeError, match="src"):
        BroadcastItem(True, (0, 1), 1)
    with pytest.raises(TypeError, match="ranks"):
        BroadcastItem(0, 5, 1)
    with pytest.raises(AttributeError):
        item.src = 0  # frozen


def test_broadcast_defaults():
    assert DEFAULT_BATCH_BYTES == 6 * 1024 * 1024 and DEFAULT_MAX_IN_FLIGHT == 8


def _items(*specs):
    return [BroadcastItem(src, ranks, n) for src, ranks, n in specs]


def test_broadcast_plan_threshold_and_alignment():
    w = (0, 1, 2, 3)
    plan = build_plan(_items((0, w, 100), (0, w, 99), (0, w, 100), (0, w, 100)), 256)
    # 100 at 0, 99 at 112, 100 at 224 would end at 324 > 256: sent, then a new batch.
    assert [(t.indices, t.offsets, t.nbytes) for t in plan] == [
        ((0, 1), (0, 112), 211), ((2, 3), (0, 112), 212)]
    plan = build_plan(_items((0, w, 255), (0, w, 256), (0, w, 257)), 256)
    assert [(t.indices, t.batched) for t in plan] == [((1,), False), ((2,), False), ((0,), True)]
    assert all(not t.batched for t in build_plan(_items((0, w, 1), (0, w, 2)), 0))


def test_broadcast_plan_keys_and_flush_order():
    plan = build_plan(_items(
        (0, (0, 1), 10), (1, (0, 1), 10), (0, (0, 3), 10), (0, (0, 1), 10),
        (3, (0, 3), 1000),  # alone, at its place
        (0, (0, 1), 90),    # overflows (0,1)/0: that batch goes here
        (2, (2,), 10),      # no receiver: nothing to send
        (0, (0, 3), 0),     # no bytes: nothing to send
    ), 100)
    assert [(t.src, t.ranks, t.indices) for t in plan] == [
        (3, (0, 3), (4,)),
        (0, (0, 1), (0, 3)),
        (1, (0, 1), (1,)),   # then the open batches in the order they were opened
        (0, (0, 3), (2,)),
        (0, (0, 1), (5,)),
    ]


def test_broadcast_rejects_bad_arguments():
    p = get_platform("torch")
    with pytest.raises(ValueError, match="batch_bytes must be an int >= 0.*-1"):
        broadcast_items(p, [], batch_bytes=-1)
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1.*0"):
        broadcast_items(p, [], max_in_flight=0)
    with pytest.raises(TypeError, match="groups must be None"):
        broadcast_items(p, [], groups=[(0, 1)])
    with pytest.raises(TypeError, match="prepare must be callable"):
        broadcast_items(p, [], prepare=3)
    with pytest.raises(TypeError, match="sequence of BroadcastItem"):
        broadcast_items(p, iter([]))


def test_broadcast_local_item_errors_name_every_offender():
    p = get_platform("torch")  # not distributed: rank 0 of a world of 1
    items = [BroadcastItem(0, (0,), 8, torch.zeros(3)), BroadcastItem(0, (0, 1), 4, torch.zeros(1)),
             BroadcastItem(0, (0,), 4), "not an item"]
    with pytest.raises(ValueError) as info:
        broadcast_items(p, items)
    message = str(info.value)
    assert "item 0: tensor on rank 0 has 12 bytes" in message and "nbytes=8" in message
    assert "item 1: ranks (0, 1) exceed world size 1" in message
    assert "item 2: rank 0 is the source" in message and "tensor=None" in message
    assert "item 3 is a str" in message


def test_broadcast_single_process_moves_nothing():
    p = get_platform("torch")
    t = torch.arange(4.0)
    stats = broadcast_items(p, [BroadcastItem(0, (0,), 16, t)], check_schedule=True)
    assert (stats.broadcasts, stats.items, stats.bytes_sent) == (0, 0, 0)
    assert torch.equal(t, torch.arange(4.0))


def test_group_manager_validates():
    p = get_platform("torch")
    with pytest.raises(TypeError, match="mapping"):
        GroupManager(p, supplied=[((0, 1), None)])
    with pytest.raises(ValueError, match=r"sorted and unique, got \(1, 0\)"):
        GroupManager(p, supplied={(1, 0): None})
    with GroupManager(p) as manager:
        with pytest.raises(KeyError, match=r"no group for ranks \(0, 1\)"):
            manager.get((0, 1))
    with pytest.raises(RuntimeError, match="closed"):
        manager.ensure([(0,)])


class _UndestroyablePlatform:
    """Two ranks seen from rank 0 of a job whose group destruction fails (a lost peer)."""

    capabilities = get_platform("torch").capabilities

    def rank(self):
        return 0

    def world_size(self):
        return 3

    def is_distributed(self):
        return True

    def all_gather_object(self, obj):
        return [obj, obj, []]

    def new_group(self, ranks):
        return ("group", tuple(ranks))

    def destroy_group(self, group):
        raise RuntimeError(f"cannot destroy {group}: connection closed by peer")

    def synchronize(self):
        pass


def test_group_manager_close_after_error_keeps_the_original_error(caplog):
    manager = GroupManager(_UndestroyablePlatform())
    with pytest.raises(ValueError, match="the original failure") as info:
        with manager:
            manager.ensure([(0, 1)])
            assert manager.created == ((0, 1),)
            raise ValueError("the original failure")
    assert info.value.__context__ is None
    assert "could not destroy groups" in caplog.text and "connection closed by peer" in caplog.text
    # Without an error in flight, a failed destruction still raises.
    manager = GroupManager(_UndestroyablePlatform())
    with pytest.raises(RuntimeError, match=r"could not destroy groups: \(0, 1\)"):
        with manager:
            manager.ensure([(0, 1)])
