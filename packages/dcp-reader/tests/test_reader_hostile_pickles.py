"""Hostile pickles in every place dcp-reader unpickles one: torch DCP's ``.metadata``, the
``data.pkl`` of a ``.distcp`` tensor blob, a torch.save value (read with torch.load) and a
native ``values.pkl`` (opted in with allow_pickle).

Each case was reproduced before the fix: a negative BINSTRING length spun forever, a dict
key of 200,000 nested tuples crashed the process (SIGSEGV) when hashed, a shared tuple
passed to 5,000 calls reached 780 MiB, error messages formatted whole objects of shared
lists, BUILD on the unpickler's stand-ins raised bare TypeErrors, format detection blocked
on a FIFO ``.metadata`` and read a symlink out of the directory. Cases that hung or crashed
run in a child process under a timeout, so a regression fails the test instead of pytest.
Property tests check that the pre-scan accepts whatever Python's pickler writes, ends on
any bytes, and that ``short_repr`` stays within its limit.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_reader import (
    CheckpointMetadata,
    MetadataError,
    NativeWriter,
    UnsafePathError,
    UnsafePickleError,
    detect_format,
    open_checkpoint,
)
from dcp_reader._errors import clean_text, short_repr
from dcp_reader.formats._hyper import _ALLOWED as HYPER_ALLOWED
from dcp_reader.formats._pickle_scan import MAX_DEPTH, scan_pickle
from dcp_reader.formats._torch_save_zip import _DataPickle
from dcp_reader.formats._unpickle import _ALLOWED, _Charged, _Record
from hypothesis import given, settings
from hypothesis import strategies as st

# The fuzzer's table of nesting opcodes (tests-integration/formats/pickle_mutations.py), one source
# for both: standard library only.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests-integration" / "formats"))
from pickle_mutations import NESTS  # noqa: E402

DEEP = 200_000


# -- building pickles and checkpoints ------------------------------------------------------
def _u(s: str) -> bytes:
    """BINUNICODE of ``s``."""
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def deep_key(n: int = DEEP) -> bytes:
    """A dict whose key is a tuple nested ``n`` deep, 1 byte per level."""
    return b"\x80\x04}" + b")" + b"\x85" * n + b"Ns."


def shared_calls(fn: bytes, width: int = 20_000, calls: int = 5_000) -> bytes:
    """A list of ``calls`` results of GLOBAL ``fn`` each given one shared ``width``-tuple."""
    return (b"\x80\x02c" + fn + b"\nq\x00(" + b"N" * width + b"tq\x01(" + b"h\x00h\x01R" * calls + b"l.")


def data_pkl(*, ref_state: bytes = b"", type_state: bytes = b"", extra: bytes = b"") -> bytes:
    """torch.save's data.pkl of a float32 (3, 4) tensor in storage "0", with BUILD ``ref_state``
    on the storage reference and ``type_state`` on the storage type when given."""
    storage_type = b"ctorch\nFloatStorage\n" + (type_state + b"b" if type_state else b"")
    pid = b"(" + _u("storage") + storage_type + _u("0") + _u("cpu") + b"K\x0ct"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + pid + b"Q" + (ref_state + b"b" if ref_state else b"")
            + b"K\x00K\x03K\x04\x86K\x04K\x01\x86\x89ccollections\nOrderedDict\n)R" + extra + b"tR.")


def _save(sd, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


def with_data_pkl(path, fqn: str, pkl: bytes) -> None:
    """Give ``fqn``'s blob in the torch DCP checkpoint at ``path`` this data.pkl: a new zip
    blob (the old one's other entries) appended to its file, the metadata pointed at it."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own, trusted, file
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    file = path / info.relative_path
    old = file.read_bytes()[info.offset:info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(old)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for e in src.infolist():
            dst.writestr(e.filename, pkl if e.filename.endswith("/data.pkl") else src.read(e))
    blob = out.getvalue()
    info.offset, info.length = file.stat().st_size, len(blob)
    with open(file, "ab") as f:
        f.write(blob)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.fixture
def ckpt(tmp_path):
    """A torch DCP checkpoint holding tensor "w" (float32 (3, 4)) and a value "v"."""
    _save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": (0.9, 0.99)}, tmp_path)
    return tmp_path


def run_child(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; its stdout. Fails the test on a crash or a hang."""
    try:
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                           timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung (over {timeout} s)")
    assert p.returncode == 0, f"the child died with {p.returncode}: {p.stderr[-2000:]}"
    return p.stdout


READ_W = """
    import sys
    from dcp_reader import open_checkpoint, CheckpointError
    r = open_checkpoint(sys.argv[1] if len(sys.argv) > 1 else {path!r})
    c = r.metadata.tensors["w"].chunks[0]
    for call in (lambda: r.check_chunk("w", c), lambda: r.read("w", c, (0, 0), (3, 4))):
        try:
            call()
            print("read")
        except CheckpointError as e:
            print(type(e).__name__, e.message)
"""


# -- 1. lengths ------------------------------------------------------------------------------
LENGTH_OPS = {  # opcode: (length width, signed)
    b"T": (4, True), b"\x8b": (4, True), b"U": (1, False), b"\x8a": (1, False), b"C": (1, False),
    b"\x8c": (1, False), b"B": (4, False), b"X": (4, False), b"\x8e": (8, False), b"\x8d": (8, False),
    b"\x96": (8, False)}


def test_every_length_that_is_negative_or_past_the_end_is_refused_at_once(tmp_path):
    """``b"T\\xfb\\xff\\xff\\xff."`` (BINSTRING of length -5) spun the pre-scan forever."""
    cases = []
    for op, (width, signed) in LENGTH_OPS.items():
        top = 2 ** (8 * width - signed) - 1
        lengths = [top, min(top, 1000)] + ([-5, -1, -(2 ** 31)] if signed else [])
        cases += [op + n.to_bytes(width, "little", signed=signed) + b"." for n in lengths]
    out = run_child(f"""
        import os
        from dcp_reader import open_checkpoint, MetadataError
        for i, p in enumerate({cases!r}):
            d = os.path.join({str(tmp_path)!r}, str(i))
            os.makedirs(d)
            open(os.path.join(d, ".metadata"), "wb").write(p)
            try:
                open_checkpoint(d)
            except MetadataError as e:
                assert "length" in e.message, e.message
                print("refused")
    """)
    assert out.split() == ["refused"] * len(cases)


def test_a_negative_length_at_the_start_of_data_pkl_is_refused(ckpt):
    with_data_pkl(ckpt, "w", b"T\xfb\xff\xff\xff." + data_pkl())
    out = run_child(READ_W.format(path=str(ckpt)))
    assert [line.split()[0] for line in out.splitlines()] == ["MetadataError"] * 2 and "length -5" in out


# -- 2. nesting ------------------------------------------------------------------------------
def test_a_deeply_nested_dict_key_in_the_metadata_is_refused_before_it_is_hashed(tmp_path):
    (tmp_path / ".metadata").write_bytes(deep_key())  # 200 KB; hashing it crashed the process
    out = run_child(f"""
        from dcp_reader import open_checkpoint, UnsafePickleError
        try:
            open_checkpoint({str(tmp_path)!r})
        except UnsafePickleError as e:
            print(e.message)
    """)
    assert f"more than {MAX_DEPTH}" in out


def test_a_deeply_nested_dict_key_in_data_pkl_is_refused(ckpt):
    with_data_pkl(ckpt, "w", deep_key())
    out = run_child(READ_W.format(path=str(ckpt)))
    assert out.count("UnsafePickleError") == 2 and "nesting" in out


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_deeply_nested_value_never_reaches_torch_load(ckpt, allow_pickle):
    """read_value hands a value's blob to torch.load (weights_only unless allow_pickle),
    which crashed on the same key."""
    with_data_pkl(ckpt, "v", deep_key())
    out = run_child(f"""
        from dcp_reader import open_checkpoint, UnsafePickleError
        try:
            open_checkpoint({str(ckpt)!r}, allow_pickle={allow_pickle}).read_value("v")
        except UnsafePickleError as e:
            print(e.key, e.message)
    """)
    assert out.startswith("v ") and "nesting" in out


def test_a_deeply_nested_native_values_pickle_is_refused(tmp_path):
    w = NativeWriter(tmp_path, allow_pickle=True)
    values = w.write_values({"obj": {1, 2}})  # a set: JSON cannot hold it, so it is pickled
    w.commit(CheckpointMetadata(tensors={}, values=values, format="native"))
    (tmp_path / values["obj"].file).write_bytes(deep_key())
    out = run_child(f"""
        from dcp_reader import open_checkpoint, MetadataError
        try:
            open_checkpoint({str(tmp_path)!r}, allow_pickle=True, verify_checksums=False).read_value("obj")
        except MetadataError as e:
            print(e.message)
    """)
    assert "nesting" in out




def _nested(name: str, depth: int) -> bytes:
    prefix, inner, suffix = NESTS[name]
    return b"\x80\x04" + prefix * depth + inner + suffix * depth + b"."


@pytest.mark.parametrize("name", sorted(NESTS))
def test_nesting_through_every_container_opcode_is_bounded(name):
    assert scan_pickle(_nested(name, 50))[0] is None  # shallow: fine, and well formed
    problem, _ = scan_pickle(_nested(name, MAX_DEPTH + 10))
    assert problem and "nesting" in problem


def test_a_container_filled_after_it_was_memoized_is_as_deep_for_every_reference():
    # L = []; memo it; append a 900-deep tuple; then GET L and nest it in 200 more tuples
    inner = b")" + b"\x85" * 900
    p = b"\x80\x04]\x94" + inner + b"a0h\x00" + b"\x85" * 200 + b"."
    problem, _ = scan_pickle(p)
    assert problem and "nesting" in problem


# -- 3. memory -------------------------------------------------------------------------------
MEMORY_CHILD = """
    import re, time
    import torch  # imported by reads of torch.save payloads: not what is measured
    from dcp_reader import open_checkpoint, CheckpointError
    def kib(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := RSS (imports peak higher)
    before = kib("VmRSS")
    t0 = time.perf_counter()
    try:
        {call}
        print("loaded")
    except CheckpointError as e:
        print(type(e).__name__, e.message[:300])
    print(f"grew {{(kib('VmHWM') - before) / 1024:.1f}} MiB in {{time.perf_counter() - t0:.2f}} s")
"""


def _grew(out: str) -> float:
    return float(out.rsplit("grew ", 1)[1].split()[0])


@pytest.mark.parametrize("fn", [b"torch.serialization\n_get_layout", b"pathlib\nPosixPath", b"torch\nSize",
                                b"collections\nOrderedDict", b"builtins\nset",
                                b"torch.distributed.checkpoint.metadata\nMetadata"])
def test_a_shared_tuple_passed_to_5000_calls_is_refused_in_bounded_memory(tmp_path, fn):
    (tmp_path / ".metadata").write_bytes(shared_calls(fn))  # 45 KB; 780 MiB before
    out = run_child(MEMORY_CHILD.format(call=f"open_checkpoint({str(tmp_path)!r})"))
    assert out.startswith("UnsafePickleError") and "copy more than" in out, out
    assert _grew(out) < 64, out


def test_calls_of_data_pkl_copying_a_shared_tuple_are_refused(ckpt):
    with_data_pkl(ckpt, "w", shared_calls(b"torch._utils\n_rebuild_tensor_v2"))
    out = run_child(READ_W.format(path=str(ckpt)))
    assert out.count("UnsafePickleError") == 2, out


def test_a_value_torch_load_would_amplify_is_refused_before_torch_load(ckpt):
    """torch.Size(shared list) 5,000 times: torch.load (weights_only) copies the list each time."""
    with_data_pkl(ckpt, "v", b"\x80\x02ctorch\nSize\nq\x00]q\x01(" + b"K\x01" * 20_000 + b"e("
                  + b"h\x00h\x01\x85R" * 5_000 + b"l.")
    out = run_child(MEMORY_CHILD.format(call=f"open_checkpoint({str(ckpt)!r}).read_value('v')"))
    assert out.startswith("UnsafePickleError") and _grew(out) < 64, out


def test_an_error_naming_a_persistent_id_of_shared_lists_formats_only_its_start(tmp_path):
    """A 2 KB persistent id (lists of 250 references to one list of 250 references to one list
    of 250 Nones) whose repr is 94 million characters: formatted whole before it was cut."""
    p = (b"\x80\x02]q\x00(" + b"N" * 250 + b"e]q\x01(" + b"h\x00" * 250 + b"e(" + b"h\x01" * 250 + b"lQ.")
    (tmp_path / ".metadata").write_bytes(p)
    out = run_child(MEMORY_CHILD.format(call=f"open_checkpoint({str(tmp_path)!r})"))
    assert out.startswith("UnsafePickleError") and "persistent id [[[None, None" in out, out
    assert _grew(out) < 32, out


def test_every_allowed_callable_charges_what_it_copies():
    for allowed in (_ALLOWED, _DataPickle.allowed, HYPER_ALLOWED):
        for name, obj in allowed.items():
            ok = (isinstance(obj, _Charged) or isinstance(obj, str) or obj is object
                  or (isinstance(obj, type) and issubclass(obj, _Record)))
            assert ok, f"{name} -> {obj!r} copies its arguments uncharged"


# -- 4. format detection ---------------------------------------------------------------------
def test_a_fifo_metadata_does_not_block_format_detection(tmp_path):
    os.mkfifo(tmp_path / ".metadata")
    out = run_child(f"""
        from dcp_reader import detect_format, open_checkpoint, UnsafePathError
        print(detect_format({str(tmp_path)!r}))
        try:
            open_checkpoint({str(tmp_path)!r})
        except UnsafePathError as e:
            print("UnsafePathError", e.message)
    """, timeout=30)
    assert out.startswith("torch-dcp\nUnsafePathError") and "a FIFO" in out


def test_a_metadata_linking_out_of_the_directory_is_not_read(tmp_path):
    outside = tmp_path / "outside.pkl"
    outside.write_bytes(b"\x80\x04\x95hyper_parallel.core.distributed_checkpoint.metadata")
    (tmp_path / "ckpt").mkdir()
    os.symlink(outside, tmp_path / "ckpt" / ".metadata")
    assert detect_format(tmp_path / "ckpt") == "torch-dcp"  # its content decided "hyper-parallel"
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        open_checkpoint(tmp_path / "ckpt")


# -- 5. BUILD on stand-ins -------------------------------------------------------------------
@pytest.mark.parametrize("pkl", [
    data_pkl(ref_state=b"}" + _u("numel") + b"Ns"),  # {"numel": None} on the storage reference
    data_pkl(type_state=b"N}" + _u("dtype") + b"K\x05s\x86"),  # a slot state on the storage type
    data_pkl(ref_state=b"N}" + _u("key") + b"K\x05s\x86"),
], ids=["numel-on-reference", "slots-on-storage-type", "slots-on-reference"])
def test_build_on_a_stand_in_of_data_pkl_is_a_metadata_error(ckpt, pkl):
    with_data_pkl(ckpt, "w", pkl)
    with open_checkpoint(ckpt) as r:
        c = r.metadata.tensors["w"].chunks[0]
        with pytest.raises(MetadataError, match="BUILD"):
            r.check_chunk("w", c)
        with pytest.raises(MetadataError, match="BUILD"):
            r.read("w", c, (0, 0), (3, 4))


def test_an_untouched_data_pkl_reads_as_saved(ckpt):
    with_data_pkl(ckpt, "w", data_pkl())  # the hand-built pickle the cases above vary
    with open_checkpoint(ckpt) as r:
        c = r.metadata.tensors["w"].chunks[0]
        assert torch.equal(r.read("w", c, (0, 0), (3, 4)), torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_build_on_a_dtype_or_an_allowed_callable_of_the_metadata_is_refused(ckpt):
    for target in (b"ctorch\nfloat32\n", b"ctorch\nSize\n"):
        (ckpt / ".metadata").write_bytes(b"\x80\x02" + target + b"N}" + _u("name") + b"K\x05s\x86b.")
        with pytest.raises(MetadataError, match="BUILD"):
            open_checkpoint(ckpt)


# -- 6. read() owns its memory ---------------------------------------------------------------
def test_read_of_a_blob_loaded_whole_returns_memory_of_its_own(tmp_path):
    w = torch.randn(40, 8)
    _save({"w": w}, tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    buf = io.BytesIO()
    torch.save(w, buf, _use_new_zipfile_serialization=False)  # legacy: cannot be narrowed
    (tmp_path / info.relative_path).write_bytes(buf.getvalue())
    info.offset, info.length = 0, len(buf.getvalue())
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with open_checkpoint(tmp_path) as r:
        c = r.metadata.tensors["w"].chunks[0]
        first = r.read("w", c, (0, 0), (40, 8))
        first.fill_(7.0)
        r.read("w", c, (0, 0), (40, 8), framework="numpy")[:] = 8.0
        assert torch.equal(r.read("w", c, (0, 0), (40, 8)), w)
        assert r.torch_save_reads["whole"] == 1  # still decoded once


# -- issue 23: torch's refusal, quoted cleanly -----------------------------------------------
class Opaque:
    pass


def test_a_value_weights_only_refuses_gives_clean_advice(tmp_path):
    _save({"w": torch.ones(2), "obj": Opaque()}, tmp_path)
    with open_checkpoint(tmp_path) as r, pytest.raises(UnsafePickleError) as info:
        r.read_value("obj")
    text = info.value.message
    assert "\x1b" not in text and "\n" not in text and "\t" not in text
    assert "(Unsupported global: GLOBAL " in text and "Opaque was not an allowed global by default.)" in text
    assert "allow_pickle=True" in text and "nothing was executed" in text
    assert "In PyTorch 2.6" not in text  # torch's own advice about torch.load is not ours


def test_clean_text_cuts_at_a_sentence_or_word_and_drops_escapes():
    text = "\x1b[1mFirst sentence is here.\x1b[0m Second one\n\tis longer than the limit allows"
    assert clean_text(text, 40) == "First sentence is here."
    assert clean_text("word " * 20, 30).endswith("…") and "wor…" not in clean_text("word " * 20, 30)
    assert clean_text("short") == "short"


# -- properties ------------------------------------------------------------------------------
_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5),
                  st.binary(max_size=5))
_objects = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(st.integers(), inner, max_size=3),
    st.frozensets(st.integers(), max_size=3), st.sets(st.text(max_size=2), max_size=3)), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_objects, st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_the_scan_accepts_what_pythons_pickler_writes(obj, protocol):
    shared = [obj, obj, (obj,)]  # memo references too
    p = pickle.dumps(shared, protocol=protocol)
    assert scan_pickle(p) == (None, len(p))


@settings(max_examples=300, deadline=None)
@given(_objects, st.integers(0, pickle.HIGHEST_PROTOCOL), st.data())
def test_the_scan_ends_on_any_damage_and_what_it_accepts_loads(obj, protocol, data):
    p = bytearray(pickle.dumps(obj, protocol=protocol))
    for _ in range(data.draw(st.integers(1, 4))):
        p[data.draw(st.integers(0, len(p) - 1))] = data.draw(st.integers(0, 255))
    problem, end = scan_pickle(bytes(p))  # ends: every opcode moves the walk forward
    assert 0 <= end <= len(p)
    if problem is None:
        try:
            pickle.loads(bytes(p[:end]))  # builtins only: what the flips can name is harmless here
        except Exception:  # noqa: BLE001 - refusing is the unpickler's right; not crashing is the point
            pass


@settings(max_examples=200, deadline=None)
@given(_objects, st.integers(5, 120))
def test_short_repr_stays_within_its_limit_and_is_repr_when_short(obj, limit):
    text = short_repr(obj, limit)
    assert len(text) <= limit
    if type(obj) in (int, str, bytes, list, tuple, dict) and len(repr(obj)) <= limit and not isinstance(obj, dict):
        assert text == repr(obj) or "int of" in text


def test_a_long_string_copied_item_by_item_by_many_calls_is_refused():
    """list(s) of one shared 200,000-character str 5,000 times: 3 GiB from 200 KB (found by
    the fuzzer in a native values.pkl)."""
    p = (b"\x80\x02cbuiltins\nlist\nq\x00" + _u("x" * 200_000) + b"q\x01(" + b"h\x00h\x01\x85R" * 5_000
         + b"l.")
    problem, _ = scan_pickle(p)
    assert problem and "copy more than" in problem
