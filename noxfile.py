"""Sessions for the dcp monorepo: tests per backend, lint, the demo and the benchmarks.

Packages are built into wheels and the tests run against the installed wheels, so a file
missing from a package fails here. Environments are kept between runs (uv makes the
installs take seconds once its cache is warm).
"""

from __future__ import annotations

import glob
import os
import pathlib

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["dcp-platform", "dcp-reader", "dcp-broadcast", "dcp-load"]
PYTHON = "3.11"

# torch is pinned everywhere it is installed: an unpinned torch resolves to a multi-GB CUDA
# build. Where the machine keeps the CPU wheel in a find-links folder, uv is pointed at it
# (uv ignores pip's configuration).
TORCH_VERSION = "2.13.0"
_LOCAL_WHEELS = pathlib.Path("/opt/wheels")
_LOCAL_TORCH = sorted(_LOCAL_WHEELS.glob(f"torch-{TORCH_VERSION}+cpu-*.whl")) if _LOCAL_WHEELS.is_dir() else []
TORCH = [f"--find-links={_LOCAL_WHEELS}", f"torch=={TORCH_VERSION}+cpu"] if _LOCAL_TORCH else [f"torch=={TORCH_VERSION}"]
MINDSPORE = ["mindspore==2.10.0", "numpy<2"]  # MindSpore 2.10 fails to import with numpy 2
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "safetensors>=0.4.3"]

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-torch", "tests-ascend", "tests-mindspore"]


def _build_wheels(session: nox.Session) -> list[str]:
    """Build every package's wheel into the session's temporary folder."""
    out = pathlib.Path(session.create_tmp()) / "wheels"
    for old in out.glob("*.whl"):
        old.unlink()
    for pkg in PACKAGES:
        session.run("uv", "build", "--quiet", "--wheel", "--out-dir", str(out),
                    str(ROOT / "packages" / pkg), external=True)
    wheels = sorted(glob.glob(str(out / "*.whl")))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels in {out}, found {wheels}")
    return wheels


def _install(session: nox.Session, *extra: str) -> None:
    wheels = _build_wheels(session)
    session.install(*[f"--reinstall-package={p}" for p in PACKAGES], *wheels, *TORCH, *extra)


def _pytest(session: nox.Session, marker: str) -> None:
    tests = [str(p) for p in sorted((ROOT / "packages").glob("*/tests"))]
    tests.append(str(ROOT / "tests-integration"))
    # pytest exits 5 when nothing was collected; nox treats that as a failure, on purpose.
    session.run("pytest", "-m", marker, *tests, *session.posargs)


@nox.session(name="tests-torch", python=PYTHON)
def tests_torch(session: nox.Session) -> None:
    """Unit and multi-rank tests on torch CPU with real gloo ranks."""
    _install(session, *TEST_DEPS)
    _pytest(session, "not mindspore and not ascend and not cuda")


@nox.session(name="tests-ascend", python=PYTHON)
def tests_ascend(session: nox.Session) -> None:
    """Ascend backend tests against a fake torch_npu module (no Ascend device here)."""
    _install(session, *TEST_DEPS)
    _pytest(session, "ascend")


@nox.session(name="tests-mindspore", python=PYTHON)
def tests_mindspore(session: nox.Session) -> None:
    """MindSpore backend tests with real multi-process MindSpore workers on CPU."""
    _install(session, *TEST_DEPS, *MINDSPORE)
    _pytest(session, "mindspore")


@nox.session(name="tests-cuda", python=PYTHON)
def tests_cuda(session: nox.Session) -> None:
    """CUDA/NCCL tests; needs a machine with NVIDIA GPUs."""
    if not os.path.exists("/dev/nvidiactl"):
        session.skip("no NVIDIA GPU on this machine (/dev/nvidiactl is missing)")
    session.install(*[f"--reinstall-package={p}" for p in PACKAGES], *_build_wheels(session),
                    f"torch=={TORCH_VERSION}", *TEST_DEPS)
    _pytest(session, "cuda")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Static checks with ruff."""
    session.install("ruff==0.17.5")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: write a checkpoint and load it on 4 local gloo ranks (DP2 x TP2)."""
    _install(session)
    session.run("python", "-m", "dcp_load.demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with torch.distributed.checkpoint; JSON in bench-results/."""
    # fastsafetensors: the peer loader measured in the same run (benchmarks/_bench_loaders.py).
    _install(session, "safetensors>=0.4.3", "matplotlib>=3.8", "fastsafetensors>=0.5")
    session.run("python", str(ROOT / "benchmarks" / "run_all.py"), *session.posargs)
