"""Calibrated preference labels for offline data: ``judgeloop label-pairs``.

Reads a preference dataset (JSONL, or a local Hugging Face dataset saved with ``save_to_disk``) with
TRL's field names (``prompt``, ``chosen``, ``rejected``; others mapped with ``data.fields``), or pairs
of unordered completions (``data.fields.a`` / ``data.fields.b``), judges every pair with a saved
calibrated judge (:class:`~judgeloop.judges.calibrated.CalibratedJudge`) and writes a TRL-ready
dataset in the input's own TRL preference format: ``prompt``, ``chosen``, ``rejected`` (ordered by the
calibrated judge, or kept as given with ``keep_order``) as strings when they came as strings (TRL's
standard format), as lists of ``{"role", "content"}`` messages when they came as messages (its
conversational format: a string completion of a chat prompt becomes one assistant message), ``p_chosen`` (calibrated P(chosen better)), ``logit`` (the raw logit, chosen vs
rejected), ``orders_agree`` (whether the judge's two orders preferred the same completion; null when
it scored one order), ``judge_agrees`` (with the dataset's own order, when it has one) and ``status``.
Pairs whose two completions are the same text, and pairs the judge failed on, are kept out of the
dataset and counted (``dropped``); every field's kind is checked before any judging; ``min_confidence`` drops pairs whose
``max(p, 1 - p)`` is below it. ``data.max_pairs`` samples that many pairs spread over the prompts
(round-robin over the prompts in an order drawn with ``data.seed``), not the file's head, which in a
dataset sorted by prompt is one prompt's pairs. The report gives the agreement with the dataset's labels (Wilson 95%
interval), how many prompts the pairs cover, a confidence histogram and the throughput.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.config import ConfigError, bounded, check_fields
from judgeloop.intervals import wilson_interval
from judgeloop.io import DataError, atomic_dir, atomic_write_jsonl, check_row, read_jsonl
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
    ``Dataset.save_to_disk``). ``max_pairs``: label at most this many pairs, sampled across the prompts
    with ``seed`` (:func:`sample_across_prompts`); null labels them all."""

    path: str = ""
    format: Literal["jsonl", "hf"] = "jsonl"
    fields: PairFields = field(default_factory=PairFields)
    max_pairs: int | None = bounded(None, ge=1, hint=" (null: every pair)", shape="section")
    seed: int = bounded(0, ge=0, le=2**32 - 1)

    def __post_init__(self) -> None:
        check_fields("data", self)


@dataclass
class LabelPairsConfig:
    """Schema of ``judgeloop label-pairs``."""

    judge_path: str = ""
    judge_overrides: list[str] = field(default_factory=list)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    min_confidence: float = bounded(0.5, ge=0.5, le=1, hint=" (0.5 keeps every pair)", shape="section")
    # the DPO target each row carries in ``target`` (and its weight in ``weight``), as the loop's
    # loss.target / loss.target_temperature / loss.pair_weighting make them: ``p_chosen`` stays the
    # calibrated probability
    target: Literal["soft", "hard"] = "soft"
    target_temperature: float = bounded(
        1.0, gt=0, hint=" (1 keeps p as calibrated; < 1 sharpens)", shape="section"
    )
    pair_weighting: Literal["none", "confidence"] = "none"
    keep_order: bool = False
    batch_size: int = bounded(256, ge=1, message="{key}={value}; it must be at least 1")
    num_bins: int = bounded(10, ge=0)
    output_dir: str = "runs/label_pairs"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)
        check_judge_path(self.judge_path, on_disk=False)
        if not self.data.path:
            raise ValueError("data.path is empty; set data.path=FILE (JSONL) or a saved dataset folder")
        f = self.data.fields
        if (f.a is None) != (f.b is None):
            raise ValueError(
                "data.fields.a and data.fields.b go together: set both (unordered pairs) or neither"
            )


@dataclass
class InputPair:
    """One pair: ``first`` / ``second`` the texts the judge reads, ``first_value`` / ``second_value``
    what the output dataset gets (the row's own value: a string, or a list of messages)."""

    prompt: Any
    source: str
    first: str
    second: str
    ordered: bool  # first is the dataset's chosen
    references: tuple[str, ...] = ()
    first_value: Any = None
    second_value: Any = None


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _text(value: Any, where: str, name: str) -> str:
    """A completion's text: a string, or a conversational completion (the assistant messages' content);
    its kind was checked by :func:`read_pairs` (``chat``)."""
    if _is_messages(value):
        value = "".join(m["content"] for m in value if m.get("role", "assistant") == "assistant")
    if not value.strip():
        raise DataError(
            f"{where}: field '{name}' is empty; drop the row or fix it (an empty completion cannot be judged)"
        )
    return value


def _prompt_text(value: Any) -> str:
    if _is_messages(value):
        return "\n".join(m["content"] for m in value)
    return value


def read_pairs(data: PairDataConfig) -> tuple[list[InputPair], int, int]:
    """The input pairs (``data.max_pairs`` of them sampled across the prompts), how many distinct
    prompts the data has, and how many pairs were dropped because their two completions are the same
    text (ignoring surrounding whitespace: no side is better, and judging one would count as the judge
    agreeing or not by the order of a tie). Every field is checked first (a missing field, a field of
    the wrong kind, null where a text belongs, an empty completion, a row in another format than the
    first is a one-line :class:`DataError` naming the file, the row and the field) before any judging."""
    f = data.fields
    first, second = (f.a, f.b) if f.a is not None else (f.chosen, f.rejected)
    assert first is not None and second is not None
    need = [f.prompt, first, second] + [x for x in (f.source, f.references) if x]
    kinds = {f.prompt: "chat", first: "chat", second: "chat"}
    kinds.update({f.source: "text"} if f.source else {})
    kinds.update({f.references: "texts"} if f.references else {})
    if data.format == "jsonl":
        rows = read_jsonl(data.path, required=need, kinds=kinds)
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
        where = [f"{data.path} row {i}" for i in range(len(ds))]
        rows = [check_row(r, w, need, kinds) for r, w in zip(ds, where)]
    texts = [(_text(r[first], w, first), _text(r[second], w, second)) for r, w in zip(rows, where)]
    keys = [prompt_key(r[f.prompt]) for r in rows]
    prompts_in_data = len(set(keys))
    same = [a.strip() == b.strip() for a, b in texts]
    differ = [i for i, s in enumerate(same) if not s]
    equal = len(rows) - len(differ)
    if equal:
        logger.warning(
            "%s: dropped %d pair(s) whose two completions are the same text (the first: %s)",
            data.path,
            equal,
            where[same.index(True)],
        )
    if not differ:
        raise DataError(f"{data.path}: every pair's two completions are the same text; nothing to judge")
    rows, where, keys = [rows[i] for i in differ], [where[i] for i in differ], [keys[i] for i in differ]
    texts = [texts[i] for i in differ]
    if data.max_pairs is not None:
        keep = sample_across_prompts(keys, data.max_pairs, data.seed)
        rows, where, texts = [rows[i] for i in keep], [where[i] for i in keep], [texts[i] for i in keep]
    conversational = _format_of(rows, where, f.prompt, first, second)
    pairs = []
    for row, (first_text, second_text) in zip(rows, texts):
        refs = row.get(f.references) if f.references else ()
        refs = (refs,) if isinstance(refs, str) else tuple(refs or ())
        source = row[f.source] if f.source else _prompt_text(row[f.prompt])
        pairs.append(
            InputPair(
                row[f.prompt],
                source,
                first_text,
                second_text,
                ordered=f.a is None,
                references=refs,
                first_value=_as_format(row[first], conversational),
                second_value=_as_format(row[second], conversational),
            )
        )
        if conversational and not _is_messages(row[f.prompt]):
            pairs[-1].prompt = [{"role": "user", "content": str(row[f.prompt])}]
    return pairs, prompts_in_data, equal


def prompt_key(prompt: Any) -> str:
    """A prompt as a hashable key (a list of messages as its JSON)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def sample_across_prompts(keys: list[str], n: int, seed: int) -> list[int]:
    """Indices of ``n`` rows spread over the prompts: the prompts in an order drawn with ``seed``, each
    prompt's rows shuffled, then one row of each prompt in turn until ``n`` are taken (so ``n`` pairs
    cover ``min(n, prompts)`` prompts, and the counts per prompt differ by at most one where the prompts
    have enough rows). Deterministic for a seed; returned in file order."""
    if n >= len(keys):
        return list(range(len(keys)))
    rng = np.random.default_rng(seed)
    by_prompt: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        by_prompt.setdefault(k, []).append(i)
    queues = [list(rng.permutation(by_prompt[k])) for k in by_prompt]
    queues = [queues[j] for j in rng.permutation(len(queues))]
    taken: list[int] = []
    while len(taken) < n:
        for q in queues:
            if q and len(taken) < n:
                taken.append(int(q.pop(0)))
    return sorted(taken)


def _format_of(rows: list[dict[str, Any]], where: list[str], prompt: str, first: str, second: str) -> bool:
    """Whether the rows are in TRL's conversational format (a prompt or a completion as chat messages);
    every row must be in the same one (a dataset column holds one type)."""
    kinds = [_is_messages(r[prompt]) or _is_messages(r[first]) or _is_messages(r[second]) for r in rows]
    for k, w in zip(kinds, where):
        if k != kinds[0]:
            one, other = ("chat messages", "text") if kinds[0] else ("text", "chat messages")
            raise DataError(
                f"{w}: this row is {other} but the first row is {one}; give every row in one format "
                "(TRL's standard: strings; conversational: lists of {'role', 'content'} messages)"
            )
    return bool(kinds and kinds[0])


def _as_format(value: Any, conversational: bool) -> Any:
    """A completion as the output dataset holds it: its own messages, or a string as one assistant
    message when the dataset is conversational."""
    if conversational and not _is_messages(value):
        return [{"role": "assistant", "content": value}]
    return value


def label(cfg: LabelPairsConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Judge every pair of ``cfg.data`` with the calibrated judge at ``cfg.judge_path``; returns the
    labeled rows (the output dataset) and the report."""
    from judgeloop.judges.calibrated import CalibratedJudge, MissingReferences, check_references

    # the folder, then the data against what the judge reads, then the weights
    needs = CalibratedJudge.needs_of(cfg.judge_path, cfg.judge_overrides)
    if needs.reads_references and not cfg.data.fields.references:
        raise ConfigError(
            f"judge_path={cfg.judge_path} reads references ({needs.setting}) and data.fields.references is "
            "not set; set data.fields.references=FIELD, the field with each row's reference summaries, or "
            f"label with a judge calibrated with {needs.alternative}"
        )
    pairs, prompts_in_data, equal = read_pairs(cfg.data)  # every row checked before the judge model loads
    try:
        check_references(
            needs,
            [x.references for x in pairs],
            len(pairs),
            f"give every row its reference summaries in field {cfg.data.fields.references!r} (data.fields.references)",
            "row {i} (counting from 0)",
        )
    except MissingReferences as err:
        raise DataError(f"{cfg.data.path}: {err}") from None
    judge = CalibratedJudge.from_pretrained(cfg.judge_path, cfg.judge_overrides)
    t0 = time.perf_counter()
    p: list[float] = []
    logit: list[float] = []
    status: list[str] = []
    agree: list[bool | None] = []
    for start in range(0, len(pairs), cfg.batch_size):
        chunk = pairs[start : start + cfg.batch_size]
        out = judge.compare(
            [x.source for x in chunk],
            [x.first for x in chunk],
            [x.second for x in chunk],
            [x.references for x in chunk],
        )
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
    dropped = {"equal_completions": equal, "failed": 0, "low_confidence": 0}
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
        row = labeled_row(x.prompt, x.first_value, x.second_value, pi, li, ag, st, cfg.keep_order)
        row.update(dpo_target(row["p_chosen"], cfg))
        if x.ordered:
            row["judge_agrees"] = bool(judge_first)
        rows.append(row)
    report = label_report(
        cfg, judge, pairs, p, status, agree, agreements, rows, dropped, seconds, prompts_in_data
    )
    report["agreement_kept"] = _agreement(kept_agree)
    return rows, report


def labeled_row(
    prompt: Any,
    first: Any,
    second: Any,
    p: float,
    logit: float,
    orders_agree: bool | None,
    status: str,
    keep_order: bool = False,
) -> dict[str, Any]:
    """One labeled pair as the output dataset holds it (TRL's ``prompt`` / ``chosen`` / ``rejected``):
    ``p`` = calibrated P(first better) and ``logit`` the raw logit of (first, second); the judge's
    preferred completion is ``chosen`` unless ``keep_order``. The rows of ``label-pairs`` and of each
    round of the loop under ``mode: rounds``."""
    swap = p < 0.5 and not keep_order
    chosen, rejected = (second, first) if swap else (first, second)
    return {
        "prompt": prompt,
        "chosen": chosen,
        "rejected": rejected,
        "p_chosen": 1 - p if swap else p,
        "logit": -logit if swap else logit,
        "orders_agree": orders_agree,
        "status": status,
    }


def dpo_target(p_chosen: float, cfg: LabelPairsConfig) -> dict[str, float]:
    """The row's ``target`` (what :func:`judgeloop.integrations.trl.soft_dpo_trainer` trains towards with
    ``target_column="target"``) and ``weight`` (``weight_column="weight"``): ``p_chosen`` sharpened by
    ``target_temperature``, or 1[p >= 0.5] under ``target: hard``; the weight ``|2p - 1|`` under
    ``pair_weighting: confidence``, else 1. The same functions as the loop's ``make_pairs``."""
    import torch

    from judgeloop.loop.losses import confidence_weights, sharpen, targets_from_probs

    p = np.array([p_chosen])
    t, _ = targets_from_probs(torch.tensor(sharpen(p, cfg.target_temperature)), cfg.target)
    w = confidence_weights(p)[0] if cfg.pair_weighting == "confidence" else 1.0
    return {"target": float(t[0]), "weight": float(w)}


def _agreement(flags: list[bool]) -> dict[str, Any]:
    k, n = int(sum(flags)), len(flags)
    lo, hi = wilson_interval(k, n) if n else (float("nan"), float("nan"))
    return {"k": k, "n": n, "rate": k / n if n else None, "wilson95": [lo, hi]}


def label_report(
    cfg: LabelPairsConfig,
    judge: Any,
    pairs: list[InputPair],
    p: list[float],
    status: list[str],
    agree: list[bool | None],
    agreements: list[bool],
    rows: list[dict[str, Any]],
    dropped: dict[str, int],
    seconds: float,
    prompts_in_data: int,
) -> dict[str, Any]:
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
        },
        "format": "conversational" if pairs and _is_messages(pairs[0].prompt) else "standard",
        "pairs": len(pairs),
        "labeled": len(rows),
        # how many prompts the pairs cover: in the data, among the pairs judged, among those labeled
        "prompts": {
            "in_data": prompts_in_data,
            "judged": len({prompt_key(x.prompt) for x in pairs}),
            "labeled": len({prompt_key(r["prompt"]) for r in rows}),
        },
        "max_pairs": cfg.data.max_pairs,
        "seed": cfg.data.seed,
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
        # the rows' DPO targets: the settings, and the signal they carry (mean |target - 0.5|, the figure
        # docs/study.md compares across arms)
        "targets": {
            "target": cfg.target,
            "target_temperature": cfg.target_temperature,
            "pair_weighting": cfg.pair_weighting,
            "mean_signal": float(np.mean([abs(r["target"] - 0.5) for r in rows])) if rows else None,
            "mean_weight": float(np.mean([r["weight"] for r in rows])) if rows else None,
        },
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
            f"{report['labeled']} of {report['pairs']} pairs labeled"
            + _coverage(report)
            + f"; dropped: {report['dropped']} "
            f"(min_confidence {report['min_confidence']}). Judge status: {report['status']}. "
            + (f"Both orders preferred the same completion on {o['k']} of {o['n']} pairs. " if o["n"] else "")
            + (f"{report['pairs_per_s']:.1f} pairs/s." if report["pairs_per_s"] else ""),
            "",
            _targets_line(report),
            "",
            "Confidence max(p, 1 - p) of the judged pairs:",
            "",
            "| confidence | pairs |",
            "|---|---|",
            *bars,
            "",
        ]
    )


def _targets_line(report: dict[str, Any]) -> str:
    t = report.get("targets")
    if not t or t["mean_signal"] is None:
        return "No pair labeled: no DPO targets."
    how = f"`{t['target']}` targets at temperature {t['target_temperature']:g}, pair weighting `{t['pair_weighting']}`"
    return (
        f"DPO targets (columns `target`, `weight`): {how}; mean |target - 0.5| {t['mean_signal']:.3f}, "
        f"mean weight {t['mean_weight']:.3f}. Train on them with "
        '`soft_dpo_trainer(..., target_column="target", weight_column="weight")`.'
    )


def _coverage(report: dict[str, Any]) -> str:
    pr = report.get("prompts")
    if not pr:
        return ""
    sampled = f", sampled with seed {report['seed']}" if report.get("max_pairs") is not None else ""
    return f" ({report.get('format', 'standard')} format; they cover {pr['labeled']} of the data's {pr['in_data']} prompts{sampled})"


def write_dataset(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    """``labeled.jsonl`` and the same rows as a Hugging Face dataset (``dataset/``, ``load_from_disk``)."""
    from datasets import Dataset

    dataset = Dataset.from_list(rows)  # first: a row arrow cannot hold fails before any file is written
    atomic_write_jsonl(out_dir / "labeled.jsonl", rows)
    with atomic_dir(out_dir / "dataset") as tmp:
        dataset.save_to_disk(str(tmp))


__all__ = ["LabelPairsConfig", "dpo_target", "label", "render_label_report", "write_dataset"]
