"""The ``dcp`` command: ``dcp inspect PATH``, ``dcp verify PATH``, ``dcp plan``, ``dcp convert`` and ``dcp demo``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..run._units import human_bytes, plural

_IMPORTED = time.perf_counter()  # the fallback start of the command where /proc cannot say when it began

#: (distribution, import name) of every dcp package, as ``dcp --version`` lists them.
PACKAGES = (("dcp-load", "dcp_load"), ("dcp-reader", "dcp_reader"), ("dcp-broadcast", "dcp_broadcast"),
            ("dcp-platform", "dcp_platform"))


def versions() -> list[str]:
    """``"dcp-load 0.4.1"`` per dcp package: the version of the code that would be imported
    (its ``_version`` module), ``"not installed"`` for a package that cannot be found.

    Each ``_version.py`` is run on its own, without importing its package: ``dcp --version``
    imports no package of dcp (nor torch), whatever their ``__init__`` imports."""
    import importlib.util

    out = []
    for dist, module in PACKAGES:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            out.append(f"{dist} not installed")
            continue
        out.append(f"{dist} {_version_of(module, spec.submodule_search_locations[0])}")
    return out


def _version_of(module: str, folder: str) -> str:
    """``__version__`` of ``folder/_version.py`` (package ``module``), run as a module of its own;
    the imported one where it is already imported."""
    import importlib.util

    loaded = sys.modules.get(f"{module}._version")
    if loaded is not None:
        return loaded.__version__
    spec = importlib.util.spec_from_file_location(f"{module}._version", os.path.join(folder, "_version.py"))
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    return version.__version__


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version of every dcp package and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print("\n".join(versions()))
        parser.exit()


def inspect(path: str, *, chunks: bool, allow_pickle: bool, out=None, rank: int | None = None) -> int:
    """Print a checkpoint's format, tensors (shape, dtype, chunks, bytes) and values."""
    from dcp_reader import CheckpointError, open_checkpoint

    out = out or sys.stdout
    try:
        reader = open_checkpoint(path, allow_pickle=allow_pickle, rank=rank)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"dcp inspect: {exc}", file=sys.stderr)
        return 2
    with reader:
        meta = reader.metadata
        total = sum(t.nbytes for t in meta.tensors.values())
        files = {c.file for t in meta.tensors.values() for c in t.chunks}
        print(f"{reader.path}: format {meta.format}, {plural(len(meta.tensors), 'tensor')}, "
              f"{plural(len(meta.values), 'value')}, {human_bytes(total)} in {plural(len(files), 'data file')}",
              file=out)
        width = max([4, *(len(n) for n in meta.tensors), *(len(n) for n in meta.values)])
        print(f"{'name':<{width}}  {'shape':<18} {'dtype':<14} {'chunks':>6} {'bytes':>10}", file=out)
        for name in sorted(meta.tensors):
            t = meta.tensors[name]
            shape = "(" + ", ".join(map(str, t.shape)) + ("," if len(t.shape) == 1 else "") + ")"
            print(f"{name:<{width}}  {shape:<18} {t.dtype:<14} {len(t.chunks):>6} {human_bytes(t.nbytes):>10}", file=out)
            if chunks:
                for c in t.chunks:
                    print(f"{'':<{width}}    offsets={c.offsets} sizes={c.sizes} {c.file}:{c.key}", file=out)
        for name in sorted(meta.values):
            print(f"{name:<{width}}  value {_shown_value(reader, name, allow_pickle)}", file=out)
    return 0


def _shown_value(reader, name: str, allow_pickle: bool, limit: int = 60) -> str:
    """A value's repr (read from its file when it has one), cut to ``limit`` characters.
    A value in a file is read as ``load`` reads it: without ``allow_pickle`` only what needs
    no code from the checkpoint (inline JSON; torch DCP values that
    ``torch.load(weights_only=True)`` accepts), so "pickled" marks exactly the values that
    need ``--allow-pickle`` (and ``allow_pickle=True`` in ``load``)."""
    from dcp_reader import CheckpointError, UnsafePickleError

    v = reader.metadata.values[name]
    if v.file is None:
        shown = repr(v.value)
    else:
        try:
            shown = repr(reader.read_value(name))
        except UnsafePickleError:
            return f"(pickled in {v.file}; --allow-pickle shows it, for checkpoints you trust)"
        except (CheckpointError, OSError, ValueError) as exc:
            return f"(unreadable from {v.file}: {type(exc).__name__}: {exc})"
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def waited() -> float:
    """Seconds since this process started (what the user of the command has waited: the
    interpreter's start and the imports included), from ``/proc`` on Linux (10 ms steps);
    elsewhere since this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / ticks)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


def verify(path: str, *, out=None, clock: Callable[[], float] | None = None) -> int:
    """Check a whole checkpoint (structure, sizes, coverage, block and value checksums): exit status 0
    when it is good, 1 when problems were found (one line each), 2 when it cannot be read.
    ``clock``: the seconds the user has waited, printed beside the checking time (the
    ``dcp`` command passes ``waited``: its start and imports included)."""
    from dcp_reader import CheckpointError, verify_checkpoint

    out = out or sys.stdout
    try:
        report = verify_checkpoint(path)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"dcp verify: unreadable: {exc}", file=sys.stderr)
        return 2
    for problem in report.problems:
        print(f"PROBLEM {problem}", file=out)
    if report.chunks_with_checksums:
        checked = f"{report.chunks_with_checksums} with checksums, {human_bytes(report.bytes_verified)} verified"
    elif report.format == "torch-dcp":  # torch's own save writes none; dcp's adds dcp-checksums.json
        checked = "no checksums (not saved by dcp: no dcp-checksums.json): structure, sizes and coverage checked"
    else:
        checked = "no checksums: structure, sizes and coverage checked"
    status = "OK" if report.ok else f"{len(report.problems)} problem(s)"
    values = (f", {report.values} values ({report.values_with_checksums} with checksums)"
              if report.values else "")
    print(f"{report.path}: {status}: format {report.format}, {report.tensors} tensors, {report.chunks} chunks "
          f"({checked}){values} in {_took(report.seconds, clock)}", file=out)
    return 0 if report.ok else 1


def _took(checking: float, clock: Callable[[], float] | None) -> str:
    """``"0.21 s (0.05 s checking)"``: the user's wait, then the checking's part of it."""
    if clock is None:
        return f"{checking:.2f} s"
    return f"{max(clock(), checking):.2f} s ({checking:.2f} s checking)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dcp", description="Inspect, verify, plan the load of and convert distributed checkpoints; run the demo. "
        "Every checkpoint path may be a directory or an object-store URI (s3://bucket/prefix; gs://, az://).")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="format, tensors, shapes, dtypes, chunks and bytes of a checkpoint")
    p.add_argument("path", help="checkpoint directory or s3://bucket/prefix (native, Hugging Face safetensors, "
                   "torch DCP or hyper-parallel)")
    p.add_argument("--chunks", action="store_true", help="also list every saved chunk")
    p.add_argument("--allow-pickle", action="store_true",
                   help="also show values that only unpickling can read, which runs code from the "
                   "checkpoint (only for checkpoints you trust); values that need no code are always shown")
    p.add_argument("--rank", type=int, help="the rank's metadata to show where each rank saved its own "
                   "(a hyper-parallel save without collectives: {rank}.metadata)")
    from ._plan import add_parser as add_plan

    add_plan(sub)
    from ._convert import add_parser as add_convert

    add_convert(sub)
    v = sub.add_parser("verify", help="check a checkpoint: structure, file sizes, coverage, block and value checksums "
                                      "(exit 0 ok, 1 problems found, 2 unreadable)")
    v.add_argument("path", help="checkpoint directory or s3://bucket/prefix")
    d = sub.add_parser("demo", help="write a ~256 MB checkpoint and load it on 4 local gloo ranks")
    d.add_argument("--keep", metavar="DIR", help="write the checkpoint into DIR and keep it")
    d.add_argument("--batch-bytes", type=int, help="broadcast_batch_bytes for the broadcast mode")
    d.add_argument("--modes", help="the modes to run, in this order (default broadcast,every-rank,auto)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            code = inspect(args.path, chunks=args.chunks, allow_pickle=args.allow_pickle, rank=args.rank)
        elif args.command == "verify":
            code = verify(args.path, clock=waited)
        elif args.command == "convert":
            from ._convert import run as convert_run

            code = convert_run(args)
        elif args.command == "plan":
            from ._plan import run as plan_run

            code = plan_run(args)
        else:
            from ..demo import main as demo_main

            extra = ["--keep", args.keep] if args.keep else []
            if args.batch_bytes is not None:
                extra += ["--batch-bytes", str(args.batch_bytes)]
            if args.modes is not None:
                extra += ["--modes", args.modes]
            code = demo_main(extra)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
    except BrokenPipeError:
        # The reader went away (`dcp inspect ... | head`): stop quietly, as Unix tools do.
        # stdout is pointed at /dev/null so that the interpreter's final flush cannot
        # raise again; 141 is what a shell reports for a command ended by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


if __name__ == "__main__":
    sys.exit(main())
