"""Mutation engine of the checkpoint fuzzer (used by test_fuzz_checkpoints.py and
benchmarks/storage/fuzz_checkpoints.py).

``build_seeds`` writes one small checkpoint per format; mutant ``i`` of seed ``s`` is a copy
of one seed with one mutation drawn from ``random.Random(f"{s}:{i}")`` (reproducible alone).
``run_all`` loads every mutant with ``dcp_load.load(..., no_dist=True)`` into poisoned
targets, in child processes forked from a forkserver with torch preloaded, a batch of
mutants per child, each mutant under a time limit (the child is killed past it) and an
address-space limit, its peak RSS measured alone, and classifies each outcome:

- ``same``: loaded, every tensor equal to what was saved.
- ``typed``: CheckpointError or LoadError, targets untouched; ``typed-after-write``: the
  same, found while executing, after earlier tensors were written (counted, not a failure:
  dcp-load's message says so).
- ``changed``: loaded, a tensor differs; ``value-changed``: loaded, a non-tensor value
  differs. Failures in the native formats (``native``, ``native-pickle``: block checksums
  and value checksums must catch them); counted as ``changed-unprotected`` /
  ``value-changed-unprotected`` for formats that carry no checksums.
- failures: ``untyped`` (any other exception, or a LoadError whose causes name an error
  type outside dcp_reader's), ``touched`` (typed error but targets written outside
  execute), ``hang`` (past the mutant's time limit), ``crash`` (child died, e.g. by a
  signal), ``memory`` (the mutant's peak RSS grew beyond ``memory_bound`` of its files'
  size, or MemoryError).

Two formats mutate pickles by their structure (``pickle_mutations``): ``torch-dcp-pickle``
(the torch DCP seed's ``.metadata``, a tensor blob's ``data.pkl``, a value blob's
``data.pkl``) and ``native-values-pickle`` (``values.pkl``, value checksums recomputed, so
that a changed value is counted as ``value-changed-unprotected``). They take 4 of every 10
mutants (``CYCLE``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
import re
import resource
import shutil
import struct
import tempfile
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import pickle_mutations as pm

FORMATS = ("native", "native-pickle", "hf", "hf-index", "torch-dcp", "torch-dcp-hf", "torch-dcp-pickle",
           "native-values-pickle")
CYCLE = FORMATS[:6] + ("torch-dcp-pickle",) * 3 + ("native-values-pickle",)  # mutant i: CYCLE[i % 10]
SEED_OF = {"torch-dcp-pickle": "torch-dcp", "native-values-pickle": "native-pickle"}
DCP_VALUE = "lr"  # the torch DCP seed's non-tensor value (a torch.save blob)
FAILURES = ("untyped", "touched", "changed", "value-changed", "hang", "crash", "memory", "engine")
NATIVE = ("native", "native-pickle")  # dcp's own format: block checksums and value checksums
GiB = 1 << 30
MiB = 1 << 20


def memory_bound(size: int) -> int:
    """Peak RSS a mutant of ``size`` bytes (all its files) may add: 256 MiB for torch.load
    and the reader's caches, plus 64 bytes of Python objects per byte of file (a refusal
    builds at most a few objects per opcode; a tuple nested 200,000 deep in a 200 KB file is
    refused before it is built)."""
    return 256 * MiB + 64 * size


class Opaque:
    """A non-JSON value, saved pickled (native-pickle seed)."""

    def __init__(self, x: int):
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and getattr(other, "x", None) == getattr(self, "x", None)  # a mutant may lack x


def _tensors() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(16, 8, generator=g), "b": torch.arange(12, dtype=torch.int64),
            "c": torch.randn(6, 4, generator=g).to(torch.bfloat16), "d": torch.randn(3, generator=g)}


def build_seeds(root: str) -> dict[str, str]:
    """One small checkpoint per format under ``root``; {format: directory}."""
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_load import save
    from safetensors.torch import save_file

    t = _tensors()
    dirs = {f: os.path.join(root, f) for f in FORMATS if f not in SEED_OF}
    save({**t, "step": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=dirs["native"], no_dist=True)
    save({**t, "obj": Opaque(5)}, checkpoint_id=dirs["native-pickle"], no_dist=True, allow_pickle=True)
    os.makedirs(dirs["hf"])
    save_file(t, os.path.join(dirs["hf"], "model.safetensors"))
    os.makedirs(dirs["hf-index"])
    save_file({"a": t["a"], "b": t["b"]}, os.path.join(dirs["hf-index"], "model-1.safetensors"))
    save_file({"c": t["c"], "d": t["d"]}, os.path.join(dirs["hf-index"], "model-2.safetensors"))
    wm = {"a": "model-1.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors",
          "d": "model-2.safetensors"}
    with open(os.path.join(dirs["hf-index"], "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when saving without a process group
        dcp.save({**t, "step": torch.tensor(3), DCP_VALUE: 0.5}, checkpoint_id=dirs["torch-dcp"])
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(t, storage_writer=HuggingFaceStorageWriter(path=dirs["torch-dcp-hf"], save_distributed=True))
    return {**dirs, **{f: dirs[s] for f, s in SEED_OF.items()}}


def expected(fmt: str) -> dict[str, Any]:
    import torch

    fmt = SEED_OF.get(fmt, fmt)
    t = _tensors()
    if fmt == "native":
        return {**t, "step": 3, "cfg": {"lr": 0.1, "betas": (0.9, 0.99)}}
    if fmt == "native-pickle":
        return {**t, "obj": Opaque(5)}
    if fmt == "torch-dcp":
        return {**t, "step": torch.tensor(3), DCP_VALUE: 0.5}
    return t


# -- mutations ---------------------------------------------------------------------------------
_WEIRD = [None, -1, 0, 2**70, "x", [], {}, 1.5, [1, 2, 3], {"a": 1}, True, "../../etc/passwd", "/etc/hostname",
          "../outside.safetensors", "a/../../x", float(2**63)]


def _weird(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.08:
        return "@@HUGEINT@@"
    if r < 0.16:
        return "@@DEEP@@"
    return rng.choice(_WEIRD)


def _dumps(doc: Any, rng: random.Random) -> bytes:
    text = json.dumps(doc)
    text = text.replace('"@@HUGEINT@@"', "9" * rng.choice([4400, 5000, 20000]))
    depth = rng.choice([2000, 50_000, 200_000])
    return text.replace('"@@DEEP@@"', "[" * depth + "]" * depth).encode()


def _mutate_json(doc: Any, rng: random.Random) -> Any:
    """Replace, delete or retype one node picked by a random walk."""
    if not isinstance(doc, (dict, list)) or not doc:
        return _weird(rng)
    node = doc
    for _ in range(rng.randint(1, 6)):
        k = rng.choice(list(node) if isinstance(node, dict) else list(range(len(node))))
        child = node[k]
        if not (isinstance(child, (dict, list)) and child and rng.random() < 0.75):
            break
        node = child
    k = rng.choice(list(node) if isinstance(node, dict) else list(range(len(node))))
    action = rng.random()
    if action < 0.15 and isinstance(node, dict):
        del node[k]
    elif action < 0.25 and isinstance(node, dict):
        node[k + "x" if isinstance(k, str) else k] = node.pop(k)
    else:
        node[k] = _weird(rng)
    return doc


def _files(d: str) -> list[str]:
    # .dcp-save.lock (a native save's writer lock) is never read by a load: not worth a mutant
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs
                  if f != ".dcp-save.lock")


def _flip(path: str, rng: random.Random, lo: int = 0, hi: int | None = None) -> str:
    data = bytearray(open(path, "rb").read())
    if not data:
        return "flip (empty file)"
    hi = len(data) if hi is None else min(hi, len(data))
    lo = min(lo, hi - 1)
    where = []
    for _ in range(rng.choice([1, 1, 2, 8])):
        i = rng.randrange(lo, hi)
        data[i] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
        where.append(i)
    open(path, "wb").write(bytes(data))
    return f"flip bytes {where[:4]}"


def _header(path: str) -> tuple[int, dict[str, Any], bytes] | None:
    data = open(path, "rb").read()
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        return n, json.loads(data[8:8 + n]), data[8 + n:]
    except ValueError:
        return None


def _mutate_safetensors(path: str, rng: random.Random) -> str:
    r = rng.random()
    h = _header(path)
    if r < 0.3 and h:
        return _flip(path, rng, 0, 8 + h[0])  # inside the header
    if r < 0.4:
        huge = rng.choice([2**63, 2**40, os.path.getsize(path), 0])
        data = open(path, "rb").read()
        open(path, "wb").write(struct.pack("<Q", huge % 2**64) + data[8:])
        return f"header length {huge}"
    if h is None:
        return _flip(path, rng)
    n, doc, rest = h
    doc = _mutate_json(doc, rng)
    raw = _dumps(doc, rng)
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + rest)
    return "header json"


def _mutate_pickle_metadata(path: str, rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return _flip(path, rng)
    if r < 0.35:
        open(path, "wb").write(b"\x80\x04}r\x00\x00\x00\x08.")
        return "memo index bomb"
    if r < 0.4:
        open(path, "wb").write(pickle.dumps(os.system))
        return "global os.system"
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own seed: trusted
    infos = list(md.storage_data.values())
    info = rng.choice(infos)
    field = rng.choice(["offset", "length", "relative_path"])
    if field == "relative_path":
        value = rng.choice(["../x.distcp", "/etc/hostname", ".metadata", "nope.distcp", infos[0].relative_path])
    else:
        value = rng.choice([0, 1, 2**40, getattr(info, field) + rng.randint(-64, 64), 10**30])
    try:
        setattr(info, field, value)
    except Exception:  # noqa: BLE001 - a frozen dataclass: rebuild it
        import dataclasses

        key = next(k for k, v in md.storage_data.items() if v is info)
        md.storage_data[key] = dataclasses.replace(info, **{field: value})
    if rng.random() < 0.2:  # also a tensor's chunk
        tm = rng.choice([m for m in md.state_dict_metadata.values() if hasattr(m, "chunks")])
        c = rng.choice(tm.chunks)
        import torch

        object.__setattr__(c, rng.choice(["sizes", "offsets"]), torch.Size([rng.choice([0, 1, 99, 2**40])] * len(c.sizes)))
    with open(path, "wb") as f:
        pickle.dump(md, f)
    return f"storage {field}={value!r:.30}"


def _replace_file(path: str, rng: random.Random, outside: str) -> str:
    kind = rng.choice(["fifo", "dir", "link-out", "dev-zero", "delete", "empty", "link-dir"])
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "link-out":
        os.symlink(outside, path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "link-dir":
        os.symlink(".", path)
    return f"replace with {kind}"


def mutate(rng: random.Random, seed_dir: str, dst: str, fmt: str, outside: str) -> str:
    """Copy ``seed_dir`` to ``dst`` and apply one mutation; returns its description."""
    shutil.copytree(seed_dir, dst, symlinks=True)
    if fmt == "torch-dcp-pickle":
        return pm.mutate_torch_dcp_pickle(dst, rng, DCP_VALUE)
    if fmt == "native-values-pickle":
        return pm.mutate_values_pickle(dst, rng)
    files = _files(dst)
    name = rng.choice(files)
    path = os.path.join(dst, name)
    r = rng.random()
    if r < 0.1:
        return f"{name}: " + _replace_file(path, rng, outside)
    if r < 0.2:
        size = os.path.getsize(path)
        os.truncate(path, rng.randrange(size) if size else 0)
        return f"{name}: truncate"
    if r < 0.25:
        with open(path, "ab") as f:
            f.write(os.urandom(rng.choice([1, 100, 5000])))
        return f"{name}: append"
    if name.endswith(".safetensors"):
        return f"{name}: " + _mutate_safetensors(path, rng)
    if name.endswith(".json"):
        try:
            doc = json.loads(open(path, "rb").read())
        except ValueError:
            return f"{name}: " + _flip(path, rng)
        if rng.random() < 0.2:
            return f"{name}: " + _flip(path, rng)
        open(path, "wb").write(_dumps(_mutate_json(doc, rng), rng))
        return f"{name}: json"
    if name == ".metadata":
        return f"{name}: " + _mutate_pickle_metadata(path, rng)
    return f"{name}: " + _flip(path, rng)


# -- running a mutant --------------------------------------------------------------------------
def _poisoned(want: dict[str, Any]) -> dict[str, Any]:
    import torch

    out = {}
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, float("nan")) if v.is_floating_point() else torch.full_like(v, -123)
        elif isinstance(v, dict):  # nested: saved flattened ("cfg.lr"), loaded back into place
            out[k] = _poisoned(v)
        else:
            out[k] = "poison"
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8) if a.numel() else a, b.reshape(-1).view(torch.uint8) if b.numel() else b)
    return type(a) is type(b) and a == b


_TYPE_NAME = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception|Interrupt))\b")


def _typed_names() -> set[str]:
    import dcp_reader

    return {n for n in dir(dcp_reader) if isinstance(getattr(dcp_reader, n), type)
            and issubclass(getattr(dcp_reader, n), dcp_reader.CheckpointError)} | {"LoadError"}


def run_one(fmt: str, d: str) -> tuple[str, str]:
    """(outcome, detail) of loading directory ``d`` holding a mutant of format ``fmt``."""
    import torch
    from dcp_load import LoadError, load
    from dcp_reader import CheckpointError

    want = expected(fmt)
    targets = _poisoned(want)
    poison = _poisoned(want)
    try:
        load(targets, checkpoint_id=d, no_dist=True, allow_pickle=SEED_OF.get(fmt, fmt) == "native-pickle")
    except (CheckpointError, LoadError) as e:
        text = str(e)
        # the outermost error of each cause is the first type name in it ("MetadataError: x
        # (JSONDecodeError: ...)" is typed); causes without one are dcp-load's own checks
        causes = [c for cs in getattr(e, "failures", {}).values() for c in cs]
        outer = {m.group(1) for c in causes if (m := _TYPE_NAME.search(c))}
        untyped = sorted(outer - _typed_names())
        if untyped:
            return "untyped", f"{type(e).__name__} wrapping {untyped}: {text[:300]}"
        untouched = all(_same(targets[k], poison[k]) for k in targets)
        if untouched:
            return "typed", type(e).__name__
        if getattr(e, "phase", None) == "execute":
            return "typed-after-write", text[:200]
        return "touched", f"{type(e).__name__} after writing targets: {text[:300]}"
    except MemoryError:
        return "memory", "MemoryError"
    except Exception as e:  # noqa: BLE001 - the fuzzer's point: report anything untyped
        return "untyped", f"{type(e).__name__}: {e!s:.200}\n{traceback.format_exc()[-600:]}"
    diff = [k for k in want if isinstance(want[k], torch.Tensor) and not _same(targets[k], want[k])]
    if diff:
        return "changed", f"tensors {diff}"
    vdiff = [k for k in want if not isinstance(want[k], torch.Tensor) and not _same(targets[k], want[k])]
    if vdiff:
        return "value-changed", f"values {vdiff}"
    return "same", ""


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (Linux clear_refs 5); its RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kib("VmRSS") * 1024


def _size(d: str) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for f in _files(d))


def _child(seed_dirs: dict[str, str], seed: int, indices: list[int], conn: Any, work: str) -> None:
    import torch

    torch.set_num_threads(1)
    soft = resource.getrlimit(resource.RLIMIT_AS)
    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + 3 * GiB, soft[1]))  # protect the machine
    outside = os.path.join(work, "outside.bin")
    with open(outside, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    for i in indices:
        rng = random.Random(f"{seed}:{i}")
        fmt = CYCLE[i % len(CYCLE)]
        d = os.path.join(work, f"m{i}")
        conn.send(("start", i, fmt, "?"))
        try:
            desc = mutate(rng, seed_dirs[fmt], d, fmt, outside)
        except Exception as e:  # noqa: BLE001 - a bug in the engine: reported, not retried forever
            conn.send(("done", i, "engine", f"mutation failed: {type(e).__name__}: {e}"))
            shutil.rmtree(d, ignore_errors=True)
            continue
        conn.send(("start", i, fmt, desc))
        bound = memory_bound(_size(d))
        base = _reset_peak()
        try:
            outcome, detail = run_one(fmt, d)
        except Exception as e:  # noqa: BLE001 - a bug in the engine's own checks: reported
            outcome, detail = "engine", f"checking the outcome failed: {type(e).__name__}: {e}"
        grew = _kib("VmHWM") * 1024 - base
        if grew > bound:
            outcome, detail = "memory", f"peak RSS grew by {grew / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB); {detail}"
        conn.send(("done", i, outcome, detail))
        shutil.rmtree(d, ignore_errors=True)
    conn.send(("end",))


def run_all(seed_dirs: dict[str, str], seed: int, count: int, *, batch: int = 100,
            batch_timeout: float = 120.0, workers: int = 1, log: Any = None,
            only: list[int] | None = None, mutant_timeout: float = 60.0) -> dict[str, Any]:
    """Run mutants 0..count-1 (or the indices ``only``); a child is killed when one mutant
    runs past ``mutant_timeout`` s (a hang) or its batch past ``batch_timeout`` s; returns
    {"counts": Counter, "failures": [(i, fmt, desc, outcome, detail)], "by_format": {fmt: Counter},
    "seconds": float}."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dcp_load", "dcp_reader", "safetensors.torch", __name__])
    t0 = time.perf_counter()
    pending = list(range(count)) if only is None else list(only)
    counts: Counter[str] = Counter()
    by_format: dict[str, Counter[str]] = {f: Counter() for f in FORMATS}
    failures: list[tuple[Any, ...]] = []
    running: list[tuple[Any, Any, list[int], float, dict[int, tuple[str, str, float]], str]] = []

    def record(i: int, fmt: str, desc: str, outcome: str, detail: str) -> None:
        if outcome in ("changed", "value-changed") and fmt not in NATIVE:
            outcome += "-unprotected"  # no checksums in this format: counted only
        counts[outcome] += 1
        by_format[fmt][outcome] += 1
        done = sum(counts.values())
        if log and done % 500 == 0:
            log(f"{done} mutants in {time.perf_counter() - t0:.0f} s: {dict(sorted(counts.items()))}")
        if outcome in FAILURES:
            failures.append((i, fmt, desc, outcome, detail))
            if log:
                log(f"FAIL mutant {i} ({fmt}, {desc}): {outcome}: {detail[:300]}")

    while pending or running:
        while pending and len(running) < workers:
            part, pending = pending[:batch], pending[batch:]
            work = tempfile.mkdtemp(prefix="dcp-fuzz-")
            a, b = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(seed_dirs, seed, part, b, work), daemon=True)
            p.start()
            b.close()
            running.append((p, a, part, time.monotonic(), {}, work))
        for entry in list(running):
            p, conn, part, started, current, work = entry
            finished = False
            while conn.poll(0.05):
                try:
                    msg = conn.recv()
                except EOFError:
                    break
                if msg[0] == "start":
                    current.clear()
                    current[msg[1]] = (msg[2], msg[3], time.monotonic())
                elif msg[0] == "done":
                    fmt, desc, _ = current.pop(msg[1])
                    part.remove(msg[1])
                    record(msg[1], fmt, desc, msg[2], msg[3])
                else:
                    finished = True
            now = time.monotonic()
            slow = any(now - t > mutant_timeout for _, _, t in current.values())
            timed_out = slow or now - started > batch_timeout
            dead = not p.is_alive() and not conn.poll(0)
            if finished or timed_out or dead:
                if p.is_alive():
                    p.kill()
                p.join()
                running.remove(entry)
                shutil.rmtree(work, ignore_errors=True)
                if current and (slow or not timed_out):  # the mutant in progress hung or crashed it
                    i, (fmt, desc, t) = next(iter(current.items()))
                    part.remove(i)
                    record(i, fmt, desc, "hang" if timed_out else "crash",
                           f"exit code {p.exitcode}" if not timed_out else f"over {now - t:.0f} s")
                pending = part + pending  # not started (or cut by the batch's limit): rerun in a fresh child
        time.sleep(0.01)
    return {"counts": counts, "failures": failures, "by_format": by_format, "seconds": time.perf_counter() - t0}


def summary(result: dict[str, Any]) -> str:
    lines = [f"{sum(result['counts'].values())} mutants in {result['seconds']:.1f} s: "
             + ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items()))]
    for fmt, c in result["by_format"].items():
        lines.append(f"  {fmt:<14} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return "\n".join(lines)
