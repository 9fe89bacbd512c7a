"""Structure-aware mutations of the pickles a checkpoint holds (used by fuzz_mutations.py).

Where: torch DCP's ``.metadata`` (the restricted unpickler), the ``data.pkl`` of a
``.distcp`` tensor blob (narrowing, else torch.load), the ``data.pkl`` of a value blob
(torch.load with weights_only) and a native ``values.pkl`` (pickle.loads, opted in with
allow_pickle; its value checksums are recomputed so that the mutant reaches the unpickler).

What, one per mutant, spliced at a random opcode boundary of the seed's pickle (its FRAME
opcodes removed and its later memo indices renumbered, so that the rest still unpickles):
- ``length``: a length-carrying opcode with a negative or past-the-end length, for every
  such opcode;
- ``nest``: a structure nested near, at and far beyond the scan's depth bound through every
  container opcode, dropped or used as a dict key (hashed);
- ``amplify``: one shared container passed to many calls of an allowed callable of that
  unpickler (as the arguments, as the first argument, through NEWOBJ, as a BUILD state);
- ``build``: BUILD with a hostile state right after every kind of opcode that leaves a
  stand-in on the stack (GLOBAL, BINPERSID, REDUCE, NEWOBJ, ...);
- ``repr``: a persistent id or an argument made of shared lists whose repr is huge.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import random
import struct
import zipfile
from typing import Any

MAX_DEPTH = 1000  # dcp_reader.formats._pickle_scan.MAX_DEPTH: mutants straddle it

LENGTH_OPS = {  # opcode: (length width, signed)
    b"T": (4, True), b"\x8b": (4, True), b"U": (1, False), b"\x8a": (1, False), b"C": (1, False),
    b"\x8c": (1, False), b"B": (4, False), b"X": (4, False), b"\x8e": (8, False), b"\x8d": (8, False),
    b"\x96": (8, False)}

_RECORD = b"torch.distributed.checkpoint.metadata\nStorageMeta\n"
NESTS = {  # an opcode nesting its argument: prefix * depth + inner + suffix * depth
    "TUPLE1": (b"", b"N", b"\x85"), "TUPLE2": (b"", b"N", b"N\x86"), "TUPLE3": (b"", b"N", b"NN\x87"),
    "TUPLE": (b"(", b"N", b"t"), "LIST": (b"(", b"N", b"l"), "DICT": (b"(K\x01", b"}", b"d"),
    "FROZENSET": (b"(", b"", b"\x91"), "APPEND": (b"]", b"N", b"a"), "APPENDS": (b"](", b"N", b"e"),
    "SETITEM": (b"}K\x01", b"N", b"s"), "SETITEMS": (b"}(K\x01", b"N", b"u"), "ADDITEMS": (b"\x8f(", b"N", b"\x90"),
    "REDUCE": (b"ctorch\nSize\n(", b"]", b"tR"), "NEWOBJ": (b"c" + _RECORD + b"(", b"N", b"t\x81"),
    "NEWOBJ_EX": (b"c" + _RECORD + b"(", b"N", b"t}\x92"), "OBJ": (b"(c" + _RECORD, b"N", b"o"),
    "INST": (b"(", b"N", b"i" + _RECORD), "BUILD": (b"c" + _RECORD + b")\x81", b"}", b"b"),
    "BINPERSID": (b"", b"N", b"Q"),
}

_DCP = "torch.distributed.checkpoint"
CALLABLES = {  # per unpickler: (GLOBAL argument, is a class) of what it allows
    "metadata": [(f"{_DCP}.metadata\n{n}".encode(), True) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta")] + [(f"{_DCP}.filesystem\n_StorageInfo".encode(), True)] + [
        (g, False) for g in (b"torch\nSize", b"torch.serialization\n_get_layout",
                             f"{_DCP}.metadata\n_MEM_FORMAT_ENCODING".encode(), b"pathlib\nPosixPath",
                             b"pathlib\nWindowsPath", b"pathlib\nPurePosixPath", b"collections\nOrderedDict",
                             b"builtins\nset", b"copyreg\n_reconstructor", b"builtins\nobject")],
    "data.pkl": [(b"torch._utils\n_rebuild_tensor_v2", False), (b"torch._utils\n_rebuild_tensor_v3", False),
                 (b"collections\nOrderedDict", False), (b"torch\nFloatStorage", False),
                 (b"torch\nUntypedStorage", False)],
    "torch.load": [(b"collections\nOrderedDict", True), (b"collections\nCounter", True), (b"torch\nSize", True),
                   (b"builtins\nset", True), (b"builtins\nbytearray", True), (b"_codecs\nencode", False),
                   (b"torch._utils\n_rebuild_tensor_v2", False), (b"builtins\ncomplex", True)],
    "pickle": [(b"builtins\nlist", True), (b"builtins\ntuple", True), (b"builtins\nset", True),
               (b"builtins\nfrozenset", True), (b"builtins\ndict", True), (b"collections\nOrderedDict", True),
               (b"builtins\nbytearray", True), (b"builtins\nslice", True)],
}


def _u(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


# BUILD states (no memo): fields the readers check, wrong types, sizes, a deep one
STATES = [b"}" + _u(k) + v + b"s" for k in ("numel", "dtype", "key", "name", "args", "version", "state")
          for v in (b"N", b"K\x05", b"]", _u("float32"))]
STATES += [b"N}" + _u(k) + v + b"s\x86" for k in ("dtype", "name", "args", "version", "key")
           for v in (b"N", b"K\x05", _u("x"))]
STATES += [b"N", b")", b"(" + b"K\x01" * 20_000 + b"l", b"}(" + b"K\x01N" * 5_000 + b"u",
           b")" + b"\x85" * (MAX_DEPTH + 10), b"N}" + _u("numel") + b")" + b"\x85" * 5_000 + b"s\x86"]
PLACEHOLDER_OPS = {"GLOBAL", "STACK_GLOBAL", "BINPERSID", "PERSID", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST",
                   "EMPTY_DICT", "EMPTY_LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"}
_GETS, _PUTS = {"GET", "BINGET", "LONG_BINGET"}, {"PUT", "BINPUT", "LONG_BINPUT"}


def strip_frames(p: bytes) -> bytes:
    """``p`` without FRAME opcodes (optional in a pickle), so that bytes can be spliced in."""
    out, last = [], 0
    for op, _, pos in pickletools.genops(p):
        if op.name == "FRAME":
            out.append(p[last:pos])
            last = pos + 9
        if op.name == "STOP":
            break
    out.append(p[last:])
    return b"".join(out)


def splice(p: bytes, rng: random.Random, snippet: Any, *, after: set[str] | None = None,
           at_start: bool = False) -> bytes:
    """``p`` with ``snippet(k)`` -> (bytes, m) inserted at a random opcode boundary (after an
    opcode named in ``after`` when given); ``k``: memo entries stored before that point, ``m``:
    entries the snippet stores (indices k .. k+m-1); later memo indices are moved up by m."""
    p = strip_frames(p)
    ops = list(pickletools.genops(p))
    ends = [pos for _, _, pos in ops[1:]] + [len(p)]
    if at_start:
        i = 0
    else:
        lo = 1 if ops[0][0].name == "PROTO" else 0
        choices = [j + 1 for j, (op, _, _) in enumerate(ops[:-1]) if after is None or op.name in after]
        choices = [j for j in choices if j >= lo] or [len(ops) - 1]
        i = rng.choice(choices)
    k = 0
    for op, arg, _ in ops[:i]:
        if op.name == "MEMOIZE" or (op.name in _PUTS and arg == k):
            k += 1
    data, m = snippet(k)
    out = [p[:ops[i][2]] if i < len(ops) else p, data]
    for (op, arg, pos), end in zip(ops[i:], ends[i:], strict=True):
        if op.name in _GETS and arg >= k:
            out.append(b"j" + struct.pack("<I", arg + m))
        elif op.name in _PUTS and arg >= k:
            out.append(b"r" + struct.pack("<I", arg + m))
        else:
            out.append(p[pos:end])
    return b"".join(out)


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _nest(rng: random.Random) -> tuple[bytes, str]:
    name = rng.choice(sorted(NESTS))
    prefix, inner, suffix = NESTS[name]
    depth = rng.choice([MAX_DEPTH - 10, MAX_DEPTH + 10, 20_000, 200_000])
    depth = min(depth, 400_000 // max(1, len(prefix) + len(suffix)))  # at most ~400 KB
    x = prefix * depth + inner + suffix * depth
    if rng.random() < 0.5:
        return x + b"0", f"nest {name} x{depth}"
    return b"}" + x + b"Ns0", f"nest {name} x{depth} as a dict key"


def _amplify(rng: random.Random, target: str) -> tuple[Any, str]:
    fn, is_class = rng.choice(CALLABLES[target])
    width, calls = rng.choice([2_000, 20_000]), rng.choice([500, 5_000])
    mode = rng.choice(["args", "first", "newobj", "build", "string"])
    elem = rng.choice([b"N", b"K\x01"])

    def snippet(k: int) -> tuple[bytes, int]:
        head = b"c" + fn + b"\n" + _put(k) + b"0"
        if mode == "string":
            shared = _u("x" * width * 10)
        elif mode == "build":
            shared = b"}(" + b"".join(b"K" + bytes([j % 256]) + elem for j in range(min(width, 256))) \
                + b"".join(_u(str(j)) + elem for j in range(width)) + b"u"
        else:
            shared = b"(" + elem * width + b"t"
        body = head + shared + _put(k + 1) + b"0("
        if mode == "args":
            call = _get(k) + _get(k + 1) + b"R"
        elif mode in ("first", "string"):
            call = _get(k) + _get(k + 1) + b"\x85R"
        elif mode == "newobj":
            call = _get(k) + _get(k + 1) + b"\x81"
        else:  # a new object of the callable, then BUILD with the shared dict, (dict, slots) form too
            call = _get(k) + b")R" + _get(k + 1) + (b"N\x86" if rng.random() < 0.5 else b"") + b"b"
        return body + call * calls + b"l0", 2

    return snippet, f"amplify {fn.decode().replace(chr(10), '.')} {mode} {width}x{calls}"


def _shared_lists(k: int, width: int = 250) -> bytes:
    """Lists of ``width`` references to lists of ``width`` references to ``width`` Nones,
    memo entries k, k+1 (a repr of ~width**3 items from a few KB)."""
    return (b"]" + _put(k) + b"(" + b"N" * width + b"e]" + _put(k + 1) + b"(" + _get(k) * width + b"e("
            + _get(k + 1) * width + b"l")


def mutate_pickle(p: bytes, rng: random.Random, target: str) -> tuple[bytes, str]:
    """One structure-aware mutation of the pickle ``p`` read by the ``target`` unpickler
    ("metadata", "data.pkl", "torch.load" or "pickle"); (new bytes, description)."""
    kind = rng.choice(["length", "nest", "amplify", "build", "repr"])
    if kind == "length":
        op = rng.choice(sorted(LENGTH_OPS))
        width, signed = LENGTH_OPS[op]
        top = 2 ** (8 * width - signed) - 1
        n = rng.choice([-5, -1, -(2 ** 31)] if signed and rng.random() < 0.6 else [top, len(p), 2 ** (width * 4)])
        n = max(-(2 ** 31), min(n, top))
        data = op + n.to_bytes(width, "little", signed=signed)
        start = rng.random() < 0.2  # the case: at the very start
        return splice(p, rng, lambda k: (data, 0), at_start=start), f"length {op!r} {n}{' at start' * start}"
    if kind == "nest":
        data, desc = _nest(rng)
        return splice(p, rng, lambda k: (data, 0)), desc
    if kind == "amplify":
        snippet, desc = _amplify(rng, target)
        return splice(p, rng, snippet), desc
    if kind == "build":
        state = rng.choice(STATES)
        names = {op.name for op, _, _ in pickletools.genops(strip_frames(p))} & PLACEHOLDER_OPS
        name = rng.choice(sorted(names)) if names else None  # a pickled float has none
        return (splice(p, rng, lambda k: (state + b"b", 0), after={name} if name else None),
                f"build after {name}: {state[:24]!r}")
    use = rng.choice(["persid", "reduce-arg", "build-state"])
    if use == "persid":
        return splice(p, rng, lambda k: (_shared_lists(k) + b"Q0", 2)), "repr: shared-list persistent id"
    if use == "reduce-arg":
        fn, _ = rng.choice(CALLABLES[target])
        return (splice(p, rng, lambda k: (b"c" + fn + b"\n" + _shared_lists(k) + b"\x85R0", 2)),
                f"repr: shared-list argument of {fn.decode().replace(chr(10), '.')}")
    return (splice(p, rng, lambda k: (_shared_lists(k) + b"b", 2), after=PLACEHOLDER_OPS),
            "repr: shared-list BUILD state")


# -- where the pickles live ------------------------------------------------------------------
def _dcp_meta(d: str) -> Any:
    with open(os.path.join(d, ".metadata"), "rb") as f:
        return pickle.load(f)  # the fuzzer's own seed: trusted


def replace_data_pkl(d: str, fqn: str, mutate: Any) -> str:
    """Give ``fqn``'s torch.save blob in the torch DCP checkpoint ``d`` a data.pkl of
    ``mutate(old data.pkl)`` -> (bytes, description): a new zip blob with the old one's other
    entries, appended to its file, the metadata pointed at it."""
    md = _dcp_meta(d)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = os.path.join(d, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        old = f.read(info.length)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(old)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        desc = ""
        for e in src.infolist():
            body = src.read(e)
            if e.filename.endswith("/data.pkl"):
                body, desc = mutate(body)
            dst.writestr(e.filename, body)
    blob = out.getvalue()
    info.offset, info.length = os.path.getsize(path), len(blob)
    with open(path, "ab") as f:
        f.write(blob)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return desc


def mutate_torch_dcp_pickle(d: str, rng: random.Random, value: str) -> str:
    """A structure-aware mutation of one pickle of the torch DCP checkpoint ``d``: its
    .metadata, a tensor blob's data.pkl or the data.pkl of value ``value``'s blob."""
    r = rng.random()
    if r < 0.45:
        path = os.path.join(d, ".metadata")
        with open(path, "rb") as f:
            data, desc = mutate_pickle(f.read(), rng, "metadata")
        with open(path, "wb") as f:
            f.write(data)
        return f".metadata: {desc}"
    fqn, target = (value, "torch.load") if r < 0.7 else (rng.choice(["a", "b", "c", "d"]), "data.pkl")
    return f"data.pkl of {fqn}: " + replace_data_pkl(d, fqn, lambda p: mutate_pickle(p, rng, target))


def mutate_values_pickle(d: str, rng: random.Random) -> str:
    """A structure-aware mutation of the file holding a native checkpoint's pickled values
    (named in its metadata), their value checksums recomputed (a hostile file that is
    consistent: what reaches the unpickler)."""
    import xxhash

    meta_path = os.path.join(d, "dcp-metadata.json")
    with open(meta_path) as f:
        doc = json.load(f)
    by_file: dict[str, list[str]] = {}
    for name, v in (doc.get("values") or {}).items():
        if isinstance(v, dict) and v.get("file"):
            by_file.setdefault(v["file"], []).append(name)
    file = sorted(by_file)[0]
    path = os.path.join(d, file)
    with open(path, "rb") as f:
        data, desc = mutate_pickle(f.read(), rng, "pickle")
    with open(path, "wb") as f:
        f.write(data)
    sums = doc.get("value_checksums") or {}
    for name in by_file[file]:
        if name in sums:
            sums[name] = f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}"
    with open(meta_path, "w") as f:
        json.dump(doc, f)
    return f"{file}: {desc}"
