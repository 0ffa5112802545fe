"""Compare the outputs of the same commands run from two checkouts: byte for byte, then value by value.

    python scripts/compare_runs.py BEFORE_DIR AFTER_DIR [--names metrics.jsonl report.json ...]

BEFORE_DIR and AFTER_DIR each hold the output folders of the same commands (e.g. ``dpo/``, ``grpo/``,
``calibrate/``, ``ablate/``), run with the same configs and overrides from the two checkouts. Every file
named by ``--names`` under BEFORE_DIR is paired with the file at the same relative path under AFTER_DIR
and reported as one of:

* ``bytes equal``: the two files are byte-identical;
* ``equal but for N ignored values``: they differ only in values that name a time, a path or a version
  (a key matching ``--ignore``, or a string holding the folder itself: each side's folder is read as
  ``<root>``);
* ``DIFFER``: the JSON values that differ, each by its place in the file (``[row 3].train/kl``) with its
  value before and after (the first ``--show`` of them).

A file on one side only is reported too. The exit status is 0 when no file differs, 1 otherwise. For
example, the tiny DPO run from a checkout of the earlier commit and from this one (each with its own
``PYTHONPATH=<checkout>/src OMP_NUM_THREADS=1``, so that both compute on one thread):

    judgeloop train --config configs/feedback_loop/tiny.yaml output_dir=/tmp/before/dpo   # earlier commit
    judgeloop train --config configs/feedback_loop/tiny.yaml output_dir=/tmp/after/dpo    # this one
    python scripts/compare_runs.py /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NAMES = ("metrics.jsonl", "report.json", "results.json", "per_article.jsonl", "predictions.jsonl")
# keys whose values are when or where a run ran, or with which version: not what it computed
IGNORE = (
    r"(^|[_/.])(time|timestamp|date|started|finished|elapsed|wall|duration|seconds|version|host|pid)s?$|_s$"
)


def _rows(path: Path) -> Any:
    """A JSON file's value, or a JSON-lines file's rows as a list."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def _leaves(value: Any, place: str = "") -> Iterator[tuple[str, Any]]:
    """``(place, value)`` of every leaf: ``[row 3].train/kl``, ``final.test.copy_rate``, ``curve[2]``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{place}.{key}" if place else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{place}[{i}]")
    else:
        yield place, value


def compare_file(
    before: Path, after: Path, ignore: re.Pattern[str]
) -> tuple[str, list[tuple[str, Any, Any]]]:
    """``(verdict, differences)`` of one pair of files (see the module docstring for the verdicts)."""
    if before.read_bytes() == after.read_bytes():
        return "bytes equal", []
    roots = {str(before.parents[i]) for i in range(len(before.parents))} | {
        str(after.parents[i]) for i in range(len(after.parents))
    }

    def norm(value: Any) -> Any:
        if isinstance(value, str):
            for root in sorted(roots, key=len, reverse=True):
                if len(root) > 1 and root in value:
                    value = value.replace(root, "<root>")
        return value

    a = dict(_leaves(_rows(before)))
    b = dict(_leaves(_rows(after)))
    diffs, ignored = [], 0
    for place in sorted(set(a) | set(b)):
        x, y = norm(a.get(place, "<absent>")), norm(b.get(place, "<absent>"))
        if x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y):  # NaN == NaN
            continue
        last = re.split(r"[.\]]", place.rstrip("]"))[-1]
        if ignore.search(last):
            ignored += 1
            continue
        diffs.append((place.replace("[", "[row ", 1) if before.suffix == ".jsonl" else place, x, y))
    if diffs:
        return "DIFFER", diffs
    return f"equal but for {ignored} ignored values", []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--names", nargs="+", default=list(NAMES), help="the file names to compare")
    parser.add_argument("--ignore", default=IGNORE, help="a regex of the keys to ignore (times, versions)")
    parser.add_argument("--show", type=int, default=20, help="differences shown per file")
    args = parser.parse_args(argv)
    for side in (args.before, args.after):
        if not side.is_dir():
            parser.error(f"{side} is not a folder; give the two folders that hold the runs' outputs")
    ignore = re.compile(args.ignore)
    pairs = sorted(
        {p.relative_to(args.before) for n in args.names for p in args.before.rglob(n)}
        | {p.relative_to(args.after) for n in args.names for p in args.after.rglob(n)}
    )
    if not pairs:
        parser.error(f"no file named {' / '.join(args.names)} under {args.before} or {args.after}")
    differ = 0
    for rel in pairs:
        before, after = args.before / rel, args.after / rel
        if not (before.is_file() and after.is_file()):
            print(f"{rel}: only {'before' if before.is_file() else 'after'}")
            differ += 1
            continue
        verdict, diffs = compare_file(before, after, ignore)
        print(f"{rel}: {verdict}" + (f" ({len(diffs)} values)" if diffs else ""))
        for place, x, y in diffs[: args.show]:
            print(f"    {place}: {x!r} -> {y!r}")
        if len(diffs) > args.show:
            print(f"    ... {len(diffs) - args.show} more")
        differ += bool(diffs)
    print(f"{len(pairs)} files: {len(pairs) - differ} equal, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
