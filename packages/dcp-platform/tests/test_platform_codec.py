"""The control-message codec (``dcp_platform.codec``) and the store keys of ``Watch`` and the
store reductions: a value another process wrote (a pickle that would run code, random bytes,
JSON of the wrong shape, an older dcp's value) is a ``ControlMessageError`` naming the key,
or for an abort key a failure of the operation naming it; nothing is ever unpickled."""

from __future__ import annotations

import os
import pickle

import pytest
import torch.distributed as dist
from dcp_platform import ControlMessageError, PeerFailure, Watch
from dcp_platform._store_reduce import StoreReduction, _encode
from dcp_platform.codec import (
    MAX_MESSAGE_BYTES,
    decode,
    decode_failures,
    decode_ints,
    decode_strings,
    encode,
    encode_failures,
)
from hypothesis import given, settings
from hypothesis import strategies as st

RAN = []


class _Payload:
    """Unpickling this runs code (appends to RAN): a codec that unpickled would be caught."""

    def __reduce__(self):
        return (RAN.append, ("code ran",))


def _evil() -> bytes:
    return pickle.dumps(_Payload())


def test_round_trip():
    raw = encode_failures("abort", {1: ["boom", "again"], 0: ["x"]})
    assert decode_failures(raw, key="k", kind="abort", world=2) == {1: ("boom", "again"), 0: ("x",)}
    assert decode(encode("missing", [0, 3]), key="k", kind="missing") == [0, 3]
    assert decode_ints(encode("missing", [1]), key="k", kind="missing", high=2) == [1]


def test_a_pickle_is_named_as_an_older_writer_and_never_run():
    with pytest.raises(ControlMessageError) as info:
        decode_failures(_evil(), key="dcp-load/3/abort", kind="abort")
    assert info.value.key == "dcp-load/3/abort"
    assert "pickle" in info.value.writer and "dcp-load/3/abort" in str(info.value)
    assert RAN == []


@pytest.mark.parametrize(("raw", "words"), [
    (b"dcp1:" + b"x" * 10, "not valid ASCII JSON"),
    (b"dcp1:[1,2]", "exactly the fields"),
    (b'dcp1:{"k":"outcome","v":{}}', "kind 'outcome'"),
    (b'dcp1:{"k":"abort","v":[]}', "rank -> causes"),
    (b'dcp1:{"k":"abort","v":{"7":["x"]}}', "[0, 2)"),
    (b'dcp1:{"k":"abort","v":{"-1":["x"]}}', "[0, 2)"),
    (b'dcp1:{"k":"abort","v":{"0":"x"}}', "list of strings"),
    (b'dcp1:{"k":"abort","v":{"0":[1]}}', "list of strings"),
    (b'dcp1:{"k":"abort","v":{"0":["x"]},"z":1}', "exactly the fields"),
    (b'dcp1:{"k":"abort","v":{"0":[NaN]}}', "not valid"),
    (b"dcp1:\xff\xfe", "not valid ASCII"),
    (b"dcp9:{}", "not a control message"),
    (b'{"name": "w"}', "not a control message"),
    (b"", "not a control message"),
    (b"dcp1:" + b"[" * 100_000, "not valid"),
])
def test_malformed_values_name_the_key(raw, words):
    with pytest.raises(ControlMessageError) as info:
        decode_failures(raw, key="the/key", kind="abort", world=2)
    assert words in str(info.value) and "'the/key'" in str(info.value)


def test_size_and_type_are_checked_before_parsing():
    with pytest.raises(ControlMessageError, match="more than a control message"):
        decode(b"dcp1:" + b" " * MAX_MESSAGE_BYTES, key="k", kind="abort")
    with pytest.raises(ControlMessageError, match="expected bytes"):
        decode(12, key="k", kind="abort")
    with pytest.raises(ControlMessageError, match="more than"):
        decode_strings(["x"] * 1000, key="k")
    with pytest.raises(ControlMessageError, match=r"\[0, 4\)"):
        decode_ints(encode("missing", [True]), key="k", kind="missing", high=4)


def test_writers_are_named():
    cases = {b'{"name": "w", "nonce": "0"}': "plain JSON", b"dcp7:{}": "'dcp7'", _evil(): "pickle"}
    for raw, words in cases.items():
        with pytest.raises(ControlMessageError) as info:
            decode(raw, key="k", kind="open")
        assert words in (info.value.writer or ""), (raw, info.value.writer)


def test_the_error_pickles_across_processes():
    err = pickle.loads(pickle.dumps(ControlMessageError("k", "why", writer="w")))
    assert (err.key, err.why, err.writer) == ("k", "why", "w")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.builds(lambda b: b"dcp1:" + b, st.binary(max_size=200)),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                              max_leaves=12).map(lambda v: encode("abort", v))))
def test_random_values_raise_only_the_typed_error(raw):
    try:
        out = decode_failures(raw, key="k", kind="abort", world=4)
    except ControlMessageError:
        return
    assert all(0 <= r < 4 and all(isinstance(c, str) for c in cs) for r, cs in out.items())


class _Stub:
    """A one-process platform with an in-memory store: enough for Watch's store keys."""

    def __init__(self, rank: int = 0, world: int = 2, store=None):
        self._rank, self._world, self._store = rank, world, store or dist.HashStore()

    def rank(self):
        return self._rank

    def world_size(self):
        return self._world

    def store(self):
        return self._store


@pytest.mark.parametrize("value", [_evil(), b"garbage", b'dcp1:{"k":"abort","v":{"9":["x"]}}'])
def test_a_foreign_abort_key_fails_the_operation_naming_it(value):
    p = _Stub()
    p.store().set("op/1/abort", value)
    with Watch(p, "op/1", heartbeat_s=60) as w, pytest.raises(PeerFailure) as info:
        w.arrive(5.0)
    assert "ControlMessageError" in str(info.value) and "'op/1/abort'" in str(info.value)
    assert RAN == []


def test_a_foreign_missing_key_is_named():
    p = _Stub()
    p.store().set("op/2/missing", _evil())
    with pytest.raises(ControlMessageError, match="op/2/missing"):
        Watch(p, "op/2").left_behind()
    p.store().set("op/3/missing", encode("missing", [0]))
    assert Watch(p, "op/3").left_behind()


@pytest.mark.parametrize(("key", "value", "words"), [
    ("r/1", b"1,2", "before 0.7"),
    ("r/1", _evil(), "not a reduction's lanes"),
    ("r/1", b"dcp1:lanes:1,x", "decimal integers"),
    ("r/1", b"dcp1:lanes:" + b"9" * 19, "outside int64"),
    ("r/1", b"dcp1:lanes:1", "different numbers of lanes"),
])
def test_a_foreign_reduction_value_is_named(key, value, words):
    store = dist.HashStore()
    store.set(key, value)
    store.add("r/in", 1)  # the other rank counted in: this one is the last and reduces
    with pytest.raises(ControlMessageError, match=words):
        StoreReduction(store, "r", 0, 2, [1, 2], "sum", 0.001)
    assert RAN == []


def test_a_foreign_reduction_result_is_named():
    store = dist.HashStore()
    red = StoreReduction(store, "r", 0, 2, [1, 2], "sum", 0.001)
    store.set("r/out", _encode([5]))
    with pytest.raises(ControlMessageError, match="1 lanes in the result, 2 sent"):
        red.result(lambda: None, lambda start: None)
    store = dist.HashStore()
    store.set("s/out", b"\x80" + os.urandom(8))
    with pytest.raises(ControlMessageError, match="'s/out'"):
        StoreReduction(store, "s", 0, 2, [1, 2], "sum", 0.001).result(lambda: None, lambda start: None)
