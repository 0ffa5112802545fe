"""Calibrated preference labels for offline data: ``judgeloop label-pairs``.

Reads a preference dataset (JSONL, or a local Hugging Face dataset saved with ``save_to_disk``) with
TRL's field names (``prompt``, ``chosen``, ``rejected``; others mapped with ``data.fields``), or pairs
of unordered completions (``data.fields.a`` / ``data.fields.b``), judges every pair with a saved
calibrated judge (:class:`~judgeloop.judges.calibrated.CalibratedJudge`) and writes a TRL-ready
dataset: ``prompt``, ``chosen``, ``rejected`` (ordered by the calibrated judge, or kept as given with
``keep_order``), ``p_chosen`` (calibrated P(chosen better)), ``logit`` (the raw logit, chosen vs
rejected), ``orders_agree`` (whether the judge's two orders preferred the same completion; null when
it scored one order), ``judge_agrees`` (with the dataset's own order, when it has one) and ``status``.
Pairs the judge failed on are kept out of the dataset and counted; ``min_confidence`` drops pairs whose
``max(p, 1 - p)`` is below it. The report gives the agreement with the dataset's labels (Wilson 95%
interval), a confidence histogram and the throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.config import check_range
from judgeloop.intervals import wilson_interval
from judgeloop.io import DataError, atomic_dir, atomic_write_jsonl, read_jsonl
from judgeloop.judges.calibrated import check_judge_path
from judgeloop.logging import get_logger

logger = get_logger(__name__)


@dataclass
class PairFields:
    """Where each field is in the input rows (``data.fields.*``). ``a`` / ``b``: two completions in no
    particular order (instead of ``chosen`` / ``rejected``). ``source``: the text the judge reads the
    completions against (default: the prompt). ``references``: for a judge that compares to references."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    a: str | None = None
    b: str | None = None
    source: str | None = None
    references: str | None = None


@dataclass
class PairDataConfig:
    """The preference data: ``format`` ``jsonl`` (``path`` a file) or ``hf`` (a folder from
    ``Dataset.save_to_disk``)."""

    path: str = ""
    format: Literal["jsonl", "hf"] = "jsonl"
    fields: PairFields = field(default_factory=PairFields)
    max_pairs: int | None = None


@dataclass
class LabelPairsConfig:
    """Schema of ``judgeloop label-pairs``."""

    judge_path: str = ""
    judge_overrides: list[str] = field(default_factory=list)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    min_confidence: float = 0.5
    keep_order: bool = False
    batch_size: int = 256
    num_bins: int = 10
    output_dir: str = "runs/label_pairs"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_judge_path(self.judge_path, on_disk=False)
        if not self.data.path:
            raise ValueError("data.path is empty; set data.path=FILE (JSONL) or a saved dataset folder")
        check_range("", self, "min_confidence", 0.5, 1, "[]", " (0.5 keeps every pair)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}; it must be at least 1")
        f = self.data.fields
        if (f.a is None) != (f.b is None):
            raise ValueError(
                "data.fields.a and data.fields.b go together: set both (unordered pairs) or neither"
            )


@dataclass
class InputPair:
    prompt: Any
    source: str
    first: str
    second: str
    ordered: bool  # first is the dataset's chosen
    references: tuple[str, ...] = ()


def _text(value: Any, where: str, name: str) -> str:
    """A completion's text: a string, or a conversational completion (the assistant messages' content)."""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        value = "".join(str(m.get("content", "")) for m in value if m.get("role", "assistant") == "assistant")
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be text or chat messages, got {type(value).__name__}")
    if not value.strip():
        raise DataError(
            f"{where}: field '{name}' is empty; drop the row or fix it (an empty completion cannot be judged)"
        )
    return value


def _prompt_text(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(str(m.get("content", "")) for m in value)
    return str(value)


def read_pairs(data: PairDataConfig) -> list[InputPair]:
    """The input pairs, every field checked (a missing field or an empty completion is a one-line
    :class:`DataError` naming the row) before any judging."""
    f = data.fields
    first, second = (f.a, f.b) if f.a is not None else (f.chosen, f.rejected)
    assert first is not None and second is not None
    need = [f.prompt, first, second] + [x for x in (f.source, f.references) if x]
    if data.format == "jsonl":
        rows = read_jsonl(data.path, required=need)
        where = [f"{data.path}:{i + 1}" for i in range(len(rows))]
    else:
        if (
            not (Path(data.path) / "dataset_info.json").is_file()
            and not (Path(data.path) / "state.json").is_file()
        ):
            raise DataError(
                f"data.path={data.path} is not a dataset saved with save_to_disk; use data.format=jsonl for a file"
            )
        from datasets import load_from_disk

        ds = load_from_disk(data.path)
        missing = [k for k in need if k not in ds.column_names]
        if missing:
            raise DataError(
                f"{data.path}: no column(s) {missing}; columns: {ds.column_names}. Map yours with data.fields.*"
            )
        rows = list(ds)
        where = [f"{data.path} row {i}" for i in range(len(rows))]
    if data.max_pairs is not None:
        rows, where = rows[: data.max_pairs], where[: data.max_pairs]
    pairs = []
    for row, w in zip(rows, where):
        refs = row.get(f.references) if f.references else ()
        refs = (refs,) if isinstance(refs, str) else tuple(refs or ())
        source = row[f.source] if f.source else _prompt_text(row[f.prompt])
        pairs.append(
            InputPair(
                row[f.prompt],
                str(source),
                _text(row[first], w, first),
                _text(row[second], w, second),
                ordered=f.a is None,
                references=refs,
            )  # fmt: skip
        )
    return pairs


def label(cfg: LabelPairsConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Judge every pair of ``cfg.data`` with the calibrated judge at ``cfg.judge_path``; returns the
    labeled rows (the output dataset) and the report."""
    from judgeloop.judges.calibrated import CalibratedJudge

    judge = CalibratedJudge.from_pretrained(cfg.judge_path, cfg.judge_overrides)  # checked first: cheap
    pairs = read_pairs(cfg.data)
    t0 = time.perf_counter()
    p: list[float] = []
    logit: list[float] = []
    status: list[str] = []
    agree: list[bool | None] = []
    for start in range(0, len(pairs), cfg.batch_size):
        chunk = pairs[start : start + cfg.batch_size]
        out = judge.compare([x.source for x in chunk], [x.first for x in chunk], [x.second for x in chunk],
                            [x.references for x in chunk])  # fmt: skip
        p += out.p.tolist()
        logit += out.logit.tolist()
        status += out.status
        if out.reverse is None:
            agree += [None] * len(chunk)
        else:
            agree += [
                bool(np.sign(fw) == np.sign(-rv)) if ok else None
                for fw, rv, ok in zip(out.forward, out.reverse, out.valid)
            ]
    seconds = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    dropped = {"failed": 0, "low_confidence": 0}
    agreements: list[bool] = []
    kept_agree: list[bool] = []  # on the pairs min_confidence keeps
    for x, pi, li, st, ag in zip(pairs, p, logit, status, agree):
        if not np.isfinite(pi):
            dropped["failed"] += 1
            continue
        judge_first = pi >= 0.5
        if x.ordered:
            agreements.append(judge_first)
        if max(pi, 1 - pi) < cfg.min_confidence:
            dropped["low_confidence"] += 1
            continue
        if x.ordered:
            kept_agree.append(judge_first)
        swap = not judge_first and not cfg.keep_order
        chosen, rejected = (x.second, x.first) if swap else (x.first, x.second)
        row = {
            "prompt": x.prompt,
            "chosen": chosen,
            "rejected": rejected,
            "p_chosen": 1 - pi if swap else pi,
            "logit": -li if swap else li,
            "orders_agree": ag,
            "status": st,
        }
        if x.ordered:
            row["judge_agrees"] = bool(judge_first)
        rows.append(row)
    report = label_report(cfg, judge, pairs, p, status, agree, agreements, rows, dropped, seconds)
    report["agreement_kept"] = _agreement(kept_agree)
    return rows, report


def _agreement(flags: list[bool]) -> dict[str, Any]:
    k, n = int(sum(flags)), len(flags)
    lo, hi = wilson_interval(k, n) if n else (float("nan"), float("nan"))
    return {"k": k, "n": n, "rate": k / n if n else None, "wilson95": [lo, hi]}


def label_report(
    cfg: LabelPairsConfig, judge: Any, pairs: list[InputPair], p: list[float], status: list[str],
    agree: list[bool | None], agreements: list[bool], rows: list[dict[str, Any]], dropped: dict[str, int],
    seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """The figures of a labeling run (see :func:`render_label_report`)."""
    valid = np.array([v for v in p if np.isfinite(v)])
    confidence = np.maximum(valid, 1 - valid) if valid.size else valid
    edges = np.linspace(0.5, 1.0, cfg.num_bins + 1)
    counts = np.histogram(confidence, bins=edges)[0].tolist() if valid.size else [0] * cfg.num_bins
    known = [a for a in agree if a is not None]
    return {
        "judge": {
            "path": cfg.judge_path,
            "method": judge.method,
            "type": judge.config.type,
            "model": judge.config.model,
            "held_out": judge.card.get("held_out", {}),
        },  # fmt: skip
        "pairs": len(pairs),
        "labeled": len(rows),
        "dropped": dropped,
        "status": {s: status.count(s) for s in sorted(set(status))},
        "agreement_with_dataset": _agreement(agreements),
        "orders_agree": {"k": int(sum(known)), "n": len(known)},
        "mean_confidence": float(confidence.mean()) if confidence.size else None,
        "confidence_histogram": {"edges": edges.tolist(), "counts": counts},
        "seconds": seconds,
        "pairs_per_s": len(pairs) / seconds if seconds > 0 else None,
        "min_confidence": cfg.min_confidence,
        "keep_order": cfg.keep_order,
    }


def render_label_report(report: dict[str, Any]) -> str:
    """``report.md``: agreement with the dataset first, then confidence and throughput."""
    a, j = report["agreement_with_dataset"], report["judge"]
    if a["n"]:
        head = (
            f"The judge (calibration `{j['method']}`) agrees with the dataset's own order on {a['k']} of {a['n']} pairs "
            f"({a['rate']:.3f}, Wilson 95% [{a['wilson95'][0]:.3f}, {a['wilson95'][1]:.3f}])."
        )
    else:
        head = "The dataset gives no order of its own (unordered pairs): no agreement to report."
    hist = report["confidence_histogram"]
    bars = [
        f"| {lo:.2f}-{hi:.2f} | {c} |"
        for lo, hi, c in zip(hist["edges"][:-1], hist["edges"][1:], hist["counts"])
    ]
    o, kept = report["orders_agree"], report.get("agreement_kept")
    if a["n"] and kept and kept["n"] != a["n"]:
        head += (
            f" On the {kept['n']} pairs kept at min_confidence {report['min_confidence']}: {kept['k']} "
            f"({kept['rate']:.3f}, Wilson 95% [{kept['wilson95'][0]:.3f}, {kept['wilson95'][1]:.3f}])."
            if kept["n"]
            else f" No pair reaches min_confidence {report['min_confidence']}."
        )
    return "\n".join(
        [
            "# Calibrated preference labels",
            "",
            head,
            "",
            f"Judge `{j['type']}` on `{j['model']}`, calibration `{j['method']}` ({j['path']}). "
            f"{report['labeled']} of {report['pairs']} pairs labeled; dropped: {report['dropped']} "
            f"(min_confidence {report['min_confidence']}). Judge status: {report['status']}. "
            + (f"Both orders preferred the same completion on {o['k']} of {o['n']} pairs. " if o["n"] else "")
            + (f"{report['pairs_per_s']:.1f} pairs/s." if report["pairs_per_s"] else ""),
            "",
            "Confidence max(p, 1 - p) of the judged pairs:",
            "",
            "| confidence | pairs |",
            "|---|---|",
            *bars,
            "",
        ]
    )


def write_dataset(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``labeled.jsonl`` and the same rows as a Hugging Face dataset (``dataset/``, ``load_from_disk``)."""
    from datasets import Dataset

    atomic_write_jsonl(out_dir / "labeled.jsonl", rows)
    with atomic_dir(out_dir / "dataset") as tmp:
        Dataset.from_list(rows).save_to_disk(str(tmp))


__all__ = ["LabelPairsConfig", "label", "render_label_report", "write_dataset"]
