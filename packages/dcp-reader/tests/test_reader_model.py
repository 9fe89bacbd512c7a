"""The metadata model: validation on creation, JSON round trip and schema version, dtype
names and safetensors codes, chunk keys, and the coverage check (overlap, gap, outside)."""

from __future__ import annotations

import json

import pytest
from dcp_reader import (
    SCHEMA_VERSION,
    CheckpointMetadata,
    ChunkMeta,
    CoverageError,
    MetadataError,
    TensorMeta,
    UnknownDtypeError,
    ValueMeta,
    chunk_key,
)
from dcp_reader._dtypes import from_safetensors, to_safetensors


def _t(name, shape, chunks, dtype="float32"):
    return TensorMeta(name=name, shape=shape, dtype=dtype,
                      chunks=tuple(ChunkMeta(offsets=o, sizes=s, file=f"f{i}.safetensors", key=f"{name}{i}")
                                   for i, (o, s) in enumerate(chunks)))


def _meta(*tensors, values=()):
    return CheckpointMetadata(tensors={t.name: t for t in tensors}, values={v.name: v for v in values},
                              format="native")


def test_json_round_trip_keeps_everything():
    t = TensorMeta(name="w", shape=(4, 6), dtype="bfloat16", chunks=(
        ChunkMeta((0, 0), (4, 3), "a.safetensors", "w@0,0", checksum="crc32:00ff"),
        ChunkMeta((0, 3), (4, 3), "b.safetensors", "w@0,3", storage=(10, 48)),
    ))
    s = _t("s", (), [((), ())])
    m = _meta(t, s, values=[ValueMeta("step", 7), ValueMeta("cfg", {"lr": 0.1, "tags": ["a", None]}),
                            ValueMeta("obj", file="values.pkl", key="obj")])
    text = m.to_json()
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION
    back = CheckpointMetadata.from_json(text)
    assert back == m
    assert back.tensors["w"].chunks[0].checksum == "crc32:00ff"
    assert back.tensors["w"].chunks[1].storage == (10, 48)
    assert back.tensors["w"].nbytes == 4 * 6 * 2 and back.tensors["w"].itemsize == 2


def test_lists_and_torch_sizes_are_normalised_to_int_tuples():
    c = ChunkMeta(offsets=[0, 2], sizes=[3, 1], file="x", key="k")
    assert c.offsets == (0, 2) and c.sizes == (3, 1) and isinstance(c.offsets, tuple)


@pytest.mark.parametrize("kwargs, words", [
    (dict(offsets=(0,), sizes=(1, 2), file="x", key="k"), "differ in length"),
    (dict(offsets=(-1,), sizes=(1,), file="x", key="k"), "non-negative"),
    (dict(offsets=(True,), sizes=(1,), file="x", key="k"), "non-negative ints"),
    (dict(offsets=(0,), sizes=(1,), file="", key="k"), "non-empty"),
    (dict(offsets=(0,), sizes=(1,), file="x", key="k", storage=(1, 2, 3)), "(offset, length)"),
])
def test_chunk_meta_rejects_bad_fields(kwargs, words):
    with pytest.raises(MetadataError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ChunkMeta(**kwargs)


def test_frozen():
    c = ChunkMeta((0,), (1,), "x", "k")
    with pytest.raises(AttributeError):
        c.file = "y"  # type: ignore[misc]


def test_unknown_dtype_names_the_tensor():
    with pytest.raises(UnknownDtypeError, match="'w'.*float128") as ei:
        _t("w", (2,), [((0,), (2,))], dtype="float128")
    assert ei.value.key == "w"


def test_chunk_dims_must_match_the_tensor():
    with pytest.raises(MetadataError, match="2 dims"):
        _t("w", (2, 2), [((0,), (2,))])


def test_value_must_be_storable_as_json_unless_stored_in_a_file():
    with pytest.raises(MetadataError, match="cannot be stored as JSON"):
        ValueMeta("o", object())
    with pytest.raises(MetadataError, match="cannot be stored as JSON"):
        ValueMeta("d", {"a": [1, {2: b"bytes"}]})
    ValueMeta("t", file="values.pkl", key="t")


@pytest.mark.parametrize("value", [
    (0.9, 0.999),                                  # an optimizer's betas
    {0: {"step": 3}, 1: {"step": 4}},              # optimizer.state_dict()["state"] keys
    {"__tuple__": [1, 2]},                         # a str-keyed dict that looks like a tag
    {"__map__": 1, "x": (None, True)},
    [float("nan"), float("inf"), -float("inf"), (), {}],
    {(1, "a"): [(), ("b",)], None: 2.5, True: "t"},
])
def test_values_round_trip_through_json_alike(value):
    meta = CheckpointMetadata(tensors={}, values={"v": ValueMeta("v", value)}, format="native")
    text = meta.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = CheckpointMetadata.from_json(text).values["v"].value
    assert repr(back) == repr(value)  # equal, and of the same types (tuples stay tuples)


@pytest.mark.parametrize("doc", ['{"__tuple__": 3}', '{"__map__": [[1]]}', '{"__float__": "1e9"}'])
def test_malformed_value_tags_are_metadata_errors(doc):
    text = CheckpointMetadata(tensors={}, values={"v": ValueMeta("v", 0)}, format="native").to_json()
    with pytest.raises(MetadataError, match="malformed"):
        CheckpointMetadata.from_json(text.replace('{"value":0}', '{"value":' + doc + "}"))


@pytest.mark.parametrize("chunks, words", [
    ([((0, 0), (2, 4)), ((1, 0), (3, 4))], "overlap"),
    ([((0, 0), (2, 4))], "cover 8 of 16"),
    ([((0, 0), (4, 2)), ((0, 2), (4, 3))], "outside the shape"),
])
def test_coverage_errors(chunks, words):
    with pytest.raises(CoverageError, match=words) as ei:
        _meta(_t("w", (4, 4), chunks))
    assert ei.value.key == "w"


def test_coverage_collects_every_offending_tensor():
    with pytest.raises(CoverageError) as ei:
        _meta(_t("a", (4,), [((0,), (2,))]), _t("ok", (4,), [((0,), (4,))]),
              _t("b", (4,), [((0,), (3,)), ((2,), (2,))]))
    assert ei.value.offenders == ("a", "b")
    assert "'a'" in str(ei.value) and "'b'" in str(ei.value)


def test_coverage_accepts_grids_scalars_and_empty_tensors():
    grid = [((i * 2, j * 3), (2, 3)) for i in range(3) for j in range(2)]
    _meta(_t("g", (6, 6), grid), _t("s", (), [((), ())]), _t("e", (0, 5), []),
          _t("e2", (0, 5), [((0, 0), (0, 5))]))
    # many row chunks: the sweep keeps this fast
    _meta(_t("rows", (5000, 3), [((i, 0), (1, 3)) for i in range(5000)]))


def test_scalar_needs_exactly_one_chunk():
    with pytest.raises(CoverageError, match="exactly 1 chunk"):
        _meta(_t("s", (), [((), ()), ((), ())]))


@pytest.mark.parametrize("text, words", [
    ("{not json", "invalid JSON"),
    ("[]", "JSON object"),
    ('{"tensors": {}}', "schema_version missing"),
    ('{"schema_version": 99, "tensors": {}}', "unknown schema_version 99"),
    ('{"schema_version": 1, "tensors": {"w": {"shape": [1]}}}', "malformed metadata entry"),
])
def test_from_json_errors(text, words):
    with pytest.raises(MetadataError, match=words):
        CheckpointMetadata.from_json(text)


def test_dtype_codes_round_trip_and_unknown_code_names_file_and_key():
    for name in ("float32", "bfloat16", "float16", "float64", "int8", "uint8", "int16", "int32", "int64",
                 "bool", "float8_e4m3fn", "float8_e5m2", "complex64"):
        assert from_safetensors(to_safetensors(name)) == name
    assert to_safetensors("float8_e4m3fn") == "F8_E4M3" and to_safetensors("bfloat16") == "BF16"
    with pytest.raises(UnknownDtypeError, match="F4") as ei:
        from_safetensors("F4", path="m.safetensors", key="w")
    assert ei.value.path == "m.safetensors" and ei.value.key == "w" and "m.safetensors" in str(ei.value)


def test_chunk_key():
    assert chunk_key("layer.w", (0, 128)) == "layer.w@0,128"
    assert chunk_key("s", ()) == "s@"
    assert chunk_key("a@1", (0,)) != chunk_key("a", (1,))


def test_errors_pickle_with_path_and_key():
    import pickle

    e = CoverageError("gap", path="/ckpt", key="w", offenders=["w", "v"])
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CoverageError and back.path == "/ckpt" and back.key == "w"
    assert back.offenders == ("w", "v") and str(back) == str(e)
    assert isinstance(back, ValueError)


def test_metadata_pickles_for_exchange_between_ranks():
    import pickle

    m = _meta(_t("w", (4,), [((0,), (2,)), ((2,), (2,))]), values=[ValueMeta("step", 1)])
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.tensors["w"].chunks[1].offsets == (2,)


def test_a_value_entry_whose_value_key_was_renamed_is_an_error_not_none():
    """Two flipped bytes renamed "value" and "value_checksums" (found by the fuzzer): the
    entry read as the value None, silently. (With its checksum, read_value reports it.)"""
    doc = {"schema_version": 1, "format": "native", "tensors": {}, "values": {"lr": {"val5e": 0.1}}}
    with pytest.raises(MetadataError, match="'lr' has neither 'value' nor 'file'"):
        CheckpointMetadata.from_json(json.dumps(doc))
