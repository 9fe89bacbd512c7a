"""Package metadata a package index shows: every pyproject declares Requires-Python, the
Apache-2.0 license with its file, classifiers and Project-URLs under the one repository
URL; package READMEs link only with absolute URLs (relative links break on the index); the
noxfile names no folder of one machine. (The built wheels' METADATA is checked by the
``packages-alone`` nox session.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
#: The one repository URL every package's metadata and README links use.
REPO_URL = "https://github.com/dcp-dev/dcp"
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def test_there_are_four_packages():
    assert PACKAGES == ["dcp-broadcast", "dcp-load", "dcp-platform", "dcp-reader"]


@pytest.mark.parametrize("package", PACKAGES)
def test_pyproject_metadata(package):
    folder = ROOT / "packages" / package
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.10"
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (folder / "LICENSE").read_text() and "Version 2.0" in (folder / "LICENSE").read_text()
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert any(c.startswith("Development Status ::") for c in project["classifiers"])
    urls = project["urls"]
    assert {"Homepage", "Source", "Changelog", "Issues"} <= urls.keys()
    assert all(u.startswith(REPO_URL) for u in urls.values()), urls
    assert urls["Source"] == f"{REPO_URL}/tree/main/packages/{package}"


@pytest.mark.parametrize("package", PACKAGES)
def test_readme_links_work_on_the_package_index(package):
    text = (ROOT / "packages" / package / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'(?:href|src)="([^"]+)"', text)
    relative = [t for t in targets if not re.match(r"(https?://|mailto:|#)", t)]
    assert relative == [], f"packages/{package}/README.md: use {REPO_URL}/blob/main/... instead of {relative}"
    repo_links = [t for t in targets if "github.com" in t]
    assert all(t.startswith(REPO_URL + "/") for t in repo_links), repo_links


def test_noxfile_names_no_folder_of_one_machine():
    source = (ROOT / "noxfile.py").read_text()
    assert not re.search(r"[\"'](/opt|/home|/root|/work|/tmp)/", source)
    assert "UV_FIND_LINKS" in source and "PIP_FIND_LINKS" in source
