"""The package as it is installed: a wheel built from this checkout (by setuptools, as pip
builds it) carries the licence text and complete metadata with absolute project links."""

from __future__ import annotations

import email.parser
import email.policy
import shutil
import subprocess
import sys
import zipfile
from email.message import Message
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
LICENSE = ROOT / "LICENSE"
REPOSITORY = "https://github.com/peer-elastic/peer-elastic"
#: What the wheel is built from: the files pyproject.toml names, and the package.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "peer_elastic")


def test_license_is_the_apache_2_0_text() -> None:
    text = LICENSE.read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert len(text.split()) > 1500  # the whole text, not a notice


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """A wheel of a copy of the checkout (a build in place would leave build/ behind)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("peer_elastic-*.whl")
    return zipfile.ZipFile(built)


def metadata(wheel: zipfile.ZipFile) -> Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser(policy=email.policy.compat32).parsestr(
        wheel.read(name).decode())


def test_wheel_carries_the_license(wheel: zipfile.ZipFile) -> None:
    meta = metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(name).decode() == LICENSE.read_text()


def test_wheel_project_urls_are_absolute_links_to_the_repository(
        wheel: zipfile.ZipFile) -> None:
    urls = dict(v.split(", ", 1) for v in metadata(wheel).get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    for label, url in urls.items():
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.netloc == "github.com", (label, url)
        assert url == REPOSITORY or url.startswith(REPOSITORY + "/"), (label, url)
    # The documents they point at exist in this checkout.
    assert (ROOT / "CHANGELOG.md").is_file() and (ROOT / "docs").is_dir()
    assert urls["Changelog"].endswith("/CHANGELOG.md")
    assert urls["Documentation"].endswith("/docs")


def test_wheel_classifiers_and_keywords(wheel: zipfile.ZipFile) -> None:
    meta = metadata(wheel)
    classifiers = set(meta.get_all("Classifier"))
    versions = {c.rsplit(" :: ", 1)[1] for c in classifiers
                if c.startswith("Programming Language :: Python :: 3.")}
    assert versions == {"3.10", "3.11", "3.12", "3.13"}
    assert meta["Requires-Python"] == ">=3.10"
    assert {
        "Development Status :: 4 - Beta",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    } <= classifiers
    # The licence is the SPDX expression; a licence classifier beside it is refused.
    assert not any(c.startswith("License ::") for c in classifiers)
    keywords = meta["Keywords"].split(",")
    assert {"pytorch", "etcd"} <= set(keywords)
    assert meta["Author"] or meta["Author-email"]
