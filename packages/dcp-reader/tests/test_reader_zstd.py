"""Items stored through torch's ZStandard extension (transform ``"stream.zstd/1"``), on real
files: what torch 2.13's own ``FileSystemWriter(_extensions=[ZStandard()])`` writes reads
equal through every read path (``read``, ``read_into``, ``read_covering``, values,
``verify_checkpoint``); dcp's ``TorchDcpWriter`` writes the bytes torch writes, with the same
descriptors, and checksums of the bytes as stored that reads and ``verify_checkpoint`` both
check; a corrupt, cut or inflating frame, an unknown descriptor and a missing ``zstandard``
module are clear errors naming the file and the key."""

from __future__ import annotations

import os
import pickle
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_reader import CheckpointMetadata, ChecksumError, MetadataError, open_checkpoint, verify_checkpoint
from dcp_reader.formats._zstd_frames import CodecMissingError, check_frames
from dcp_reader.integrity._checksum import block_digests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

zstandard = pytest.importorskip("zstandard")
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard  # noqa: E402

ZSTD = "stream.zstd/1"


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"f32": torch.randn(64, 33, generator=g), "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
            "i64": torch.arange(-20, 20).reshape(4, 10), "flag": torch.tensor([True, False, True]),
            "zeros": torch.zeros(300, 40), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5),
            "step": 7, "cfg": {"lr": 0.1, "name": "adam"}}


def _torch_save(path, state, extensions=None) -> None:
    """torch DCP's own save, in one process, through ``extensions`` (default: ZStandard)."""
    writer = tdcp.FileSystemWriter(str(path), _extensions=[ZStandard()] if extensions is None else extensions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: no process group, one process assumed
        tdcp.save(state, storage_writer=writer, no_dist=True)


def _torch_load(path, state) -> dict:
    target = _zeros_like(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tdcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


def _dcp_save(path, state) -> None:
    from dcp_load import save

    save(state, checkpoint_id=str(path), storage_writer=tdcp.FileSystemWriter(str(path), _extensions=[ZStandard()]),
         no_dist=True, format="torch_dcp", allow_pickle=True)


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return None


def _items(path) -> dict:
    """{fqn: torch's _StorageInfo} of a checkpoint (torch's own metadata, unpickled: test files)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # noqa: S301 - a file this test wrote
    return {idx.fqn: info for idx, info in md.storage_data.items()}


def _stored(path, fqn) -> bytes:
    info = _items(path)[fqn]
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _overwrite(path, fqn, data: bytes) -> str:
    """Replace the stored bytes of ``fqn`` by ``data`` (of the same length); its file."""
    info = _items(path)[fqn]
    assert len(data) == info.length
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(data)
    return info.relative_path


def _frame(blocks: bytes) -> bytes:
    """A zstd frame header (no content size, 1 MiB window) followed by ``blocks``."""
    return (0xFD2FB528).to_bytes(4, "little") + bytes([0x00, 0x50]) + blocks


def _block(last: int, kind: int, size: int) -> bytes:
    return (last | kind << 1 | size << 3).to_bytes(3, "little")


def _full(r, name):
    t = r.metadata.tensors[name]
    c = t.chunks[0]
    return r.read(name, c, c.offsets, c.sizes)


def test_torch_written_items_read_equal_on_every_path(tmp_path):
    state = _state()
    _torch_save(tmp_path, state)
    assert {tuple(i.transform_descriptors) for i in _items(tmp_path).values()} == {(ZSTD,)}
    with open_checkpoint(tmp_path) as r:
        for name, t in r.metadata.tensors.items():
            assert [c.transforms for c in t.chunks] == [(ZSTD,)], name
            assert torch.equal(_full(r, name), state[name]), name
        c = r.metadata.tensors["f32"].chunks[0]
        assert torch.equal(r.read("f32", c, (3, 5), (7, 11)), state["f32"][3:10, 5:16])
        out = torch.empty(7, 33)
        r.read_into("f32", c, (10, 0), (7, 33), out)
        assert torch.equal(out, state["f32"][10:17])
        n = r.covering_bytes("f32", c, (2, 4), (5, 6))
        box = r.read_covering("f32", c, (2, 4), (5, 6), torch.empty(n, dtype=torch.uint8))
        assert torch.equal(box, state["f32"][2:7, 4:10])
        assert r.read_value("step") == 7 and r.read_value("cfg.lr") == 0.1 and r.read_value("cfg.name") == "adam"
        shared = CheckpointMetadata.from_json(r.metadata.to_json())  # as load's rank 0 hands it to the others
        assert shared == r.metadata and shared.values["step"].transforms == (ZSTD,)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.chunks == 7 and report.chunks_with_checksums == 0, report


def test_dcp_writes_the_bytes_and_descriptors_torch_writes(tmp_path):
    state = _state()
    _torch_save(tmp_path / "torch", state)
    _dcp_save(tmp_path / "dcp", state)
    theirs, ours = _items(tmp_path / "torch"), _items(tmp_path / "dcp")
    assert set(theirs) == set(ours)
    for fqn, info in ours.items():
        assert info.transform_descriptors == theirs[fqn].transform_descriptors == [ZSTD], fqn
        assert _stored(tmp_path / "dcp", fqn) == _stored(tmp_path / "torch", fqn), fqn
    got = _torch_load(tmp_path / "dcp", state)  # torch's own reader inflates what dcp wrote
    for name in ("f32", "bf16", "i64", "flag", "zeros", "scalar"):
        assert torch.equal(got[name], state[name]), name
    assert got["step"] == 7 and got["cfg"] == {"lr": 0.1, "name": "adam"}


def test_checksums_cover_the_bytes_as_stored_and_catch_a_flip(tmp_path):
    import json

    state = _state()
    _dcp_save(tmp_path, state)
    sums = json.loads((tmp_path / "dcp-checksums.json").read_text())
    assert sums["tensors"]["f32"]["0,0"] == block_digests(_stored(tmp_path, "f32"))
    assert verify_checkpoint(tmp_path).ok
    raw = bytearray(_stored(tmp_path, "f32"))
    raw[len(raw) // 2] ^= 0x10
    file = _overwrite(tmp_path, "f32", bytes(raw))
    with open_checkpoint(tmp_path) as r, pytest.raises(ChecksumError) as exc:
        _full(r, "f32")
    assert file in str(exc.value) and "'f32'" in str(exc.value)
    report = verify_checkpoint(tmp_path)
    assert len(report.problems) == 1 and file in report.problems[0] and "'f32'" in report.problems[0], report
    raw = bytearray(_stored(tmp_path, "cfg.name"))
    raw[-3] ^= 0x01
    file = _overwrite(tmp_path, "cfg.name", bytes(raw))
    with open_checkpoint(tmp_path) as r, pytest.raises(ChecksumError, match="cfg.name") as exc:
        r.read_value("cfg.name")
    assert file in str(exc.value)
    assert any("cfg.name" in p and file in p for p in verify_checkpoint(tmp_path).problems)


def test_4_mib_of_zeros_is_as_small_as_torch_writes_it(tmp_path):
    state = {"z": torch.zeros(1 << 20)}  # 4 MiB
    _torch_save(tmp_path / "torch", state)
    _dcp_save(tmp_path / "dcp", state)
    sizes = {}
    for who in ("torch", "dcp"):
        info = _items(tmp_path / who)["z"]
        sizes[who] = os.path.getsize(tmp_path / who / info.relative_path)
    assert sizes["dcp"] == sizes["torch"] < 4096, sizes
    with open_checkpoint(tmp_path / "dcp") as r:
        assert torch.equal(_full(r, "z"), state["z"])


def _magic(raw: bytes) -> bytes:
    return b"\0\0\0\0" + raw[4:]


def _bad_block(raw: bytes) -> bytes:
    return raw[:6] + b"\xff\xff\xff" + raw[9:]


def _cut(raw: bytes) -> bytes:  # one block that claims more bytes than the item holds
    return _frame(_block(1, 0, len(raw))) + b"\0" * (len(raw) - 9)


def _tail(raw: bytes) -> bytes:  # a whole frame, then bytes that are no frame
    frame = zstandard.ZstdCompressor().compress(b"x" * 10)
    return frame + b"\x01" * (len(raw) - len(frame))


def _garbage(raw: bytes) -> bytes:  # a compressed block zstd cannot decode
    return _frame(_block(1, 2, len(raw) - 9)) + b"\xff" * (len(raw) - 9)


@pytest.mark.parametrize(("damage", "said"), [(_magic, "no zstd frame starts at byte 0"),
                                              (_bad_block, "block header at byte 6 is invalid"),
                                              (_cut, "is cut off"), (_tail, "no zstd frame starts at byte"),
                                              (_garbage, "zstd cannot decode them")])
def test_a_corrupt_frame_names_the_key_and_the_file(tmp_path, damage, said):
    from dcp_load import LoadError, load

    state = _state()
    _torch_save(tmp_path, state)
    file = _overwrite(tmp_path, "f32", damage(_stored(tmp_path, "f32")))
    with open_checkpoint(tmp_path) as r:
        with pytest.raises(MetadataError, match=said) as exc:
            _full(r, "f32")
        assert "'f32'" in str(exc.value) and file in str(exc.value) and exc.value.key == "f32"
        assert torch.equal(_full(r, "i64"), state["i64"])  # the other items still read
    with pytest.raises(LoadError) as exc:
        load({"f32": torch.zeros(64, 33)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert "'f32'" in str(exc.value) and file in str(exc.value) and said in str(exc.value)


def test_a_frame_inflating_past_its_chunk_is_refused(tmp_path):
    state = {"small": torch.arange(16.0), "other": torch.ones(3)}
    _torch_save(tmp_path, state)
    n = len(_stored(tmp_path, "small"))
    k, rest = divmod(n - 9, 4)  # a raw block of ``rest`` bytes, then k blocks of 128 KiB of one byte each
    bomb = _frame(_block(0, 0, rest) + b"\0" * rest + b"".join(
        _block(int(i == k - 1), 1, 128 * 1024) + b"\x07" for i in range(k)))
    file = _overwrite(tmp_path, "small", bomb)
    with open_checkpoint(tmp_path) as r:
        with pytest.raises(MetadataError, match=r"inflate past 65600 bytes, more than a torch.save blob of its "
                                                r"64-byte float32 chunk") as exc:
            _full(r, "small")
        assert "'small'" in str(exc.value) and file in str(exc.value)
        assert torch.equal(_full(r, "other"), state["other"])


class _Reverse(StreamTransformExtension):
    """A transform torch registers on its readers only when told: unknown to dcp."""

    @staticmethod
    def registry_name() -> str:
        return "stream.reverse"

    @staticmethod
    def from_descriptor(version: str) -> _Reverse:
        return _Reverse()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):  # noqa: A002 - torch's name
        return input


@pytest.mark.parametrize(("extensions", "said"), [([_Reverse()], "through transform 'stream.reverse/1'"),
                                                  ([ZStandard(), ZStandard()], "through 2 transforms")])
def test_an_unknown_transform_is_refused_naming_it_the_file_and_the_key(tmp_path, extensions, said):
    tmp_path = tmp_path / ("long-" * 40)  # the message is whole whatever the path's length
    tmp_path.mkdir()
    _torch_save(tmp_path, {"w": torch.ones(3)}, extensions)
    file = _items(tmp_path)["w"].relative_path
    with pytest.raises(MetadataError, match=said) as exc:
        open_checkpoint(tmp_path)
    assert "'w'" in str(exc.value) and file in str(exc.value), exc.value
    assert "unexpected metadata structure" not in str(exc.value), exc.value


def test_without_zstandard_a_read_names_the_package(tmp_path, monkeypatch):
    from dcp_reader.write import TorchDcpWriter

    state = {"w": torch.ones(3), "step": 3}
    _torch_save(tmp_path, state)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # what an environment without it imports
    with open_checkpoint(tmp_path) as r:  # the metadata needs no zstd
        assert r.metadata.tensors["w"].chunks[0].transforms == (ZSTD,)
        with pytest.raises(CodecMissingError, match=r"needs the 'zstandard' package.*pip install") as exc:
            _full(r, "w")
        assert exc.value.key == "w"
        with pytest.raises(CodecMissingError, match="zstandard"):
            r.read_value("step")
    with pytest.raises(ModuleNotFoundError, match=r"'zstandard' package.*pip install 'dcp-reader\[zstd\]'"):
        TorchDcpWriter(str(tmp_path / "out"), transforms=(ZSTD,))


def test_check_frames_takes_several_frames_and_skippable_ones():
    one = zstandard.ZstdCompressor().compress(b"a" * 1000)
    skip = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    check_frames(memoryview(one + skip + one), ValueError)
    for bad in (b"", one[:-1], one + b"\0", skip[:-1]):
        with pytest.raises(ValueError):
            check_frames(memoryview(bad), ValueError)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool]


@st.composite
def _tensors(draw):
    out = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(_DTYPES))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        t = (torch.rand(shape, generator=g) * 200 - 100)
        if draw(st.booleans()):
            t = t.round()  # runs of repeated values: zstd finds matches
        out[f"t{i}"] = t.to(dtype)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_tensors())
def test_round_trip_of_random_shapes_and_dtypes(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("zstd")
    _dcp_save(path, state)
    got = _torch_load(path, state)
    with open_checkpoint(path) as r:
        for name, t in state.items():
            assert torch.equal(got[name], t), name
            assert torch.equal(_full(r, name), t), name


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_many_small_compressed_tensors_keep_open_descriptors_bounded(tmp_path):
    """600 tensors: the inflated items a reader keeps are bounded in number, not only in bytes
    (one descriptor each: 1,500 of them exceeded a 1,024 open-file limit)."""
    n = 600
    state = {f"p{i}": torch.full((4,), float(i)) for i in range(n)}
    _torch_save(str(tmp_path / "ck"), state)
    before, peak = _open_fds(), 0
    with open_checkpoint(str(tmp_path / "ck")) as reader:
        for i in range(n):
            assert torch.equal(_full(reader, f"p{i}"), state[f"p{i}"])
            peak = max(peak, _open_fds())
    assert peak - before < 200, (before, peak)


@pytest.mark.parametrize("key", ["状态" * 45, "a\x00b", "x" * 240])
def test_keys_of_any_characters_and_length_inflate(tmp_path, key):
    state = {key: torch.arange(6.0), "w": torch.ones(2)}
    _torch_save(str(tmp_path / "ck"), state)
    with open_checkpoint(str(tmp_path / "ck")) as reader:
        assert torch.equal(_full(reader, key), state[key])
