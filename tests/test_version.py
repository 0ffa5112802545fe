"""One version, in one place (src/judgeloop/version.py), that the packaging metadata, the package root and
the changelog follow."""

from __future__ import annotations

from pathlib import Path

import pytest

import judgeloop
from judgeloop.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_written_once_and_pyproject_reads_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "judgeloop.version.__version__"
    assert judgeloop.__version__ is __version__
    assert __version__.count(".") == 2 and all(part.isdigit() for part in __version__.split("."))


def test_the_changelog_has_a_section_for_this_version_under_unreleased():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.index("## [Unreleased]") < text.index(f"## [{__version__}]"), (
        f"CHANGELOG.md has no '## [{__version__}]' section below '## [Unreleased]'; a release moves the "
        "Unreleased entries under its version"
    )
