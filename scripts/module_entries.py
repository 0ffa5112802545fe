"""How often one training step enters each judgeloop module, followed from ``judgeloop train``.

    .venv/bin/python scripts/module_entries.py [--step 2] [overrides ...]

Runs the tiny config (``configs/feedback_loop/tiny.yaml``, evaluation and a refit due at ``--step``) through
the recipe ``judgeloop train`` runs, with a profile hook on every Python call. A call *enters* a module when
the caller's frame is in another module (the recipe counts as its own module); calls inside a module
(its helpers calling each other) do not count. For the chosen step it prints, per judgeloop module, the
distinct functions entered from outside and the number of entries, most first: the first column is the
fan-in figure of the layout reviews (issue 26 counted it for loop/runner.py, since split into steps.py,
state.py, setup.py and run.py), counted the same way for each module (docs/layout.md).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "feedback_loop.py")


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if frame.f_code.co_filename == RECIPE:
        return "recipes/feedback_loop.py"
    return name if name.startswith("judgeloop") else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--names", action="store_true", help="list the functions entered")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import tempfile

    from judgeloop.config import load_config
    from judgeloop.loop.config import FeedbackLoopConfig
    from judgeloop.recipes import train

    functions: dict[str, set[str]] = defaultdict(set)
    entries: dict[str, int] = defaultdict(int)
    step = {"n": 0}

    def hook(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        if callee == "judgeloop.loop.state" and frame.f_code.co_name == "next_batch":
            step["n"] += 1  # the recipe's first call of a step
        caller = _module(frame.f_back) if frame.f_back is not None else None
        if step["n"] != args.step or caller is None or caller == callee:
            return
        functions[callee].add(frame.f_code.co_qualname)
        entries[callee] += 1

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            FeedbackLoopConfig,
            ROOT / "configs" / "feedback_loop" / "tiny.yaml",
            [
                f"output_dir={out}",
                "max_steps=3",
                "eval_every_n_steps=2",
                "calibration.recalibrate_every_n_steps=2",
                "progress_bar=false",
                "log_with=[jsonl]",
                "threads=1",
                *args.overrides,
            ],
        )
        sys.setprofile(hook)
        try:
            train(cfg)
        finally:
            sys.setprofile(None)
    print(f"step {args.step}: distinct functions entered from outside each module, and entries")
    for mod in sorted(functions, key=lambda m: -len(functions[m])):
        print(f"  {len(functions[mod]):3d} functions {entries[mod]:6d} entries  {mod}")
        if args.names:
            print("        " + ", ".join(sorted(functions[mod])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
