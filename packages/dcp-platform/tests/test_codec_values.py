"""The codec for values exchanged between ranks (``dcp_platform.codec.pack``/``unpack``):
plain data round-trips exactly (types included: a tuple stays a tuple, a bool a bool);
anything else is refused on the sender with its type named; bytes that are not the codec's
(random, mutated, hand-built attacks, a pickle that would run code) are a
``ValueMessageError`` naming the source, never a crash, a hang or code run."""

from __future__ import annotations

import math
import pickle
import struct

import pytest
from dcp_platform.codec import (
    MAX_VALUE_BYTES,
    UnsendableValueError,
    ValueMessageError,
    check_lengths,
    pack,
    pack_or_refusal,
    unpack,
    unpack_gathered,
)
from dcp_platform.codec._values import MAX_DEPTH, VALUES_PREFIX
from hypothesis import given, settings
from hypothesis import strategies as st

RAN = []


class _Payload:
    def __reduce__(self):
        return (RAN.append, ("code ran",))


_leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(1 << 300), max_value=1 << 300)
           | st.floats(allow_nan=False) | st.text() | st.binary(max_size=64))
_keys = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.tuples(st.integers(), st.text(max_size=4))
plain = st.recursive(_leaves, lambda kids: st.lists(kids, max_size=6) | st.tuples(kids, kids)
                     | st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), min_size=1,
                                max_size=70).map(tuple)
                     | st.dictionaries(_keys, kids, max_size=5), max_leaves=40)


def _same(a, b) -> bool:
    """Equal with exact types (1 == True == 1.0 in Python, not here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, kb) and _same(a[k], b[kb]) for k, kb in zip(a, b, strict=True))
    return a == b


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_data_round_trips_with_its_types(value):
    assert _same(unpack(pack(value), source="rank 1"), value)


def test_special_values_round_trip():
    value = (math.inf, -math.inf, -0.0, "\udcff lone surrogate", b"", (), [], {}, 1 << 63, -(1 << 63) - 1,
             (1 << 63) - 1, (True, 1))
    assert _same(unpack(pack(value), source="r"), value)
    nan = unpack(pack(math.nan), source="r")
    assert math.isnan(nan)


@pytest.mark.parametrize("value, named", [
    (object(), "builtins.object"), ({"a": [1, {2}]}, "builtins.set"), (struct.Struct("<q"), "Struct"),
    ((1, 2.5j), "complex"), (type("T", (tuple,), {})((1, 2)), "T"), (bytearray(b"ab"), "bytearray"),
    (type("I", (int,), {"__repr__": lambda self: 1 / 0})(3), "I"),
], ids=["object", "set", "struct", "complex", "tuple-subclass", "bytearray", "int-subclass-raising-repr"])
def test_values_that_are_not_plain_data_are_refused_naming_the_type(value, named):
    with pytest.raises(TypeError, match=named):
        pack(value)
    with pytest.raises(UnsendableValueError, match=f"rank 3 could not send its value: .*{named}"):
        unpack(pack_or_refusal(value), source="rank 3")


def test_nesting_and_size_limits():
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="nested more than"):
        pack(deep)
    loop: list = []
    loop.append(loop)
    with pytest.raises(UnsendableValueError):
        unpack(pack_or_refusal(loop), source="rank 0")
    with pytest.raises(ValueError, match="too large"):
        pack(1 << 10_000)
    with pytest.raises(ValueMessageError, match="rank 1.*announced"):
        check_lengths([10, MAX_VALUE_BYTES + 1])
    with pytest.raises(ValueMessageError, match="rank 0.*announced"):
        check_lengths([0, 10])
    check_lengths([len(VALUES_PREFIX), MAX_VALUE_BYTES])


def test_a_pickle_is_refused_and_never_run():
    for raw in (pickle.dumps(_Payload()), VALUES_PREFIX + pickle.dumps(_Payload())):
        with pytest.raises(ValueMessageError, match="rank 2"):
            unpack(raw, source="rank 2")
    assert RAN == []


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


ATTACKS = {
    "empty": b"",
    "prefix only": VALUES_PREFIX,
    "unknown tag": VALUES_PREFIX + b"Z",
    "string longer than the payload": VALUES_PREFIX + b"s" + _u32(1 << 31) + b"abc",
    "bytes longer than the payload": VALUES_PREFIX + b"b" + _u32(5) + b"ab",
    "a count of 4 billion items": VALUES_PREFIX + b"l" + _u32(0xFFFFFFFF) + b"N",
    "dict count beyond the bytes": VALUES_PREFIX + b"d" + _u32(1000) + b"NN",
    "truncated int": VALUES_PREFIX + b"i\x01\x02",
    "truncated float": VALUES_PREFIX + b"f\x00",
    "zero-length vector": VALUES_PREFIX + b"v\x00",
    "vector of 200": VALUES_PREFIX + b"v\xc8" + b"\x00" * 1600,
    "truncated vector": VALUES_PREFIX + b"v\x03" + b"\x00" * 8,
    "big int of 0 bytes": VALUES_PREFIX + b"I\x00\x00",
    "big int of 60000 bytes": VALUES_PREFIX + b"I\x60\xea" + b"\x01" * 60000,
    "not UTF-8": VALUES_PREFIX + b"s" + _u32(2) + b"\xff\xfe",
    "trailing bytes": VALUES_PREFIX + b"NN",
    "unhashable key": VALUES_PREFIX + b"d" + _u32(1) + b"l" + _u32(0) + b"N",
    "nested past the limit": VALUES_PREFIX + (b"l" + _u32(1)) * (MAX_DEPTH + 2) + b"N",
    "nested 100,000 deep": VALUES_PREFIX + (b"t" + _u32(1)) * 100_000 + b"N",
    "a repeated dict key": VALUES_PREFIX + b"d" + _u32(2) + b"i" + struct.pack("<q", 1) + b"Ns" + _u32(0) + b"N"
    + b"i" + struct.pack("<q", 1) + b"T",
    "an int64 written long": VALUES_PREFIX + b"I\x01\x00\x01",
    "a big int with a needless byte": VALUES_PREFIX + b"I\x0a\x00" + (1 << 70).to_bytes(10, "little", signed=True),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_structured_attacks_are_value_message_errors(name):
    with pytest.raises(ValueMessageError, match="rank 5"):
        unpack(ATTACKS[name], source="rank 5")


@settings(max_examples=400, deadline=None)
@given(plain, st.data())
def test_mutated_and_truncated_payloads_are_values_or_value_message_errors(value, data):
    raw = bytearray(pack(value))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(len(VALUES_PREFIX), len(raw) - 1)) if len(raw) > len(VALUES_PREFIX) else None
        if at is None:
            break
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))]
    try:
        unpack(bytes(raw), source="rank 1")
    except ValueMessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_after_the_prefix(tail):
    try:
        unpack(VALUES_PREFIX + tail, source="rank 1")
    except (ValueMessageError, UnsendableValueError):  # b"dcpv1!" starts a refusal: typed as well
        pass


def test_nested_counts_claiming_every_byte_left_take_no_memory_for_them():
    """63 nested lists each claiming nearly all the bytes left: refused, and the decoder's
    memory stays a small multiple of the payload (it used to size each list by its count)."""
    import resource
    import sys

    size = 1 << 21
    head = b"".join(b"l" + _u32(size - 8 * (i + 1)) for i in range(MAX_DEPTH - 1))
    raw = VALUES_PREFIX + head + b"N" * (size - len(head))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueMessageError):
        unpack(raw, source="rank 1")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib * 1024 < 40 * size, f"peak RSS grew {grown_kib} KiB for a {size}-byte payload"
    assert sys.getrecursionlimit() > MAX_DEPTH


def test_a_value_larger_than_an_exchange_carries_is_refused_by_its_sender(monkeypatch):
    from dcp_platform.codec import _values

    monkeypatch.setattr(_values, "MAX_VALUE_BYTES", 64)
    with pytest.raises(UnsendableValueError, match="rank 1 could not send its value: .*more than the 64"):
        unpack(pack_or_refusal("x" * 100), source="rank 1")


def test_unpack_gathered_names_the_rank_of_a_bad_payload():
    good = pack({"ok": (1, 2)})
    assert unpack_gathered([good, good]) == [{"ok": (1, 2)}] * 2
    with pytest.raises(ValueMessageError, match="rank 1"):
        unpack_gathered([good, b"junk"])
    with pytest.raises(UnsendableValueError, match="rank 0"):
        unpack_gathered([pack_or_refusal(object()), good])


def test_errors_survive_pickling_by_a_test_harness():
    for exc in (ValueMessageError("rank 1", "why"), UnsendableValueError("rank 2", "why")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
