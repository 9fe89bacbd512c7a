"""Run a function on N real local ranks, for tests and demos.

torch: ``run_ranks`` (torch.distributed over gloo). MindSpore: ``run_mindspore_workers``
(a MindSpore scheduler process plus N CPU workers, see its docstring).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group in each through a ``file://`` store with an explicit timeout, calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. ``fn`` and
its arguments must be picklable (a module-level function). A failure on any rank raises
``RanksFailed`` with every failing rank's traceback; a rank that neither returns nor fails
within ``timeout`` is killed and reported, so a test never hangs.

Processes come from a forkserver that has torch imported already (spawning each child and
importing torch costs ~1 s per rank here; forking from the server costs a few ms).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .fake_accelerator import FakeAccelerator

__all__ = ["FakeAccelerator", "RankDied", "RanksFailed", "add_preload", "run_mindspore_workers", "run_ranks"]

_CTX: Any = None

#: Imported once in the forkserver, so every rank forked from it starts with them done.
#: DTensor's first use imports torch._dynamo, measured at ~10 s per rank here when each
#: rank imported it itself; torch.distributed.checkpoint is what compatibility tests load.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "torch.distributed.checkpoint")


class RanksFailed(RuntimeError):
    """One or more ranks raised, exited or timed out; ``failures`` maps rank to cause."""

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        lines = [f"{len(failures)} rank(s) failed:"]
        for rank, cause in self.failures.items():
            lines.append(f"--- rank {rank} ---\n{cause.rstrip()}")
        super().__init__("\n".join(lines))


class RankDied:
    """In ``run_ranks(..., may_die=...)`` results: that rank exited without reporting."""

    def __init__(self, rank: int, exitcode: int | None):
        self.rank, self.exitcode = rank, exitcode

    def __repr__(self) -> str:
        return f"RankDied(rank={self.rank}, exitcode={self.exitcode})"


def _context() -> Any:
    global _CTX  # the forkserver is per process by nature; this only memoises the context
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_preload))
        _CTX = ctx
    return _CTX


_preload = list(PRELOAD)


def add_preload(*modules: str) -> None:
    """Import ``modules`` once in the forkserver too, so ranks start with them imported.

    Call it before the first ``run_ranks`` of the process: the forkserver starts then and
    keeps the imports it started with.
    """
    _preload.extend(m for m in modules if m not in _preload)
    if _CTX is not None:
        _CTX.set_forkserver_preload(list(_preload))


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_file: str, backend: str,
           pg_timeout_s: float, env: dict[str, str], threads: int, args: tuple[Any, ...],
           results: Any, report_first: bool = False) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
            if report_first:  # a dead peer can block the teardown: report before it
                results.put((rank, True, out))
        finally:
            dist.destroy_process_group()
        if not report_first:
            results.put((rank, True, out))
    except BaseException:  # report every failure, SystemExit included, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, pg_timeout: float | None = None,
              env: dict[str, str] | None = None, threads: int = 1,
              may_die: tuple[int, ...] = ()) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``threads``: torch intra-op threads per rank (1: ranks do not oversubscribe the cores).
    ``may_die``: ranks that may exit without reporting (a test killing one on purpose):
    their result is a ``RankDied``, and every rank reports its result before tearing its
    process group down, since a dead peer can block the teardown.

    ``timeout`` bounds the whole run; ``pg_timeout`` (default: ``timeout``) is the process
    group timeout, so a collective that never completes fails inside the ranks too.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dcp-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, init_file, backend, pg_timeout or timeout,
                      dict(env or {}), threads, args, results, bool(may_die)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            outcome = _collect(results, procs, deadline)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
    for r in may_die:
        if r in outcome and not outcome[r][0] and str(outcome[r][1]).startswith("exited with code"):
            outcome[r] = (True, RankDied(r, procs[r].exitcode))
    failures = {r: str(v) for r, (ok, v) in outcome.items() if not ok}
    for r in range(world_size):
        if r not in outcome:
            failures[r] = f"no result within {timeout:.0f} s (killed)"
    if failures:
        raise RanksFailed(failures)
    return [outcome[r][1] for r in range(world_size)]


def _collect(results: Any, procs: list[Any], deadline: float) -> dict[int, tuple[bool, Any]]:
    """Each rank's (ok, payload) from the queue until all reported or ``deadline``; a rank
    that died without reporting (segfault, kill) is recorded as such, never waited for."""
    outcome: dict[int, tuple[bool, Any]] = {}
    while len(outcome) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
            if not dead:
                continue
            try:  # give its report a moment to arrive through the queue's pipe
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                for r in dead:
                    outcome[r] = (False, f"exited with code {procs[r].exitcode} without reporting")
                continue
        outcome[rank] = (ok, payload)
    return outcome


# -- MindSpore ------------------------------------------------------------------------------

# A MindSpore launch costs 20-30 s here (dcp-platform README, "Measured facts": mostly importing
# mindspore in 3 processes on 2 cores), so failing ranks are not waited on for long: once one rank has failed, the
# others get this long to report before they are killed (they are usually blocked in a
# collective that will never complete).
_MS_FAIL_GRACE_S = 10.0
# After every worker has reported, processes still finalising get this long to exit.
_MS_EXIT_GRACE_S = 15.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(path: str, lines: int = 40) -> str:
    """The end of a child's log without MindSpore's INFO/WARNING chatter."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
    except OSError:
        return "(no log)"
    kept = [ln for ln in text if not ln.startswith(("[INFO]", "[WARNING]"))]
    return "\n".join(kept[-lines:]) or "(log is empty)"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # unkillable (D state); nothing more can be done
        pass


def run_mindspore_workers(fn: Callable[..., Any], world_size: int, *args: Any,
                          timeout: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` MindSpore CPU workers.

    Starts a MindSpore scheduler process and ``world_size`` worker processes wired together
    by ``MS_ROLE``/``MS_SCHED_HOST``/``MS_SCHED_PORT``/``MS_WORKER_NUM``/``MS_NODE_ID`` on
    a free local port. Each worker sets the CPU device, calls
    ``mindspore.communication.init()`` and then ``fn``. Returns the results in rank order.

    ``fn`` must be a module-level function (it is imported by name in the workers, from its
    file when its module is not importable there, e.g. a pytest module); ``args`` and the
    results must be picklable. A failure on any rank raises ``RanksFailed`` with each
    failing rank's traceback and the end of its log; ranks still running then are killed
    after a short grace, and everything is killed at ``timeout``, so a caller never hangs.
    Each launch costs 20-30 s on a 2-core machine: run many checks in one launch.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    job = _ms_job(fn, world_size, args)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="dcp-ms-") as job_dir:
        with open(os.path.join(job_dir, "job.pkl"), "wb") as f:
            pickle.dump(job, f)
        base_env = _ms_env(env, world_size)
        sched = _ms_start(job_dir, base_env, "sched", MS_ROLE="MS_SCHED")
        workers = [_ms_start(job_dir, base_env, "worker", str(r), MS_ROLE="MS_WORKER", MS_NODE_ID=str(r))
                   for r in range(world_size)]
        try:
            outcome, first_failure = _ms_collect(job_dir, workers, sched, deadline)
            # Workers that succeeded wait for this before exiting (see _mindspore_child).
            open(os.path.join(job_dir, "release"), "w").close()
            if len(outcome) == world_size and all(ok for ok, _ in outcome.values()):
                _ms_wait_exit([*workers, sched], min(deadline, time.monotonic() + _MS_EXIT_GRACE_S))
        finally:
            for proc, _ in [*workers, sched]:
                _kill_group(proc)
        for r in range(world_size):
            if r not in outcome:
                why = (f"no result within {timeout:.0f} s (killed)" if first_failure is None
                       else "killed: no result after another rank failed")
                outcome[r] = (False, f"{why}\n--- log ---\n{_log_tail(workers[r][1])}")
    failures = {r: str(v) for r, (ok, v) in outcome.items() if not ok}
    if failures:
        raise RanksFailed(failures)
    return [outcome[r][1] for r in range(world_size)]


def _ms_job(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...]) -> dict[str, Any]:
    """What each MindSpore worker imports and runs: ``fn`` by module and name, and its arguments."""
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module_name or "<" in qualname:
        raise ValueError(
            f"run_mindspore_workers: fn must be a module-level function, got {fn!r}; "
            "define it at the top level of a module"
        )
    module = sys.modules.get(module_name)
    return {"module": module_name, "qualname": qualname, "file": getattr(module, "__file__", None),
            "args": args, "world_size": world_size}


def _ms_env(env: dict[str, str] | None, world_size: int) -> dict[str, str]:
    """The environment of the scheduler and the workers: one free local port for the scheduler."""
    base_env = dict(os.environ)
    # MindSpore logs at INFO/WARNING to stderr by default; errors are enough here.
    base_env.setdefault("GLOG_v", "3")
    base_env.update(env or {})
    base_env.update({"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(_free_port()),
                     "MS_WORKER_NUM": str(world_size)})
    base_env.pop("MS_NODE_ID", None)
    return base_env


def _ms_start(job_dir: str, base_env: dict[str, str], role: str, *extra: str,
              **more_env: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start one MindSpore process (scheduler or worker) in its own session; (process, log path)."""
    log = os.path.join(job_dir, f"{role}{''.join(extra)}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dcp_platform._mindspore_child", role, job_dir, *extra],
            env={**base_env, **more_env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return proc, log


def _ms_collect(job_dir: str, workers: list[tuple[Any, str]], sched: tuple[Any, str],
                deadline: float) -> tuple[dict[int, tuple[bool, Any]], float | None]:
    """Poll the workers' result files until every rank reported, the deadline passed, a
    failure's grace ran out, or the scheduler died; (outcome per rank, first failure time)."""
    outcome: dict[int, tuple[bool, Any]] = {}
    first_failure: float | None = None
    world_size = len(workers)
    while len(outcome) < world_size:
        now = time.monotonic()
        if now >= deadline or (first_failure is not None and now >= first_failure + _MS_FAIL_GRACE_S):
            break
        for r, (proc, log) in enumerate(workers):
            if r not in outcome and _ms_outcome(job_dir, r, proc, log, outcome):
                if not outcome[r][0] and first_failure is None:
                    first_failure = time.monotonic()
        proc, sched_log = sched
        if proc.poll() is not None and proc.returncode != 0 and len(outcome) < world_size:
            # Without a scheduler the workers cannot finish init(): fail now.
            for r in range(world_size):
                outcome.setdefault(r, (False, f"the MindSpore scheduler exited with code "
                                              f"{proc.returncode}:\n{_log_tail(sched_log)}"))
            break
        time.sleep(0.2)
    return outcome, first_failure


def _ms_outcome(job_dir: str, r: int, proc: Any, log: str, outcome: dict[int, tuple[bool, Any]]) -> bool:
    """Record rank ``r``'s result (or its exit without one) in ``outcome``; whether it ended."""
    path = os.path.join(job_dir, f"result-{r}.pkl")
    exited = proc.poll() is not None
    if os.path.exists(path):
        with open(path, "rb") as f:
            ok, payload = pickle.load(f)
        outcome[r] = (ok, payload if ok else f"{payload}\n--- log ---\n{_log_tail(log)}")
    elif exited:
        outcome[r] = (False, f"exited with code {proc.returncode} without reporting\n"
                             f"--- log ---\n{_log_tail(log)}")
    else:
        return False
    return True


def _ms_wait_exit(procs: list[tuple[Any, str]], end: float) -> None:
    """Give processes that succeeded until ``end`` to exit on their own."""
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
