"""Every ```python block of the README and docs/integrations.md runs as written.

Each block is extracted from the Markdown and executed in a temporary working directory that holds
what the docs say the user has at that point: ``runs/cal/calibrated_judge/`` written by the README's own
``judgeloop calibrate --config configs/calibrate/embedded_embedding.yaml output_dir=runs/cal``, with the
tiny encoder in place of MiniLM (``judge.model=judgeloop-tiny/encoder`` and a smaller corpus: the only
overrides; the snippet's code is never changed). Test ids name the file and the line of the block.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/integrations.md", "docs/served.md", "docs/serving.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = (REPO / doc).read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{doc}:{line}", m.group(1)))
    return out


SNIPPETS = snippets()


def test_the_docs_have_python_snippets():
    names = {name.split(":")[0] for name, _ in SNIPPETS}
    assert {"README.md", "docs/integrations.md"} <= names


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory with ``runs/cal`` from the README's calibrate command (tiny encoder)."""
    from judgeloop.cli import main

    work = tmp_path_factory.mktemp("docs")
    (work / "configs").symlink_to(REPO / "configs")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        rc = main(
            [
                "calibrate",
                "--config",
                "configs/calibrate/embedded_embedding.yaml",
                "output_dir=runs/cal",
                "judge.model=judgeloop-tiny/encoder",
                "data.embedded_size=120",
                "max_pairs_per_article=6",
            ]
        )
    finally:
        os.chdir(cwd)
    assert rc == 0
    assert (work / "runs/cal/calibrated_judge/platt/judge.yaml").is_file()
    return work


@pytest.mark.parametrize("name,code", SNIPPETS, ids=[n for n, _ in SNIPPETS])
def test_snippet_runs(name, code, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    exec(compile(code, name, "exec"), {"__name__": "__main__"})
