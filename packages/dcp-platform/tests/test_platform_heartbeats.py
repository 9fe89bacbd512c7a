"""The process's one heartbeat thread, on an in-memory store: every open ``Watch`` is beaten
on its own ``heartbeat_s`` until it closes, and not once after; ``close`` waits out a beat
in progress; the successor's staleness and the abort key are still found; one thread
serves every watch, and a forked child starts its own."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from dcp_platform import HEARTBEAT_THREAD, PeerFailure, Watch
from dcp_platform.codec import encode_failures


class _Store:
    """The part of a c10d store a Watch uses; every ``add`` of a nonzero amount is logged."""

    def __init__(self, slow_add: float = 0.0):
        self.data: dict[str, Any] = {}
        self.adds: list[tuple[str, float]] = []
        self.slow_add = slow_add
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        if n and self.slow_add:
            time.sleep(self.slow_add)
        with self.lock:
            self.data[key] = self.data.get(key, 0) + n
            if n:
                self.adds.append((key, time.monotonic()))
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def get(self, key: str) -> Any:
        with self.lock:
            return self.data[key]

    def set(self, key: str, value: Any) -> None:
        with self.lock:
            self.data[key] = value

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        with self.lock:
            if self.data.get(key, "") == expected:
                self.data[key] = desired
            return self.data[key]

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def beats(self, key: str, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for k, t in self.adds if k == key and t > since)


class _Platform:
    def __init__(self, store: _Store, rank: int = 0, world: int = 1):
        self._store, self._rank, self._world = store, rank, world

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world

    def store(self) -> _Store:
        return self._store


def _heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == HEARTBEAT_THREAD]


def test_each_open_watch_beats_on_its_own_interval_and_never_after_close():
    store = _Store()
    fast = Watch(_Platform(store), "hb/fast", heartbeat_s=0.05)
    slow = Watch(_Platform(store), "hb/slow", heartbeat_s=0.2)
    with fast, slow:
        time.sleep(0.7)
    closed = time.monotonic()
    fast_beats, slow_beats = store.beats("hb/fast/hb/0") - 1, store.beats("hb/slow/hb/0") - 1  # less __enter__'s
    assert 6 <= fast_beats <= 14, fast_beats
    assert 2 <= slow_beats <= 4, slow_beats
    assert "hb/fast/hb/0" not in store.data and "hb/slow/hb/0" not in store.data
    time.sleep(0.3)
    assert store.beats("hb/fast/hb/0", closed) == 0 and store.beats("hb/slow/hb/0", closed) == 0


def test_close_waits_for_a_beat_in_progress():
    """A beat stuck in a slow store: close returns only after it, so no beat re-creates the
    heartbeat key close removed."""
    store = _Store(slow_add=0.3)
    watch = Watch(_Platform(store), "hb/busy", heartbeat_s=0.05)
    store.slow_add = 0.0
    with watch:
        store.slow_add = 0.3
        time.sleep(0.1)  # the first beat is in its add now
    closed = time.monotonic()
    store.slow_add = 0.0
    time.sleep(0.5)  # past the end of a beat that close had not waited for
    assert "hb/busy/hb/0" not in store.data and store.beats("hb/busy/hb/0", closed) == 0


def test_a_stale_successor_is_named_and_an_abort_is_read():
    store = _Store()
    store.set("hb/stale/all", "1")  # both ranks arrived; rank 1's heartbeat never changes after
    store.add("hb/stale/hb/1", 1)
    with Watch(_Platform(store, rank=0, world=2), "hb/stale", heartbeat_s=0.05, stale_s=0.3) as w:
        w.arrive(5.0)
        end = time.monotonic() + 3.0
        while time.monotonic() < end and not w._aborted.is_set():
            time.sleep(0.02)
        with pytest.raises(PeerFailure) as exc:
            w.check()
    assert list(exc.value.failures) == [1] and "stopped responding" in exc.value.failures[1][0]

    with Watch(_Platform(store, rank=0, world=2), "hb/abort", heartbeat_s=0.05) as w:
        store.set("hb/abort/abort", encode_failures("abort", {1: ("boom",)}))
        with pytest.raises(PeerFailure) as exc:
            w.wait_event(threading.Event())
    assert exc.value.failures == {1: ("boom",)}


def test_one_thread_serves_every_watch():
    store = _Store()
    with Watch(_Platform(store), "hb/warm", heartbeat_s=0.05):
        pass
    before = threading.active_count()
    watches = [Watch(_Platform(store), f"hb/many/{i}", heartbeat_s=0.05) for i in range(8)]
    for w in watches:
        w.__enter__()
    time.sleep(0.2)
    during = threading.active_count()
    for w in watches:
        w.close()
    assert during == before == threading.active_count() and len(_heartbeat_threads()) == 1
    assert all(store.beats(f"hb/many/{i}/hb/0") >= 3 for i in range(8))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_beats_on_a_thread_of_its_own():
    store = _Store()
    with Watch(_Platform(store), "hb/parent", heartbeat_s=0.05):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its store is a copy; beats must reach it from a new thread
            try:
                with Watch(_Platform(store), "hb/child", heartbeat_s=0.05):
                    time.sleep(0.3)
                os.write(write, bytes([min(store.beats("hb/child/hb/0"), 255)]))
            finally:
                os._exit(0)
        os.close(write)
        beats = os.read(read, 1)[0]
        os.close(read)
        os.waitpid(pid, 0)
    assert beats >= 3, beats
