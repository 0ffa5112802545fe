"""The launch lines the docs give (a command in a fenced bash block, with its ``\\`` continuations), read
back as argument lists, so the tests run the lines exactly as documented."""

from __future__ import annotations

import shlex
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def launch_lines(page: str, command: str) -> list[list[str]]:
    """Every documented invocation of ``command`` (e.g. ``python -m verl.trainer.main_ppo``) on
    ``docs/<page>``: the arguments after the command and its ``...`` (the user's own settings)."""
    lines = (DOCS / page).read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if not line.startswith(command):
            continue
        text = line
        while text.endswith("\\"):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        args = shlex.split(text[len(command) :])
        found.append([a for a in args if a != "..."])
    assert found, f"docs/{page} gives no launch line of {command!r}"
    return found
