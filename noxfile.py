"""Sessions for the dcp monorepo: tests per backend, lint, the demo and the benchmarks.

Packages are built into wheels and the tests run against the installed wheels, so a file
missing from a package fails here. Environments are kept between runs (uv makes the
installs take seconds once its cache is warm).
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["dcp-platform", "dcp-reader", "dcp-broadcast", "dcp-load"]
PYTHON = "3.11"

# torch is pinned everywhere it is installed: an unpinned torch resolves to a multi-GB CUDA
# build. Find-links folders come from the standard variables, UV_FIND_LINKS (uv's own,
# comma-separated) and PIP_FIND_LINKS (pip's, space-separated; uv ignores pip's settings, so
# they are passed on to it). Where one of them holds the CPU build of the pinned torch, that
# build is asked for by its local version.
TORCH_VERSION = "2.13.0"


def _find_links() -> list[str]:
    """Find-links locations from $UV_FIND_LINKS and $PIP_FIND_LINKS, in that order, once each."""
    found: list[str] = []
    for var, sep in (("UV_FIND_LINKS", ","), ("PIP_FIND_LINKS", None)):
        for link in os.environ.get(var, "").split(sep):
            if link.strip() and link.strip() not in found:
                found.append(link.strip())
    return found


def _torch_requirements(links: list[str]) -> list[str]:
    """uv arguments that install exactly torch==TORCH_VERSION, the +cpu build when a folder has it."""
    folders = [pathlib.Path(link.removeprefix("file://")) for link in links if "://" not in link
               or link.startswith("file://")]
    cpu = any(sorted(f.glob(f"torch-{TORCH_VERSION}+cpu-*.whl")) for f in folders if f.is_dir())
    return [f"torch=={TORCH_VERSION}+cpu" if cpu else f"torch=={TORCH_VERSION}"]


FIND_LINKS = [f"--find-links={link}" for link in _find_links()]
TORCH = [*FIND_LINKS, *_torch_requirements(_find_links())]
MINDSPORE = ["mindspore==2.10.0", "numpy<2"]  # MindSpore 2.10 fails to import with numpy 2
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "safetensors>=0.4.3", "matplotlib>=3.8",  # matplotlib: dcp plan --png
             "moto[server]>=5", "obstore>=0.6",  # the S3 tests: a loopback S3 server, the object client
             "zstandard>=0.19"]  # torch's ZStandard extension (dcp-reader[zstd]), read and written

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-torch", "tests-ascend", "tests-mindspore", "tests-torchtitan",
                        "tests-frameworks",
                        "packages-alone", "docs"]


#: What each package needs of its siblings (its declared dependencies, transitively).
SIBLINGS = {
    "dcp-platform": [],
    "dcp-reader": [],
    "dcp-broadcast": ["dcp-platform"],
    "dcp-load": ["dcp-platform", "dcp-reader", "dcp-broadcast"],
}


def _build_wheels(session: nox.Session, packages: list[str] = PACKAGES) -> list[str]:
    """Build the packages' wheels (default: all) into the session's temporary folder."""
    out = pathlib.Path(session.create_tmp()).resolve() / "wheels"
    for old in out.glob("*.whl"):
        old.unlink()
    for pkg in packages:
        session.run("uv", "build", "--quiet", "--wheel", "--out-dir", str(out),
                    str(ROOT / "packages" / pkg), external=True)
    wheels = sorted(glob.glob(str(out / "*.whl")))
    if len(wheels) != len(packages):
        session.error(f"expected {len(packages)} wheels in {out}, found {wheels}")
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
    _pytest(session, "not mindspore and not ascend and not cuda and not torchtitan and not frameworks")


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


@nox.session(name="tests-torchtitan", python=PYTHON)
def tests_torchtitan(session: nox.Session) -> None:
    """torchtitan's checkpoint manager with dcp_load.torch_compat swapped in, on gloo ranks."""
    _install(session, *TEST_DEPS, "torchtitan==0.3.0")
    _pytest(session, "torchtitan")


@nox.session(name="tests-frameworks", python=PYTHON)
def tests_frameworks(session: nox.Session) -> None:
    """Accelerate and Lightning Fabric FSDP2 checkpoints with dcp_load.torch_compat swapped in, on gloo ranks."""
    # Versions checked together with the pinned torch (TORCH).
    _install(session, *TEST_DEPS, "accelerate==1.16.0", "lightning==2.6.6")
    _pytest(session, "frameworks")


@nox.session(name="tests-cuda", python=PYTHON)
def tests_cuda(session: nox.Session) -> None:
    """CUDA/NCCL tests; needs a machine with NVIDIA GPUs."""
    if not os.path.exists("/dev/nvidiactl"):
        session.skip("no NVIDIA GPU on this machine (/dev/nvidiactl is missing)")
    session.install(*[f"--reinstall-package={p}" for p in PACKAGES], *_build_wheels(session),
                    f"torch=={TORCH_VERSION}", *TEST_DEPS)
    _pytest(session, "cuda")


def _wheel_of(wheels: list[str], package: str) -> str:
    prefix = package.replace("-", "_") + "-"
    [wheel] = [w for w in wheels if pathlib.Path(w).name.startswith(prefix)]
    return wheel


def _check_wheel_metadata(session: nox.Session, wheel: str) -> None:
    """The fields a package index shows: Requires-Python, license file, classifiers, URLs."""
    import email.parser
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
        licenses = [n for n in zf.namelist() if ".dist-info/licenses/" in n]
    problems = [f for f in ("Requires-Python", "License-Expression", "Classifier", "Project-URL")
                if not meta.get_all(f)]
    if not licenses:
        problems.append("no license file under .dist-info/licenses/")
    if any("../" in line for line in meta.get_payload().splitlines() if "](" in line):
        problems.append("a ../ link in the README")
    if problems:
        session.error(f"{pathlib.Path(wheel).name}: missing or wrong metadata: {problems}")


@nox.session(name="packages-alone", python=PYTHON, reuse_venv=False)
@nox.parametrize("package", PACKAGES)
def packages_alone(session: nox.Session, package: str) -> None:
    """One package with its torch extra in a fresh environment; its README's examples run."""
    wheels = _build_wheels(session, [package, *SIBLINGS[package]])
    siblings = [_wheel_of(wheels, p) for p in SIBLINGS[package]]
    me = _wheel_of(wheels, package)
    _check_wheel_metadata(session, me)
    readmes = [str(ROOT / "packages" / package / "README.md")]
    if package == "dcp-load":
        readmes.append(str(ROOT / "README.md"))  # its Python blocks, where it has any
    runner = str(ROOT / "tests-integration" / "docs_blocks.py")  # standard library only
    if package == "dcp-reader":
        # Its base install holds numpy only: the package must import without torch.
        session.install(me)
        session.run("python", "-c", "import sys, dcp_reader; assert 'torch' not in sys.modules, "
                    "'dcp_reader imported torch'")
    # dcp-load's README examples make a Hugging Face checkpoint to load, as save_pretrained
    # would: with safetensors, which the examples need and the package does not.
    examples = ["safetensors>=0.4.3"] if package == "dcp-load" else []
    session.install(f"{package}[torch] @ {pathlib.Path(me).as_uri()}", *siblings, *TORCH, *examples)
    others = [p.replace("-", "_") for p in PACKAGES if p != package and p not in SIBLINGS[package]]
    session.run("python", "-c", f"import importlib.util as u; bad = [m for m in {others!r} if u.find_spec(m)]; "
                "assert not bad, f'not declared, yet installed: {bad}'")
    # Run from an empty folder so that nothing of the checkout shadows the installed wheels.
    with session.chdir(session.create_tmp()):
        session.run("python", runner, *readmes)
        if package == "dcp-broadcast":
            session.run("torchrun", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "packages" / package / "examples" / "push_parameters.py"))
        if package == "dcp-load":
            session.run("dcp", "--help", silent=True)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Static checks: ruff, and the house rules (no import circles, layers one way, one storage seam)."""
    session.install("ruff==0.17.5")
    session.run("ruff", "check", ".")
    session.run("python", str(ROOT / ".ci" / "check_house.py"))


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: write a checkpoint and load it on 4 local gloo ranks (DP2 x TP2)."""
    _install(session)
    session.run("python", "-m", "dcp_load.demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks side by side with torch.distributed.checkpoint (`-- s3`: from S3); JSON in bench-results/."""
    # fastsafetensors: the peer loader measured in the same run (benchmarks/harness/loaders.py).
    # bench_s3.py: a loopback S3 server, obstore, and the peers it is measured against
    # (torch DCP's FsspecReader over s3fs, Run:ai Model Streamer).
    _install(session, "safetensors>=0.4.3", "matplotlib>=3.8", "fastsafetensors>=0.5", "moto[server]>=5",
             "obstore>=0.6", "s3fs", "runai-model-streamer", "runai-model-streamer-s3")
    if session.posargs[:1] == ["s3"]:  # nox -s bench -- s3 [bench_s3.py options]
        session.run("python", str(ROOT / "benchmarks" / "storage" / "bench_s3.py"), *session.posargs[1:])
        return
    session.run("python", str(ROOT / "benchmarks" / "run_all.py"), *session.posargs)


#: The user guide's dependencies, every one pinned: `mkdocs build --strict` fails on any warning, so a
#: new release's new warning must arrive through a change here, not by itself.
DOCS_DEPS = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocs-material-extensions==1.3.1", "mkdocstrings==1.0.8",
             "mkdocstrings-python==2.0.11", "mkdocs-autorefs==1.4.5", "griffelib==2.4.1", "markdown==3.11.3",
             "pymdown-extensions==13.1.2", "pygments==2.21.0", "matplotlib==3.11.2",
             "ruff==0.17.5"]  # ruff: mkdocstrings formats the signatures with it


def _build_docs(session: nox.Session) -> pathlib.Path:
    """The plots from benchmarks/results/, then the site, strict; returns the site's folder."""
    session.install(*DOCS_DEPS)
    session.run("python", str(ROOT / "benchmarks" / "plot_results.py"))
    site = pathlib.Path(session.create_tmp()).resolve() / "site"
    session.run("mkdocs", "build", "--strict", "--clean", "--config-file", str(ROOT / "mkdocs.yml"),
                "--site-dir", str(site), env={"NO_MKDOCS_2_WARNING": "1"})
    return site


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The user guide under docs/: plots regenerated, `mkdocs build --strict` (a warning or broken link fails)."""
    _build_docs(session)


@nox.session(name="docs-browse", python=PYTHON)
def docs_browse(session: nox.Session) -> None:
    """The built guide in headless Chromium: every navigation page and image, screenshots in docs-browse/."""
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        session.skip("no Chromium here: install Debian's package with 'apt-get install -y chromium'")
    site = _build_docs(session)
    out = pathlib.Path(session.create_tmp()).resolve() / "docs-browse"
    session.run("python", str(ROOT / "docs" / "_tools" / "browse.py"), str(site), str(out))
