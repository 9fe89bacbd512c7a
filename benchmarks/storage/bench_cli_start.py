"""How long the ``dcp`` command makes its user wait (not a test): the median wall time of
``dcp --version``, ``dcp inspect`` and ``dcp verify`` on small native and Hugging Face
checkpoints, each run as its own process, beside the interpreter's bare start
(``python -c pass``) and, with ``--torch``, ``python -c "import torch"`` (what every command
paid while ``dcp_load`` imported torch at its top).

Each command runs once untimed (it writes its bytecode), then ``--repeats`` times, the commands
interleaved; the table gives the median wall time and the least CPU time (user + system) of
the runs. By default the children cache their bytecode in a temporary folder, as an
installed package does (pip compiles it); ``--no-bytecode`` compiles every module at every
start instead (``PYTHONDONTWRITEBYTECODE=1`` without a cache, as in some development
environments).

    .venv/bin/python benchmarks/storage/bench_cli_start.py [--repeats 5] [--torch] [--no-bytecode]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def _checkpoints(root: Path) -> dict[str, str]:
    """A small native checkpoint (2 tensors with checksums, 2 values) and a one-file Hugging
    Face checkpoint (20 tensors of 16 KiB)."""
    import dcp_load
    import torch
    from safetensors.torch import save_file

    native, hf = root / "native", root / "hf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load.save({"a": torch.randn(300, 1024), "b": torch.arange(10), "step": 3, "cfg": {"lr": 0.1}},
                      checkpoint_id=native, no_dist=True)
    hf.mkdir()
    save_file({f"w{i}": torch.randn(64, 64) for i in range(20)}, str(hf / "model.safetensors"))
    return {"native": str(native), "hf": str(hf)}


def _dcp() -> list[str]:
    """The ``dcp`` console script beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("dcp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dcp_load.cli._main"]


def _commands(ck: dict[str, str], with_torch: bool) -> dict[str, list[str]]:
    dcp = _dcp()
    out = {"python -c pass": [sys.executable, "-c", "pass"], "dcp --version": [*dcp, "--version"]}
    for kind, path in ck.items():
        out[f"dcp inspect ({kind})"] = [*dcp, "inspect", path]
        out[f"dcp verify ({kind})"] = [*dcp, "verify", path]
    if with_torch:
        out["python -c 'import torch'"] = [sys.executable, "-c", "import torch"]
    return out


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``argv``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {err[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime


def _env(cache: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if cache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = cache
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each command (default 5)")
    ap.add_argument("--torch", action="store_true", help="also time python -c 'import torch'")
    ap.add_argument("--no-bytecode", action="store_true", help="compile every module at every start")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        env = _env(None if args.no_bytecode else str(root / "pycache"))
        commands = _commands(_checkpoints(root), args.torch)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for cmd in commands.values():
            _run(cmd, env)  # untimed: writes the bytecode, warms the page cache
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                times[name].append(_run(cmd, env))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"bench_cli_start: median wall and least CPU of {args.repeats} runs, "
          f"{'no bytecode cache' if args.no_bytecode else 'bytecode cached'}, load average {load:.2f}, "
          f"{os.cpu_count()} CPUs")
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        print(f"  {name:28s} wall {wall:6.3f} s   CPU {min(c for _, c in runs):6.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
