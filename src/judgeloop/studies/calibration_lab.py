"""The judge calibration lab behind ``judgeloop calibrate``: how trustworthy is a judge's preference,
before and after calibration?

:func:`calibration_lab` scores labeled candidate pairs with the configured judge on the ``calibration``
split, fits each calibrator there, and evaluates raw and calibrated probabilities on the ``test`` split
over both orientations of every pair; :func:`render_markdown` is its report.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from scipy.special import expit

from judgeloop.calibration.calibrators import CALIBRATORS, Calibrator, make_calibrator
from judgeloop.calibration.coupling import coupling_line, judge_coupling
from judgeloop.calibration.features import FEATURE_NAMES, both_orientations, pair_feature_matrix
from judgeloop.calibration.health import health_lines, judge_health
from judgeloop.calibration.labels import LabelConfig, LabeledPair, build_labeled_pairs
from judgeloop.calibration.metrics import all_metrics
from judgeloop.config import bounded, check_fields
from judgeloop.data import DataConfig, load_examples, split_examples
from judgeloop.io import DataError
from judgeloop.judges import VALID_STATUSES, JudgeConfig, build_judge
from judgeloop.judges.base import Judge, Pair
from judgeloop.logging import get_logger

logger = get_logger(__name__)


@dataclass
class CalibratorOptions:
    """Settings shared by the calibrators ``judgeloop calibrate`` fits (``calibrator.*``)."""

    symmetric: bool = True
    platt_fit_intercept: bool = False
    min_points: int = bounded(10, ge=1, hint=" (points a calibrator needs to be fitted)")
    isotonic_min_points_warn: int = bounded(200, ge=0, hint=" (0: never warn)")
    isotonic_eps: float = bounded(
        1e-3, ge=0, lt=0.5, hint=" (isotonic probabilities are clipped to [eps, 1 - eps])"
    )
    feature_l2: float = bounded(1e-3, ge=0, hint=" (an L2 penalty)")

    def __post_init__(self) -> None:
        check_fields("calibrator", self)


@dataclass
class CalibrateConfig:
    """Schema of ``judgeloop calibrate``: data, judge, labels, the methods to fit and the report."""

    data: DataConfig = field(default_factory=DataConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    labels: LabelConfig = field(default_factory=LabelConfig)
    methods: list[str] = field(default_factory=lambda: ["platt", "isotonic"])
    calibrator: CalibratorOptions = field(default_factory=CalibratorOptions)
    max_pairs_per_article: int | None = bounded(None, ge=0)
    max_fit_articles: int | None = bounded(None, ge=0)
    max_eval_articles: int | None = bounded(None, ge=0)
    RENAMED: ClassVar[dict[str, str]] = {"n_bins": "num_bins"}
    num_bins: int = bounded(15, ge=2, message="{key} must be >= 2, got {value}")
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/calibrate"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)
        unknown = [m for m in self.methods if m not in CALIBRATORS or m == "raw"]
        if unknown:
            valid = sorted(set(CALIBRATORS) - {"raw"})
            raise ValueError(
                f"methods has unknown calibrator(s) {unknown}; choose from {valid} (raw is always reported)"
            )
        if not self.methods:
            raise ValueError("methods is empty; list at least one calibrator, e.g. methods=[platt,isotonic]")


def build_calibrator(method: str, opts: CalibratorOptions) -> Calibrator:
    """An unfitted calibrator of ``method`` with the options that apply to it."""
    kwargs: dict[str, Any] = {"symmetric": opts.symmetric, "min_points": opts.min_points}
    if method == "platt":
        kwargs["fit_intercept"] = opts.platt_fit_intercept
    elif method == "isotonic":
        kwargs.update(min_points_warn=opts.isotonic_min_points_warn, eps=opts.isotonic_eps)
    elif method == "feature_platt":
        kwargs["l2"] = opts.feature_l2
    return make_calibrator(method, **kwargs)


def judge_inputs(judge: Judge, pairs: Sequence[LabeledPair]) -> list[Pair]:
    """The judge's inputs for labeled pairs: the references it reads (extractive or neutral) attached."""
    extractive = getattr(judge, "reference_style", "neutral") == "extractive"
    return [Pair(p.article, p.a, p.b, references=p.extractive if extractive else p.references) for p in pairs]


def score_pairs(judge: Judge, pairs: Sequence[LabeledPair], desc: str) -> dict[str, Any]:
    """Judge every pair in both orientations; returns forward/reverse raw logits and statuses.

    A position-debiased judge is antisymmetric by construction, so its reverse score is -s; any
    other judge scores the swapped pair for real (its order effect then shows in the report).
    """
    from tqdm.auto import tqdm

    fwd = np.full(len(pairs), np.nan)
    rev = np.full(len(pairs), np.nan)
    status: list[str] = []
    bias_terms: list[float] = []
    step = max(judge.batch_size, 1) * 4
    for start in tqdm(range(0, len(pairs), step), desc=desc, unit="batch"):
        chunk = pairs[start : start + step]
        items = judge_inputs(judge, chunk)
        refs = [p.references for p in items]
        out = judge.score(items)
        fwd[start : start + len(chunk)] = out.scores
        if judge.position_debias:
            rev[start : start + len(chunk)] = -out.scores
            status.extend(out.status)
            if out.reverse is not None:
                ok = out.valid
                bias_terms.extend((out.forward[ok] + out.reverse[ok]).tolist())
        else:
            back = judge.score([Pair(p.article, p.b, p.a, references=r) for p, r in zip(chunk, refs)])
            rev[start : start + len(chunk)] = back.scores
            for s1, s2 in zip(out.status, back.status):
                status.append(s1 if s1 not in VALID_STATUSES else s2)
            ok = out.valid & back.valid
            bias_terms.extend((out.scores[ok] + back.scores[ok]).tolist())
    return {
        "forward": fwd,
        "reverse": rev,
        "status": status,
        "position_bias": float(np.mean(bias_terms)) if bias_terms else float("nan"),
    }


def _valid(scored: dict[str, Any]) -> np.ndarray:
    ok = np.array([s in VALID_STATUSES for s in scored["status"]], dtype=bool)
    return ok & np.isfinite(scored["forward"]) & np.isfinite(scored["reverse"])


class NothingJudged(DataError):
    """Every pair of a split failed judging; ``counts`` holds the judge's status and cache counts (what
    :func:`judge_counts` returns), which the command writes beside its one-line message."""

    def __init__(self, message: str, counts: dict[str, Any]):
        super().__init__(message)
        self.counts = counts


def judge_counts(judge: Judge, fit_scored: dict[str, Any], eval_scored: dict[str, Any]) -> dict[str, Any]:
    """The judge's counts in the report: statuses per split, its in-memory cache (``cache``), the
    judgements read from a cache kept across runs (``stored_cache``: the served judge's
    ``judge.server.cache_path``; 0 without one), its replies' label masses (``label_mass``, a served judge
    on a route that returns them) and what a served judge says of its server."""
    return {
        "status": {
            "calibration": dict(Counter(fit_scored["status"])),
            "test": dict(Counter(eval_scored["status"])),
        },
        "cache": {"hits": judge.stats.cache_hits, "misses": judge.stats.cache_misses},
        "stored_cache": {"hits": judge.stats.stored_hits, "misses": judge.stats.stored_misses},
        **({"label_mass": judge.stats.label_mass_summary()} if judge.stats.label_mass else {}),
        **({"served": judge.describe()} if hasattr(judge, "describe") else {}),
    }


def _counts_text(counts: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + "}"


@dataclass
class CalibrationLab:
    """What :func:`calibration_lab` found: the report, and what the command writes beside it."""

    report: dict[str, Any]
    probs: dict[str, np.ndarray]  # method -> P(a better) per test prediction (both orientations)
    labels: np.ndarray
    calibrators: dict[str, Calibrator]
    predictions: list[dict[str, Any]]
    judge: Judge | None = None  # the judge that scored the pairs (a calibrated judge saves with it)


def _split_articles(cfg: CalibrateConfig) -> tuple[list[Any], list[Any], int]:
    examples = load_examples(cfg.data)
    splits = split_examples(examples, cfg.data.split)
    fit_ex, eval_ex = splits["calibration"], splits["test"]
    if cfg.max_fit_articles is not None:
        fit_ex = fit_ex[: cfg.max_fit_articles]
    if cfg.max_eval_articles is not None:
        eval_ex = eval_ex[: cfg.max_eval_articles]
    for name, items in (("calibration", fit_ex), ("test", eval_ex)):
        if not items:
            raise DataError(
                f"the '{name}' split is empty ({len(examples)} articles, split fractions "
                f"calibration={cfg.data.split.calibration}, test={cfg.data.split.test}); raise data.split.{name}"
            )
    logger.info("articles: %d calibration, %d test (of %d)", len(fit_ex), len(eval_ex), len(examples))
    return fit_ex, eval_ex, len(examples)


def labeled_pairs(cfg: CalibrateConfig, fit_ex: list[Any], eval_ex: list[Any]) -> tuple[list, list, Any, Any]:
    """Labeled pairs of each split, checked against ``calibrator.min_points`` before any judging."""
    fit_pairs, fit_stats = build_labeled_pairs(fit_ex, cfg.labels, cfg.seed, cfg.max_pairs_per_article)
    eval_pairs, eval_stats = build_labeled_pairs(eval_ex, cfg.labels, cfg.seed + 1, cfg.max_pairs_per_article)
    if not fit_pairs or not eval_pairs:
        raise DataError(
            f"no labeled pairs (calibration: {len(fit_pairs)}, test: {len(eval_pairs)}); with labels.type="
            f"{cfg.labels.type} every pair was a tie or unrated; check labels.dimension={cfg.labels.dimension!r} "
            "or use labels.type=rouge"
        )
    if len(fit_pairs) < cfg.calibrator.min_points:  # known before any judging: say it now
        raise DataError(
            f"calibrator.min_points={cfg.calibrator.min_points} but the calibration split gives {len(fit_pairs)} "
            f"labeled pairs ({len(fit_ex)} articles); use more articles (max_fit_articles, data.split.calibration, "
            "max_pairs_per_article) or lower calibrator.min_points"
        )
    return fit_pairs, eval_pairs, fit_stats, eval_stats


def fit_calibrators(
    cfg: CalibrateConfig,
    s_fit: np.ndarray,
    y_fit: np.ndarray,
    f_fit: np.ndarray,
    s_eval: np.ndarray,
    f_eval: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, Calibrator]]:
    """Fit each method on the calibration pairs; P(a better) of raw and each method on the test pairs."""
    probs: dict[str, np.ndarray] = {"raw": expit(s_eval)}
    calibrators: dict[str, Calibrator] = {}
    for method in cfg.methods:
        cal = build_calibrator(method, cfg.calibrator)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cal.fit(s_fit, y_fit, f_fit if cal.uses_features else None)
        for w in caught:
            logger.warning("%s: %s", method, w.message)
        calibrators[method] = cal
        probs[method] = cal.predict_proba(s_eval, f_eval if cal.uses_features else None)
    return probs, calibrators


def calibration_lab(cfg: CalibrateConfig) -> CalibrationLab:
    """Split, label, judge both orientations, fit, evaluate; returns the report and its parts."""
    fit_ex, eval_ex, n_articles = _split_articles(cfg)
    fit_pairs, eval_pairs, fit_label_stats, eval_label_stats = labeled_pairs(cfg, fit_ex, eval_ex)
    judge = build_judge(cfg.judge)
    if judge.learns_from_labels:  # a panel: its members' calibrators, fitted on the calibration pairs only
        judge.fit_labels(judge_inputs(judge, fit_pairs), [p.label for p in fit_pairs])
    fit_scored = score_pairs(judge, fit_pairs, "judging calibration pairs")
    eval_scored = score_pairs(judge, eval_pairs, "judging test pairs")

    fit_ok = _valid(fit_scored)
    eval_ok = _valid(eval_scored)
    s_fit = fit_scored["forward"][fit_ok]
    y_fit = np.array([p.label for p in fit_pairs], dtype=float)[fit_ok]
    f_fit = pair_feature_matrix(fit_pairs, valid=fit_ok)[fit_ok]

    kept_eval = [p for p, ok in zip(eval_pairs, eval_ok) if ok]
    y_e = np.array([p.label for p in kept_eval], dtype=float)
    # Both orientations: (a, b) with score s(a, b) and label y; (b, a) with s(b, a) and 1 - y.
    s_eval = np.concatenate([eval_scored["forward"][eval_ok], eval_scored["reverse"][eval_ok]])
    y_eval = np.concatenate([y_e, 1 - y_e])
    f_eval = both_orientations(pair_feature_matrix(kept_eval))
    orient = ["ab"] * len(kept_eval) + ["ba"] * len(kept_eval)
    if s_fit.size == 0 or s_eval.size == 0:
        split = "calibration" if s_fit.size == 0 else "test"
        counts = judge_counts(judge, fit_scored, eval_scored)
        raise NothingJudged(
            f"every {split} pair failed judging (judge statuses: calibration "
            f"{_counts_text(counts['status']['calibration'])}, test {_counts_text(counts['status']['test'])}); "
            f"nothing to {'fit' if split == 'calibration' else 'evaluate'}: see the warnings above for why",
            counts,
        )
    probs, calibrators = fit_calibrators(cfg, s_fit, y_fit, f_fit, s_eval, f_eval)

    report: dict[str, Any] = {
        "n_fit": int(s_fit.size),
        "n_fit_orientations": int(s_fit.size * (2 if cfg.calibrator.symmetric else 1)),
        "n_eval": int(s_eval.size),
        "n_eval_pairs": len(kept_eval),
        "n_bins": cfg.num_bins,
        "articles": {"calibration": len(fit_ex), "test": len(eval_ex), "total": n_articles},
        "methods": {name: all_metrics(p, y_eval, cfg.num_bins) for name, p in probs.items()},
        "judge": {
            "type": cfg.judge.type,
            "model": cfg.judge.model,
            "prompt": cfg.judge.prompt,
            "position_debias": bool(judge.position_debias),
            # reversed (AUC < 0.5) or position-only on the calibration pairs: the report opens with it
            "health": judge_health(
                fit_scored["forward"][fit_ok],
                fit_scored["reverse"][fit_ok],
                np.array([p.label for p in fit_pairs], dtype=float)[fit_ok],
            ),
            "position_bias": {
                "calibration": fit_scored["position_bias"],
                "test": eval_scored["position_bias"],
            },
            **judge_counts(judge, fit_scored, eval_scored),
        },
        "labels": {
            "type": cfg.labels.type,
            "dimension": cfg.labels.dimension,
            "calibration": fit_label_stats.as_dict(),
            "test": eval_label_stats.as_dict(),
            "positive_rate_eval_forward": float(y_e.mean()) if y_e.size else float("nan"),
        },
        "calibrators": {m: c.state_dict() for m, c in calibrators.items()},
        "feature_names": list(FEATURE_NAMES),
        "coupling": judge_coupling(
            eval_scored["forward"][eval_ok],
            [p.label for p in kept_eval],
            [p.article for p in kept_eval],
            [p.a for p in kept_eval],
            [p.b for p in kept_eval],
        ),
    }
    rows = [
        {
            "article_id": p.article_id,
            "orientation": orient[i],
            # the pair's two texts in the row's orientation, so anyone can judge the row again
            "a": p.a if orient[i] == "ab" else p.b,
            "b": p.b if orient[i] == "ab" else p.a,
            "score": float(s_eval[i]),
            "label": int(y_eval[i]),
            **{f"p_{name}": float(pr[i]) for name, pr in probs.items()},
        }
        for i, p in enumerate(kept_eval + kept_eval)
    ]
    return CalibrationLab(report, probs, y_eval, calibrators, rows, judge)


def judge_card(cfg: CalibrateConfig, report: dict[str, Any], method: str) -> dict[str, Any]:
    """What a saved calibrated judge says of itself: the data it was fit on and its held-out figures."""
    m, raw = report["methods"][method], report["methods"]["raw"]
    return {
        "statuses": report["judge"]["status"],
        "fit": {
            "split": "calibration",
            "pairs": report["n_fit"],
            "articles": report["articles"]["calibration"],
            "label_type": cfg.labels.type,
            "label_dimension": cfg.labels.dimension if cfg.labels.type == "human" else None,
            "data_format": cfg.data.format,
            "data_path": cfg.data.path,
            "seed": cfg.seed,
        },
        "held_out": {
            "split": "test",
            "pairs": report["n_eval_pairs"],
            "predictions": report["n_eval"],
            "articles": report["articles"]["test"],
            **{k: float(m[k]) for k in ("ece", "brier", "nll", "auc", "accuracy")},
            "position_bias": float(report["judge"]["position_bias"]["test"]),
        },
        # the same test predictions before calibration (p = sigmoid(logit)), beside the calibrated ones
        "held_out_raw": {k: float(raw[k]) for k in ("ece", "brier", "nll", "auc", "accuracy")},
    }


def render_table(report: dict[str, Any]) -> str:
    """The metrics table (one row per method) of a report, in markdown."""
    cols = ["ece", "ece_equal_mass", "mce", "brier", "nll", "auc", "accuracy"]
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in report["methods"].items():
        lines.append(f"| {name} | " + " | ".join(f"{m[c]:.4f}" for c in cols) + " |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    j = report["judge"]
    return "\n".join(
        [
            "# Judge calibration report",
            "",
            *[w for line in health_lines(j["type"], j.get("health")) for w in (line, "")],
            f"On the test pairs, the {coupling_line(report['coupling'])}.",
            "",
            f"Judge: `{j['type']}` on `{j['model']}` (prompt `{j['prompt']}`, position debiasing "
            f"{'on' if j['position_debias'] else 'off'}). Labels: `{report['labels']['type']}`"
            + (f" (`{report['labels']['dimension']}`)" if report["labels"]["type"] == "human" else "")
            + ".",
            "",
            f"Calibrators were fit on {report['n_fit']} pairs from {report['articles']['calibration']} calibration "
            f"articles and evaluated on {report['n_eval']} predictions ({report['n_eval_pairs']} pairs x 2 orientations) "
            f"from {report['articles']['test']} disjoint test articles. `raw` is sigmoid(raw logit). "
            f"ECE uses {report['n_bins']} equal-width bins (`ece_equal_mass`: equal-mass bins).",
            "",
            render_table(report),
            "",
            f"Position bias (mean s(a,b) + s(b,a), 0 = order-invariant): calibration "
            f"{j['position_bias']['calibration']:.4f}, test {j['position_bias']['test']:.4f}.",
            "",
            f"Judge item status: calibration {j['status']['calibration']}, test {j['status']['test']}. "
            "Items that are not `ok`/`truncated` (or a served judge's `outside_topk`/`text_only`) are excluded, "
            "never scored as a preference.",
            "",
            *(
                [
                    f"Served judge: model `{j['served']['model']}`, route `{j['served']['route']}`, max logprobs "
                    f"{j['served'].get('max_logprobs') or 'not reported'} (the server's own figure).",
                    "",
                ]
                if "served" in j
                else []
            ),
            f"Label ties / unrated pairs dropped: calibration {report['labels']['calibration']}, "
            f"test {report['labels']['test']}.",
            "",
            "Every metric can be recomputed from `predictions.jsonl`. ![reliability](reliability.png)",
            "",
        ]
    )
