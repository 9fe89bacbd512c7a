"""torch's ZStandard extension through dcp-load, in one process, on real files:
``torch_compat.save`` / ``async_save`` with ``FileSystemWriter(_extensions=[ZStandard()])``
write zstd-compressed items, with torch's descriptors, that torch DCP's own ``load`` reads
equal; what torch wrote compressed loads through ``dcp_load.load``, ``torch_compat.load``,
``read_state_dict``, ``convert``, ``dcp verify`` and ``dcp inspect``; any other extension, more than one,
or ZStandard with dcp's native format is refused by name before anything is written."""

from __future__ import annotations

import dcp_load
import dcp_load.torch_compat as compat
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from dcp_load.cli._main import main as dcp_main

pytest.importorskip("zstandard")
from torch.distributed.checkpoint._extension import StreamTransformExtension, ZStandard  # noqa: E402

# torch DCP warns that it assumes one process when no process group is up
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ZSTD = "stream.zstd/1"


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(4, 4, generator=g).to(torch.bfloat16), "meta": {"step": 7, "tags": ["a", "b"]}}


def _poisoned() -> dict:
    return {"w": torch.full((8, 6), -9.0), "b": torch.full((5,), -9, dtype=torch.int64),
            "h": torch.full((4, 4), -9.0, dtype=torch.bfloat16), "meta": {"step": None, "tags": None}}


def _assert_equal(got: dict, want: dict) -> None:
    for k in ("w", "b", "h"):
        assert torch.equal(got[k], want[k]), k
    assert got["meta"] == want["meta"]


def _writer(path, *extensions) -> tdcp.FileSystemWriter:
    return tdcp.FileSystemWriter(str(path), _extensions=list(extensions or [ZStandard()]))


def _descriptors(path) -> set:
    md = tdcp.FileSystemReader(str(path)).read_metadata()
    return {tuple(info.transform_descriptors or ()) for info in md.storage_data.values()}


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_torch_compat_writes_zstd_items_torch_reads(tmp_path, how):
    if how == "save":
        compat.save(_state(), storage_writer=_writer(tmp_path), no_dist=True)
    else:
        compat.async_save(_state(), storage_writer=_writer(tmp_path), no_dist=True).result()
    assert _descriptors(tmp_path) == {(ZSTD,)}
    by_torch = _poisoned()
    tdcp.load(by_torch, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_equal(by_torch, _state())
    by_dcp = _poisoned()
    compat.load(by_dcp, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_equal(by_dcp, _state())


def test_what_torch_wrote_compressed_loads_through_dcp(tmp_path, capsys):
    tdcp.save(_state(), storage_writer=_writer(tmp_path), no_dist=True)
    assert _descriptors(tmp_path) == {(ZSTD,)}
    for load in (dcp_load.load, compat.load):
        got = _poisoned()
        load(got, storage_reader=tdcp.FileSystemReader(str(tmp_path)), no_dist=True)
        _assert_equal(got, _state())
    flat = dcp_load.read_state_dict(str(tmp_path), allow_pickle=True)
    assert torch.equal(flat["w"], _state()["w"]) and torch.equal(flat["h"], _state()["h"])
    assert flat["meta.step"] == 7 and flat["meta.tags"] == ["a", "b"]
    native = tmp_path.parent / f"{tmp_path.name}-native"
    dcp_load.convert(str(tmp_path), str(native), to="native", quiet=True)
    assert torch.equal(dcp_load.read_state_dict(str(native))["h"], _state()["h"])
    assert dcp_main(["verify", str(tmp_path)]) == 0
    assert dcp_main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "meta.step" in out and "value 7" in out, out


def test_dcp_verify_checks_the_stored_bytes_dcp_wrote(tmp_path, capsys):
    compat.save(_state(), storage_writer=_writer(tmp_path), no_dist=True)
    assert dcp_main(["verify", str(tmp_path)]) == 0
    assert "3 with checksums" in capsys.readouterr().out
    md = tdcp.FileSystemReader(str(tmp_path)).read_metadata()
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "w")
    with open(tmp_path / info.relative_path, "r+b") as f:  # one flipped bit in the compressed bytes
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 0x04]))
    assert dcp_main(["verify", str(tmp_path)]) == 1
    said = capsys.readouterr()
    assert "'w'" in said.out + said.err and info.relative_path in said.out + said.err
    with pytest.raises(dcp_load.LoadError) as exc:
        dcp_load.load(_poisoned(), checkpoint_id=str(tmp_path), no_dist=True)
    assert "ChecksumError" in str(exc.value) and info.relative_path in str(exc.value)


def test_dcp_save_in_torch_format_takes_zstandard(tmp_path):
    dcp_load.save(_state(), checkpoint_id=str(tmp_path), storage_writer=_writer(tmp_path), no_dist=True,
                  format="torch_dcp")
    assert _descriptors(tmp_path) == {(ZSTD,)}
    got = _poisoned()
    tdcp.load(got, checkpoint_id=str(tmp_path), no_dist=True)
    _assert_equal(got, _state())


class _Other(StreamTransformExtension):
    @staticmethod
    def registry_name() -> str:
        return "stream.other"

    @staticmethod
    def from_descriptor(version: str) -> _Other:
        return _Other()

    def get_descriptor(self) -> str:
        return "stream.other/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):  # noqa: A002 - torch's name
        return input


@pytest.mark.parametrize(("extensions", "fmt", "said"), [
    ([_Other()], "torch_dcp", r"_extensions=\['_Other'\], which dcp does not apply: nothing was written"),
    ([ZStandard(), ZStandard()], "torch_dcp", r"_extensions=\['ZStandard', 'ZStandard'\].*ZStandard\(\) alone"),
    ([ZStandard()], "native", r"applies to torch DCP's format: nothing was written. Pass format='torch_dcp'"),
])
def test_other_extensions_are_refused_before_anything_is_written(tmp_path, extensions, fmt, said):
    path = tmp_path / "ck"
    with pytest.raises(ValueError, match=said):
        dcp_load.save(_state(), checkpoint_id=str(path), storage_writer=_writer(path, *extensions), no_dist=True,
                      format=fmt)
    assert not path.exists()
    if fmt == "torch_dcp":
        with pytest.raises(ValueError, match=said):
            compat.save(_state(), storage_writer=_writer(path, *extensions), no_dist=True)
        assert not path.exists()


def test_without_zstandard_a_save_names_the_package(tmp_path, monkeypatch):
    writer = _writer(tmp_path / "ck")  # ZStandard() itself needs the module: made before it goes
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    with pytest.raises(ModuleNotFoundError, match=r"'zstandard' package.*pip install"):
        compat.save(_state(), storage_writer=writer, no_dist=True)
    assert not (tmp_path / "ck").exists()
