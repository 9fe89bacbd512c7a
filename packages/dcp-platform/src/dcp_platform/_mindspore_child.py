"""Child side of ``dcp_platform.testing.run_mindspore_workers`` (run as ``python -m``).

``python -m dcp_platform._mindspore_child sched JOB_DIR`` runs the MindSpore scheduler;
``python -m dcp_platform._mindspore_child worker JOB_DIR RANK`` initialises MindSpore
communication on the CPU, calls the job's function and writes ``result-RANK.pkl`` (written
to a temporary name, then renamed, so the parent never reads half a file). The cluster
variables (``MS_ROLE``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_WORKER_NUM``,
``MS_NODE_ID``) come from the parent. A worker that succeeded waits for the parent's
``release`` file before exiting (see ``_wait_for_release``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
import time
import traceback
from typing import Any


def _resolve(module_name: str, qualname: str, file: str | None) -> Any:
    """Import the job's function; fall back to the file for test modules that pytest
    imported under a name this interpreter cannot import (``--import-mode=importlib``)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if not file:
            raise
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {module_name!r} from {file!r}") from None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _write_result(job_dir: str, rank: int, ok: bool, payload: Any) -> None:
    path = os.path.join(job_dir, f"result-{rank}.pkl")
    try:
        data = pickle.dumps((ok, payload))
    except Exception:  # an unpicklable result is reported as this rank's failure
        data = pickle.dumps((False, "the function's result could not be pickled:\n" + traceback.format_exc()))
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _wait_for_release(job_dir: str) -> None:
    """Stay alive until the parent has every rank's result (or kills us).

    A MindSpore CPU broadcast can still be completing on its source after the receivers
    have their data; a receiver that exits then makes the source's broadcast fail
    ("CollectiveWait N failed"). So no worker exits before every worker has reported.
    """
    release = os.path.join(job_dir, "release")
    while not os.path.exists(release):
        time.sleep(0.05)


def _worker(job_dir: str, rank: int) -> int:
    try:
        with open(os.path.join(job_dir, "job.pkl"), "rb") as f:
            job = pickle.load(f)
        import mindspore
        from mindspore.communication import init

        mindspore.set_device("CPU")
        init()
        fn = _resolve(job["module"], job["qualname"], job["file"])
        out = fn(rank, job["world_size"], *job["args"])
    except BaseException:  # report every failure, SystemExit included, to the parent
        # The traceback goes to the parent in the result file; the exit code says it failed.
        _write_result(job_dir, rank, False, traceback.format_exc())
        return 1
    _write_result(job_dir, rank, True, out)
    _wait_for_release(job_dir)
    return 0


def _scheduler() -> None:
    import mindspore
    from mindspore.communication import init

    mindspore.set_device("CPU")
    # With MS_ROLE=MS_SCHED, init() serves the cluster until every worker has finished.
    init()


def main(argv: list[str]) -> int:
    role, job_dir = argv[0], argv[1]
    if role == "sched":
        _scheduler()
        return 0
    if role == "worker":
        return _worker(job_dir, int(argv[2]))
    raise SystemExit(f"unknown role {role!r}; expected 'sched' or 'worker'")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
