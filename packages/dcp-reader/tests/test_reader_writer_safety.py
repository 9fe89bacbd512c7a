"""NativeWriter's overwrite safety, property-based: ``stray_files`` lists exactly the files
the writer names (data, values, temporary files) that the metadata does not, never one it
names and never a foreign file; ``remove_stray`` removes exactly those. ``encode_values``
accepts a value only when the committed metadata reads it back equal, and otherwise names
the key; the single-writer lock refuses a second holder and records the last commit."""

from __future__ import annotations

import os
import tempfile

import pytest
from dcp_reader import (
    CheckpointMetadata,
    ChunkMeta,
    NativeWriter,
    TensorMeta,
    WriterLockError,
    chunk_key,
    data_file_name,
    open_checkpoint,
    stray_files,
    values_file_name,
)
from hypothesis import given, settings
from hypothesis import strategies as st

_IDS = st.text("0123456789abcdef", min_size=12, max_size=12)
_OWN = st.one_of(
    st.builds(data_file_name, st.integers(0, 99999), _IDS),
    st.builds(values_file_name, _IDS),
    st.integers(0, 99999).map(lambda r: f"rank-{r:05d}.safetensors"),  # written by dcp-reader <= 0.3
    st.just("values.pkl"),
)
_FOREIGN = st.one_of(
    st.sampled_from(["model.safetensors", "rank-1.safetensors", "notes.txt", "values.json", ".metadata",
                     "rank-00000.ABCDEF012345.safetensors", "rank-00000.safetensors.tmp-x", "__0_0.distcp"]),
    st.text("abcxyz-_.", min_size=1, max_size=12).filter(lambda n: n not in (".", "..")),
)


_MARKED = b'{"__metadata__":{"dcp_format":"native"}}'


def _write(root: str, name: str, native: bool) -> None:
    # a legacy data name holds a native data file's header when the writer wrote it
    with open(os.path.join(root, name), "wb") as f:
        f.write(len(_MARKED).to_bytes(8, "little") + _MARKED if native else b"x")


@settings(max_examples=60, deadline=None)
@given(own=st.lists(st.tuples(_OWN, st.booleans()), max_size=8, unique_by=lambda x: x[0]),
       foreign=st.lists(_FOREIGN, max_size=5, unique=True), named_count=st.integers(0, 8),
       legacy_foreign=st.lists(st.integers(0, 99), max_size=3), values_replaced=st.booleans())
def test_stray_files_are_exactly_the_writers_unnamed_files(own, foreign, named_count, legacy_foreign,
                                                           values_replaced):
    with tempfile.TemporaryDirectory() as root:
        own_names = [n + (f".tmp-{len(n)}" if tmp else "") for n, tmp in own]
        # names older versions used but not written by the writer: a data file name holding
        # no native header, and a values.pkl that the replaced metadata did not name
        foreign = foreign + [f"rank-{r:05d}.safetensors" for r in legacy_foreign]
        if "values.pkl" in own_names and not values_replaced:
            own_names.remove("values.pkl")
            foreign.append("values.pkl")
        foreign = list(dict.fromkeys(n for n in foreign if n not in own_names))
        for n in own_names:
            _write(root, n, True)
        for n in foreign:
            _write(root, n, False)
        data = [n for n in own_names if n.endswith(".safetensors")][:named_count]
        chunks = tuple(ChunkMeta((i,), (1,), n, chunk_key("t", (i,))) for i, n in enumerate(data))
        meta = CheckpointMetadata(tensors={"t": TensorMeta("t", (len(data),), "uint8", chunks)} if data else {},
                                  values={}, format="native")
        replaced = {"values.pkl"} if values_replaced else set()
        want = sorted(set(own_names) - set(data))
        assert stray_files(root, meta, replaced) == want
        w = NativeWriter(root)
        w._replaced = replaced  # what commit() found in the metadata it replaced
        assert sorted(w.remove_stray(meta)) == want
        assert sorted(os.listdir(root)) == sorted(set(data) | set(foreign))


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(10 ** 30), 10 ** 30),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5), st.tuples(st.integers(0, 3))), kids,
                    max_size=3)), max_leaves=12)


def _same(a, b) -> bool:  # equal, nan included, and alike in type (a tuple stays a tuple)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=80, deadline=None)
@given(value=_VALUES)
def test_an_accepted_value_reads_back_alike(value):
    with tempfile.TemporaryDirectory() as root:
        w = NativeWriter(root)
        meta = w.write_values(w.encode_values({"v": value}))
        w.commit(CheckpointMetadata(tensors={}, values=meta, format="native"))
        with open_checkpoint(root) as r:
            assert _same(r.read_value("v"), value)


@pytest.mark.parametrize(("value", "words"), [(10 ** 5000, "ValueError"), (float, "allow_pickle=True")],
                         ids=["huge-int", "a-class"])
def test_a_refused_value_is_named(tmp_path, value, words):
    w = NativeWriter(tmp_path)
    with pytest.raises((TypeError, ValueError), match=rf"'bad'.*{words}|{words}.*'bad'"):
        w.encode_values({"ok": 1, "bad": value})
    assert os.listdir(tmp_path) == []  # nothing written


def test_the_lock_refuses_a_second_holder_and_records_the_last_commit(tmp_path):
    first = NativeWriter(tmp_path).lock({"who": "first"})
    with pytest.raises(WriterLockError, match=rf"pid {os.getpid()}") as info:
        NativeWriter(tmp_path).lock()
    assert info.value.holder["who"] == "first"
    first.committed()
    first.release()
    second = NativeWriter(tmp_path).lock({"who": "second"})
    assert second.previous["who"] == "first"
    second.release()  # not committed: the next writer still sees the first
    third = NativeWriter(tmp_path).lock()
    assert third.previous["who"] == "first"
    third.release()


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(1, 400), old_who=st.text("ab", min_size=1, max_size=40),
       new_who=st.text("ab", min_size=1, max_size=40))
def test_a_record_rewritten_half_way_reads_as_no_record(old_who, new_who, cut):
    # A reader between the two steps of a rewrite (the new record written over the old one,
    # not yet cut to its length) sees the start of the new over the rest of the old: even
    # where that is valid JSON naming a holder nobody wrote, it reads no record.
    from dcp_reader.write._save_lock import _encode, _read_record

    old, new = _encode({"who": old_who, "n": 1}), _encode({"who": new_who, "n": 2})
    torn = new[:cut] + old[cut:]
    with tempfile.TemporaryFile() as f:
        f.write(torn)
        f.flush()
        got = _read_record(f.fileno())
    if torn == old or torn[:len(new)] == new and len(torn) == len(new):
        assert got is not None
    else:
        assert got is None, (torn, got)


def test_a_record_of_an_earlier_version_still_reads(tmp_path):
    (tmp_path / ".dcp-save.lock").write_bytes(b'{"pid": 7, "last_commit": {"who": "old"}}')
    w = NativeWriter(tmp_path).lock()
    assert w.previous == {"who": "old"}
    w.release()


def test_commit_makes_a_new_checkpoint_directory_durable(tmp_path, monkeypatch):
    # the entry of a directory the save created lives in its parent: without an fsync of the
    # parent, a power loss after save returned can take the whole checkpoint directory away
    import dcp_reader.write._writer as writer_module

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(writer_module.os, "fsync", fsync)
    w = NativeWriter(tmp_path / "new")
    w.write_file(data_file_name(0, "0" * 12), {"t@0": __import__("numpy").ones(2, "uint8")})
    w.commit(CheckpointMetadata(tensors={"t": TensorMeta("t", (2,), "uint8", (
        ChunkMeta((0,), (2,), data_file_name(0, "0" * 12), "t@0"),))}, values={}, format="native"))
    meta = next(i for i, p in enumerate(synced) if os.path.basename(p).startswith("dcp-metadata.json"))
    assert str(tmp_path) in synced[meta:], synced  # after the metadata: the commit made the directory durable


def test_a_finished_save_leaves_no_lock_file(tmp_path):
    lock = NativeWriter(tmp_path).lock()
    assert os.listdir(tmp_path) == [".dcp-save.lock"]
    lock.committed()  # no note: nothing to keep for the next writer
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_writer_that_locked_a_removed_lock_file_opens_again(tmp_path, monkeypatch):
    # The first holder removes the file on release; a writer that opened it just before then
    # locks an unlinked file, while a third creates a new one: it must open again, so that
    # only one of them holds the directory.
    import dcp_reader.write._save_lock as save_lock

    first = NativeWriter(tmp_path).lock()
    real_flock_open = save_lock.WriterLock._open
    calls = []

    def open_then_release_first(self):
        fd = real_flock_open(self)
        if not calls:  # the holder (another process, in life) releases: removes the file, then unlocks
            os.unlink(first.file)
            os.close(first._fd)
            first._fd = -1
        calls.append(fd)
        return fd

    monkeypatch.setattr(save_lock.WriterLock, "_open", open_then_release_first)
    second = NativeWriter(tmp_path).lock()
    assert len(calls) == 2  # the unlinked file was left, a new one opened
    assert os.listdir(tmp_path) == [".dcp-save.lock"]
    monkeypatch.setattr(save_lock.WriterLock, "_open", real_flock_open)
    with pytest.raises(WriterLockError):
        NativeWriter(tmp_path).lock()
    second.release()
