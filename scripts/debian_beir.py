"""Write a grouped BEIR retrieval set from the Debian synopsis corpus, for ``judgeloop conformal``.

    .venv/bin/python scripts/debian_beir.py [--data ../shared/data/debian/debian_synopsis_dev.jsonl]
        [--out runs/data/debian_beir] [--sections games,net,...] [--per-section 250] [--distractors 2000]

Each query is a package's one-line synopsis (written by its maintainer); its one relevant document is the
package's long description. The query's group is the package's Debian archive section (``section`` in
``queries.jsonl``): a real task type with its own retrieval base rate (library and documentation packages
have boilerplate descriptions; games and network tools do not). The corpus holds the descriptions of the
sampled packages plus ``--distractors`` other packages of the same sections. Sampling is seeded, so the
same arguments write the same files. The output is third-party data (Debian package descriptions, licenses
vary per package): it goes under ``runs/`` (ignored by git) and is never committed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SECTIONS = "libs,libdevel,doc,python,utils,net,science,games,sound"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/debian/debian_synopsis_dev.jsonl")
    ap.add_argument("--out", default="runs/data/debian_beir")
    ap.add_argument("--sections", default=SECTIONS, help="comma-separated Debian sections")
    ap.add_argument("--per-section", type=int, default=250, help="queries per section")
    ap.add_argument("--distractors", type=int, default=2000, help="other packages of those sections")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    sections = [s for s in args.sections.split(",") if s]
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["section"] in sections and r["article"].strip() and r["summary"].strip()]
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    picked: dict[str, list[dict]] = {s: [] for s in sections}
    rest = []
    for r in rows:
        bucket = picked[r["section"]]
        (bucket if len(bucket) < args.per_section else rest).append(r)
    short = {s: len(v) for s, v in picked.items() if len(v) < args.per_section}
    if short:
        raise SystemExit(f"--per-section={args.per_section}: these sections have fewer packages: {short}")
    queries = [r for s in sections for r in picked[s]]
    corpus = queries + rest[: args.distractors]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "corpus.jsonl").open("w") as fh:
        for r in sorted(corpus, key=lambda r: r["id"]):
            fh.write(json.dumps({"_id": r["id"], "title": "", "text": r["article"]}) + "\n")
    with (out / "queries.jsonl").open("w") as fh:
        for r in sorted(queries, key=lambda r: r["id"]):
            fh.write(json.dumps({"_id": r["id"], "text": r["summary"], "section": r["section"]}) + "\n")
    lines = ["query-id\tcorpus-id\tscore"] + [
        f"{r['id']}\t{r['id']}\t1" for r in sorted(queries, key=lambda r: r["id"])
    ]
    (out / "qrels.tsv").write_text("\n".join(lines) + "\n")
    print(f"{out}: {len(queries)} queries in {len(sections)} sections, corpus of {len(corpus)} descriptions")


if __name__ == "__main__":
    main()
