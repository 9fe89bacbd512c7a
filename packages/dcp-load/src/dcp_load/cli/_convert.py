"""``dcp convert SRC DST --to hf|native|torch-dcp ...``: the command line of ``convert``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    c = sub.add_parser("convert", help="convert a checkpoint into Hugging Face safetensors shards, the native "
                       "format or torch.distributed.checkpoint's own format, streamed at a fixed memory bound",
                       description="Convert SRC (any format dcp reads) into DST. Output files are preallocated "
                       "and filled in place; DST appears only once the conversion is complete.")
    c.add_argument("src", help="source checkpoint: a directory or s3://bucket/prefix")
    c.add_argument("dst", help="destination: a local directory (must not exist or be empty, unless --overwrite; "
                   "s3:// is refused: convert locally, then upload)")
    c.add_argument("--to", choices=("hf", "native", "torch-dcp"), required=True,
                   help="hf: model-0000i-of-0000N.safetensors + model.safetensors.index.json; native: dcp's format "
                   "with block checksums and values; torch-dcp: torch.distributed.checkpoint's format (__*.distcp + "
                   ".metadata), which torch's dcp.load and dcp_to_torch_save read, with values and block checksums")
    c.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest output file, e.g. 5GB (default), 500MB, 2GiB")
    c.add_argument("--dtype", default=None, metavar="NAME",
                   help="cast floating tensors to NAME (bfloat16/bf16, float16/fp16, float32/fp32, ...); "
                   "integer and bool tensors are never cast")
    c.add_argument("--prefix", action="append", default=None, metavar="OLD[=NEW]",
                   help="convert only the names starting with OLD, with OLD replaced by NEW (default: removed), "
                   "e.g. --prefix model. for a training checkpoint saved as {'model': ..., 'optim': ...}; "
                   "repeat for several; --sources and --keys then see the new names")
    c.add_argument("--keys", nargs="+", default=None, metavar="GLOB", help="only these names or glob patterns")
    c.add_argument("--sources", default=None, metavar="FILE",
                   help="a JSON or Python file with the sources= mapping of load (renames, concat, stack, slice)")
    c.add_argument("--config", default=None, metavar="FILE",
                   help="a model config (JSON) written into DST as config.json (--to hf); transformers' Auto "
                   "classes need it")
    c.add_argument("--workers", type=int, default=1, metavar="N", help="processes splitting the output files")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty DST once the new one is complete")
    c.add_argument("--quiet", action="store_true", help="no progress bar or per-file lines; only errors")


def _prefix(values: list[str] | None) -> dict[str, str] | None:
    """``--prefix OLD[=NEW]`` (repeated) as {OLD: NEW}."""
    if not values:
        return None
    out = {}
    for v in values:
        old, _, new = v.partition("=")
        if old in out:
            raise ValueError(f"--prefix {old!r} is given twice")
        out[old] = new
    return out


def run(args: argparse.Namespace) -> int:
    from dcp_reader import CheckpointError

    from .._errors import LoadError
    from ..conversion._convert import convert

    log = logging.getLogger("dcp_load.conversion._convert")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        report = convert(args.src, args.dst, to=args.to, max_shard_bytes=args.max_shard_size, dtype=args.dtype,
                         keys=args.keys, sources=args.sources, prefix=_prefix(args.prefix), config=args.config,
                         workers=args.workers, overwrite=args.overwrite, quiet=args.quiet)
    except (CheckpointError, LoadError, OSError, ValueError, TypeError, RuntimeError) as exc:
        # one line: a multi-line message (several mapping problems) is joined
        text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"dcp convert: {type(exc).__name__}: {text}", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(handler)
    if not args.quiet:
        print(f"{report.dst}: {report.format}, {report.tensors} tensors in {len(report.files)} file(s), "
              f"{report.bytes_written} bytes written, {report.bytes_read} read, {report.seconds:.2f} s, "
              f"{len(report.skipped)} skipped")
    return 0
