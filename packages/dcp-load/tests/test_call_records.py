"""The call records that let a call that fails to pair name both calls (run/_calls.py): what a
rank wrote reads back; what another process wrote instead (a pickle that would run code, JSON
of another shape, random bytes) is reported as unreadable, never trusted or run; a late rank
is told apart from one whose partners gave up a different call."""

from __future__ import annotations

import json
import os
import pickle

import pytest
from dcp_load.run import _calls
from dcp_platform.codec import encode
from hypothesis import given, settings
from hypothesis import strategies as st

MARKER = "/tmp/dcp-call-records-ran"


class _Ran:
    def __reduce__(self):
        return (open, (MARKER, "w"))


class DictStore:
    """The three store calls the records use, over a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(_calls, "_LAST", {})
    monkeypatch.setattr(_calls, "_ALONE", {})
    monkeypatch.setattr(_calls, "_ALONE_BEFORE", {})


def test_a_record_reads_back_with_the_call_before_it():
    store = DictStore()
    _calls.note_call(store, "world", 0, "load call 3 of /ck/a", 3)
    _calls.note_call(store, "world", 0, "load call 4 of /ck/b", 4)
    _calls.note_call(store, "world", 1, "load of /ck/a without collectives (no_dist=True)")
    assert _calls.latest_calls(store, "world", [0, 1, 2]) == {
        0: "load call 4 of /ck/b", 1: "load of /ck/a without collectives (no_dist=True)", 2: "no call recorded"}
    assert _calls._read(store, "world", 0)["before"] == [3, "load call 3 of /ck/a"]


def test_a_late_rank_is_told_apart_from_a_call_it_never_made():
    store = DictStore()
    _calls.note_call(store, "world", 0, "load call 7 of /ck/a", 7)  # given up: rank 1 never came
    _calls.note_call(store, "world", 0, "load call 8 of /ck/b", 8)  # where rank 0 waits now
    # rank 1 comes to call 7 with a load of /ck/b, having made no call alone: late, with another checkpoint
    _calls._ALONE.clear()  # the records above were rank 0's
    _calls._ALONE_BEFORE.clear()
    _calls.note_call(store, "world", 1, "load call 7 of /ck/b", 7)
    assert not _calls.others_moved_past(store, "world", 0, 7, "load call 7 of /ck/b")
    # rank 1 loaded /ck/a without collectives where rank 0 made call 7: call 8 is this one
    _calls._ALONE_BEFORE.clear()
    _calls.note_call(store, "world", 1, "load of /ck/a without collectives (no_dist=True)")
    _calls.note_call(store, "world", 1, "load call 7 of /ck/b", 7)
    assert _calls.others_moved_past(store, "world", 0, 7, "load call 7 of /ck/b")
    # rank 1 comes to call 7 with the load of /ck/a rank 0 gave up: it is late
    assert not _calls.others_moved_past(store, "world", 0, 7, "load call 7 of /ck/a")
    # rank 0 is not (yet) in the next call, or it is beyond it: late, as far as is known
    assert not _calls.others_moved_past(store, "world", 0, 6, "load call 6 of /ck/b")
    assert not _calls.others_moved_past(store, "world", 0, 8, "load call 8 of /ck/b")
    assert not _calls.others_moved_past(store, "world", 1, 7, "load call 7 of /ck/b")  # no record


def test_an_arrival_failure_names_both_calls():
    store = DictStore()
    _calls.note_call(store, "world", 1, "save call 2 of /ck/s", 2)
    failures = {1: ("did not reach dcp-load within 5 s of the first rank (ranks arrived: 1 of 2)",)}
    out = _calls.with_calls(failures, 0, "load call 9 of /ck/a", store, "world", 2)
    assert out[1][1] == "its latest call: save call 2 of /ck/s; this rank's call: load call 9 of /ck/a"
    # the late rank's own view: named missing by the others, told what they are in now
    _calls.note_call(store, "world", 0, "load call 10 of /ck/b", 10)
    late = _calls.with_calls({1: failures[1]}, 1, "load call 9 of /ck/a", store, "world", 2)
    assert "came after the other ranks gave up on it" in late[1][1] and "rank 0 is in: load call 10 of /ck/b" in \
        late[1][1]
    other = {0: ("ValueError: bad",)}  # a failure that is not an arrival: left as it is
    assert _calls.with_calls(other, 1, "load call 9", store, "world", 2) == other


HOSTILE = [pickle.dumps(_Ran()), b"", b"dcp1:", encode("abort", {"0": ["x"]}), encode("now", ["load"]),
           encode("now", {"what": 7, "slot": 1, "before": None}), encode("now", {"what": "x", "slot": True,
                                                                                 "before": None}),
           encode("now", {"what": "x", "slot": 1, "before": [1, 2]}), encode("now", {"what": "x", "slot": "1",
                                                                                     "before": None}),
           b"dcp1:" + b"[" * 50_000, b"dcp1:" + json.dumps({"k": "now", "v": {"what": "y" * 10**6}}).encode(),
           os.urandom(64)]


@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
def test_a_foreign_record_is_unreadable_never_trusted(raw):
    store = DictStore()
    store.data["dcp-now/world/0"] = raw
    text = _calls.latest_calls(store, "world", [0])[0]
    assert text.startswith(("unreadable record", "record not read")), text
    assert len(text) < 2000
    assert _calls.others_moved_past(store, "world", 0, 3, "load call 3 of /ck/a") is False
    assert not os.path.exists(MARKER)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                              lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                              max_leaves=10).map(lambda v: encode("now", v))))
def test_any_value_under_a_record_key_gives_text_or_false(raw):
    store = DictStore()
    store.data["dcp-now/world/0"] = raw
    assert isinstance(_calls.latest_calls(store, "world", [0])[0], str)
    assert _calls.others_moved_past(store, "world", 0, 3, "load call 3 of /ck/a") in (True, False)
