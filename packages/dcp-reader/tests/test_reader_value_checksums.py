"""Value checksums (native format): NativeWriter records an XXH3-64 of each inline value's
canonical JSON and of the bytes of values.pkl, in the metadata's top-level
``value_checksums``; ``read_value`` checks them (a changed byte in the JSON or in values.pkl
is a ChecksumError naming the value, raised before anything is unpickled) and so does
``verify_checkpoint``; checkpoints without them still load; a value entry lost from the
metadata, or a malformed checksum, is a MetadataError. Property-based: every storable value
survives the metadata round trip with its checksum, and any value whose JSON differs fails it."""

from __future__ import annotations

import json
import math
import pickle

import pytest
from dcp_reader import (
    METADATA_FILE,
    CheckpointMetadata,
    ChecksumError,
    MetadataError,
    NativeWriter,
    open_checkpoint,
    verify_checkpoint,
)
from dcp_reader.integrity._value_sums import canonical_json, check_value, value_checksum
from hypothesis import given, settings
from hypothesis import strategies as st


class Opaque:  # a value JSON cannot hold: pickled
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


VALUES = {"step": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.99), 7: "seven"}, "name": "run-1", "opt": Opaque(5),
          "more": Opaque(6)}


def _save(path):
    w = NativeWriter(path, allow_pickle=True)
    w.commit(CheckpointMetadata(tensors={}, values=w.write_values(VALUES), format="native"))


def _edit(path, fn):
    doc = json.loads((path / METADATA_FILE).read_text())
    fn(doc)
    (path / METADATA_FILE).write_text(json.dumps(doc))


def test_every_value_gets_a_checksum_and_reads_back(tmp_path):
    _save(tmp_path)
    doc = json.loads((tmp_path / METADATA_FILE).read_text())
    sums = doc["value_checksums"]
    assert set(sums) == set(VALUES) and all(s.startswith("xxh3-64:") and len(s) == 24 for s in sums.values())
    assert sums["opt"] == sums["more"]  # both: the bytes of values.pkl
    with open_checkpoint(tmp_path, allow_pickle=True) as r:
        assert {n: r.read_value(n) for n in VALUES} == VALUES
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.values == 5 and report.values_with_checksums == 5


@pytest.mark.parametrize("name,change", [
    ("step", lambda v: {"value": 4}),
    ("name", lambda v: {"value": "run-2"}),
    ("cfg", lambda v: {"value": {**v["value"], "lr": 0.2}}),
    ("step", lambda v: {"value": 3.0}),  # the same number, another type
    ("step", lambda v: {}),  # the entry lost its value: None
    ("step", lambda v: {"valuex": 3}),
])
def test_a_changed_inline_value_is_a_checksum_error_naming_it(tmp_path, name, change):
    _save(tmp_path)
    _edit(tmp_path, lambda doc: doc["values"].__setitem__(name, change(doc["values"][name])))
    with open_checkpoint(tmp_path) as r:
        with pytest.raises(ChecksumError, match=f"value {name!r} in the metadata") as ei:
            r.read_value(name)
        assert ei.value.key == name and ei.value.path == str(tmp_path)
        assert r.read_value("name" if name != "name" else "step") in ("run-1", 3)  # the others are fine
    with open_checkpoint(tmp_path, verify_checksums=False) as r:
        r.read_value(name)  # unchecked: the changed value comes through
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and repr(name) in report.problems[0]


def test_a_flipped_byte_in_values_pkl_is_found_before_unpickling(tmp_path, monkeypatch):
    _save(tmp_path)
    raw = bytearray((tmp_path / "values.pkl").read_bytes())
    i = raw.index(b"K\x05") + 1  # Opaque(5).x: BININT1 5
    raw[i] = 9
    (tmp_path / "values.pkl").write_bytes(bytes(raw))
    with open_checkpoint(tmp_path, verify_checksums=False, allow_pickle=True) as r:
        assert r.read_value("opt") == Opaque(9)  # the flip would change the value silently
    loads = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: loads.append(1))
    with open_checkpoint(tmp_path, allow_pickle=True) as r:
        for name in ("opt", "more"):
            with pytest.raises(ChecksumError, match=f"value {name!r} is stored in 'values.pkl'") as ei:
                r.read_value(name)
            assert ei.value.key == name and ei.value.path.endswith("values.pkl")
        assert r.read_value("step") == 3
    assert not loads
    report = verify_checkpoint(tmp_path)  # no allow_pickle needed: nothing is unpickled
    assert len(report.problems) == 2 and all("values.pkl" in p for p in report.problems)


def test_checkpoints_without_value_checksums_still_load(tmp_path):
    _save(tmp_path)
    _edit(tmp_path, lambda doc: doc.pop("value_checksums"))
    with open_checkpoint(tmp_path, allow_pickle=True) as r:
        assert all(v.checksum is None for v in r.metadata.values.values())
        assert {n: r.read_value(n) for n in VALUES} == VALUES
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.values == 5 and report.values_with_checksums == 0


def test_a_checksum_of_a_value_the_metadata_lacks_is_a_metadata_error(tmp_path):
    _save(tmp_path)
    _edit(tmp_path, lambda doc: doc["values"].__setitem__("stepx", doc["values"].pop("step")))
    with pytest.raises(MetadataError, match="value_checksums names value.*'step'"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("bad", ["crc32:0123456789abcdef", "xxh3-64:0x23456789abcdef", "xxh3-64:12", "xxh3-64",
                                 "xxh3-64:0123456789ABCDEF", 5, None])
def test_a_malformed_value_checksum_is_a_metadata_error(tmp_path, bad):
    _save(tmp_path)
    _edit(tmp_path, lambda doc: doc["value_checksums"].__setitem__("step", bad))
    if bad is None:  # JSON null: no checksum
        with open_checkpoint(tmp_path) as r:
            assert r.read_value("step") == 3
        return
    with pytest.raises(MetadataError, match="'step'"):
        with open_checkpoint(tmp_path) as r:
            r.read_value("step")


def test_commit_fills_missing_inline_checksums(tmp_path):
    from dcp_reader import ValueMeta

    NativeWriter(tmp_path).commit(CheckpointMetadata(tensors={}, values={"k": ValueMeta("k", value=[1, (2, 3)])},
                                                     format="native"))
    with open_checkpoint(tmp_path) as r:
        assert r.metadata.values["k"].checksum == value_checksum([1, (2, 3)])
        assert r.read_value("k") == [1, (2, 3)]


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=4) | st.integers() | st.sampled_from(["__tuple__", "__map__"]), inner,
                      max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=_values, other=_values)
def test_values_keep_their_checksum_through_the_metadata_and_others_fail_it(value, other):
    from dcp_reader import ValueMeta

    meta = CheckpointMetadata(tensors={}, values={"v": ValueMeta("v", value=value, checksum=value_checksum(value))},
                              format="native")
    back = CheckpointMetadata.from_json(meta.to_json()).values["v"]
    assert back.checksum == value_checksum(value)
    check_value("v", back.value, back.checksum, path=None)  # the parsed value passes
    if canonical_json(other) != canonical_json(value):
        with pytest.raises(ChecksumError, match="'v'"):
            check_value("v", other, back.checksum, path=None)


def test_non_finite_floats_and_signed_zero():
    for a, b in ((0.0, -0.0), (math.inf, -math.inf), (1, 1.0), (1, True), ((1,), [1])):
        assert value_checksum(a) != value_checksum(b)
    assert value_checksum(float("nan")) == value_checksum(float("nan"))
