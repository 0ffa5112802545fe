"""The judge probe behind ``judgeloop probe-judge``: which reward hacks fool which judge, and do position
debiasing and calibration help?

For each article of the ``test`` split, the *honest* summary is its best-rated candidate (the highest
mean of the ``honest_rating`` dimensions; on SummEval the four expert ratings: coherence, consistency,
fluency, relevance) and the *weak base* its worst-rated one. Each attack of
:mod:`judgeloop.judges.hacking` makes an adversarial summary, and every judge scores the pair
(adversarial, honest) in both orders. An attack *succeeds* when the judge prefers the adversarial
summary, read at four stages:

* ``forward``: shown first, raw logit ``s(adv, honest) > 0``;
* ``reverse``: shown second, ``s(honest, adv) < 0``;
* ``debiased``: both orders combined (:func:`~judgeloop.judges.base.combine_orders`) ``> 0``;
* ``calibrated``: the debiased logit through a calibrator fit on human-labeled candidate pairs of the
  calibration split (``calibration.split``), ``p > 0.5``. This is the final ``success_rate``.

A judge whose ``learns_from_labels`` is true is first fit (:meth:`~judgeloop.judges.base.Judge.fit_labels`)
on the same calibration-split pairs. A failed judgement (an empty summary the judge refuses, a NaN logit,
an input that cannot fit) is no success and is counted in ``n_failed``. Rates carry Wilson intervals;
each attack's lift over the ``control`` row (the weak base alone) carries a paired bootstrap interval
over articles. :func:`probe` returns the report and the per-pair rows;
:func:`judgeloop.studies.probe_report.render_markdown` writes ``report.md`` from the report.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from scipy.special import expit

from judgeloop.calibration.calibrators import CALIBRATORS, Calibrator
from judgeloop.calibration.features import features_for, pair_feature_matrix
from judgeloop.calibration.health import judge_health
from judgeloop.calibration.labels import LabelConfig, LabeledPair, build_labeled_pairs
from judgeloop.calibration.metrics import auc
from judgeloop.config import ConfigError, bounded, check_choices, check_fields
from judgeloop.data import DataConfig, SplitConfig, SummExample, load_examples, split_examples
from judgeloop.data.summarization import Candidate
from judgeloop.intervals import wilson_interval
from judgeloop.io import DataError
from judgeloop.judges import JudgeConfig, build_judge, models_of
from judgeloop.judges.base import VALID_STATUSES, Judge, Pair, combine_orders, merge_status
from judgeloop.judges.hacking import (
    ATTACKS,
    AttackOptions,
    DetectorConfig,
    build_attack,
    detect_hacks,
    hack_rates,
)
from judgeloop.logging import get_logger
from judgeloop.studies.calibration_lab import CalibratorOptions, build_calibrator

logger = get_logger(__name__)

STAGES = ("forward", "reverse", "debiased", "calibrated")
EXPERT_RATINGS = ["expert_coherence", "expert_consistency", "expert_fluency", "expert_relevance"]
SUMMEVAL_PATH = "../shared/data/summeval/summeval_dev.jsonl"


def _default_data() -> DataConfig:
    return DataConfig(format="summeval", path=SUMMEVAL_PATH, split=SplitConfig(calibration=0.5, test=0.5))


def _default_judges() -> dict[str, JudgeConfig | None]:
    return {
        "embedding": JudgeConfig(
            type="embedding", model="sentence-transformers/all-MiniLM-L6-v2", embedding_target="references"
        )
    }


@dataclass
class ProbeCalibrationConfig:
    """The calibrator each judge's debiased logit goes through (``calibration.*``).

    Attributes:
        method: a calibrator of :data:`judgeloop.calibration.CALIBRATORS` (default ``platt``).
        split: the articles it is fit on; never the test split the attacks are probed on.
        labels: how the split's candidate pairs are labeled (default: SummEval expert relevance).
        max_pairs_per_article: labeled candidate pairs kept per article (``null``: all).
        max_articles: the first this-many articles of the split (``null``: all).
        calibrator: the calibrator's own options, as ``judgeloop calibrate`` takes them.
    """

    method: str = "platt"
    split: Literal["calibration", "validation", "train"] = "calibration"
    labels: LabelConfig = field(default_factory=lambda: LabelConfig(type="human"))
    max_pairs_per_article: int | None = bounded(
        6, ge=1, message="{key}={value}; it must be at least 1 (null: no limit)"
    )
    max_articles: int | None = bounded(
        None, ge=1, message="{key}={value}; it must be at least 1 (null: no limit)"
    )
    calibrator: CalibratorOptions = field(default_factory=CalibratorOptions)

    def __post_init__(self) -> None:
        check_fields("calibration", self)
        if self.method not in CALIBRATORS or self.method == "raw":
            valid = sorted(set(CALIBRATORS) - {"raw"})
            raise ValueError(f"calibration.method={self.method!r} is not a calibrator; use one of {valid}")


@dataclass
class ProbeConfig:
    """Schema of ``judgeloop probe-judge``: data (its ``data.split`` fractions), judges, calibration,
    attacks, detectors and the report.

    Attributes:
        judges: name -> judge config; ``judges.NAME=null`` drops one from a config file's set.
        attacks: the attacks probed (:data:`judgeloop.judges.hacking.ATTACKS`); must include ``control``.
        attack_options: the attacks' knobs (verdict label, keyword count, repeats, lead length).
        detectors: the detectors' thresholds.
        honest_rating: the candidate ratings whose mean ranks the candidates (honest: best, weak: worst).
        max_test_articles: the first this-many test articles (``null``: all).
        confidence: of the Wilson and bootstrap intervals.
        bootstrap_samples: resamples of the paired bootstrap of each attack's lift over the control.
    """

    data: DataConfig = field(default_factory=_default_data)
    judges: dict[str, JudgeConfig | None] = field(default_factory=_default_judges)
    calibration: ProbeCalibrationConfig = field(default_factory=ProbeCalibrationConfig)
    attacks: list[str] = field(default_factory=lambda: list(ATTACKS))
    attack_options: AttackOptions = field(default_factory=AttackOptions)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    honest_rating: list[str] = field(default_factory=lambda: list(EXPERT_RATINGS))
    max_test_articles: int | None = bounded(
        None, ge=1, message="{key}={value}; it must be at least 1 (null: all)"
    )
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    confidence: float = bounded(0.95, gt=0, lt=1, message="{key}={value}; it must be in (0, 1), e.g. 0.95")
    bootstrap_samples: int = bounded(2000, ge=0, message="{key}={value}; use 0 to skip the bootstrap")
    output_dir: str = "runs/probe"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)
        check_choices("attacks", self.attacks, ATTACKS)
        if "control" not in self.attacks:
            raise ValueError(
                "attacks has no 'control' (the weak base alone), the row each attack's effect is read "
                "against; add it, e.g. attacks=[control,verdict_injection]"
            )
        if not self.active_judges:
            raise ValueError("judges is empty; name at least one, e.g. judges.embedding.type=embedding")
        if self.data.format != "summeval":
            raise ValueError(
                f"data.format={self.data.format}: probe-judge needs rated candidate summaries (the honest "
                "and weak summaries are the best- and worst-rated); use data.format=summeval"
            )
        if not self.honest_rating:
            raise ValueError(f"honest_rating is empty; name the ratings to rank by, e.g. {EXPERT_RATINGS}")

    @property
    def active_judges(self) -> dict[str, JudgeConfig]:
        """The judges to probe (those not set to null)."""
        return {name: j for name, j in self.judges.items() if j is not None}


@dataclass
class ProbeItem:
    """One adversarial pair: an attack's summary against the honest summary of one test article."""

    article_id: str
    attack: str
    article: str
    adversarial: str
    honest: str
    references: tuple[str, ...]
    extractive: tuple[str, ...]


@dataclass
class ProbeResult:
    """What :func:`probe` found: the report, and one row per (judge, attack, article)."""

    report: dict[str, Any]
    rows: list[dict[str, Any]]


def ci_key(confidence: float) -> str:
    """The report key of an interval at ``confidence``: ``ci95`` at 0.95."""
    return f"ci{round(100 * confidence):d}"


def mean_rating(cand: Candidate, dims: Sequence[str]) -> float | None:
    """The mean of ``cand``'s ratings on ``dims``; ``None`` when it lacks one of them."""
    if any(d not in cand.ratings for d in dims):
        return None
    return float(np.mean([cand.ratings[d] for d in dims]))


def honest_and_weak(ex: SummExample, dims: Sequence[str]) -> tuple[Candidate, Candidate] | None:
    """The best- and worst-rated candidates of ``ex`` (ties: the first in the data), or ``None`` when fewer
    than two distinct candidates are rated on every one of ``dims``."""
    rated = [(r, c) for c in ex.candidates if c.text.strip() and (r := mean_rating(c, dims)) is not None]
    if len(rated) < 2:
        return None
    best = max(rated, key=lambda rc: rc[0])
    worst = min(rated, key=lambda rc: rc[0])
    return (best[1], worst[1]) if best[1].text != worst[1].text and best[0] > worst[0] else None


def build_probe_items(examples: Sequence[SummExample], cfg: ProbeConfig) -> tuple[list[ProbeItem], int]:
    """The adversarial pairs of ``examples``, article-major (every attack of one article, then the next);
    also the number of articles skipped for want of two rated candidates."""
    items: list[ProbeItem] = []
    skipped = 0
    for ex in examples:
        hw = honest_and_weak(ex, cfg.honest_rating)
        if hw is None:
            skipped += 1
            continue
        honest, weak = hw
        for kind in cfg.attacks:
            adv = build_attack(kind, ex.article, honest.text, weak.text, cfg.attack_options)
            items.append(
                ProbeItem(ex.id, kind, ex.article, adv, honest.text, tuple(ex.neutral), tuple(ex.extractive))
            )
    return items, skipped


@dataclass
class OrderScores:
    """A judge's raw logits of a batch in both orders, their combination and one status per pair."""

    forward: np.ndarray
    reverse: np.ndarray
    debiased: np.ndarray
    status: list[str]

    @property
    def valid(self) -> np.ndarray:
        ok = np.array([s in VALID_STATUSES for s in self.status], dtype=bool)
        return ok & np.isfinite(self.forward) & np.isfinite(self.reverse)


def score_both_orders(judge: Judge, pairs: Sequence[Pair]) -> OrderScores:
    """``s(a, b)`` and ``s(b, a)`` of every pair, whether or not the judge debiases on its own (a debiasing
    judge returns both orders from one call; any other is called again on the swapped pairs)."""
    out = judge.score(pairs)
    if out.reverse is not None:
        forward, reverse, status = out.forward, out.reverse, list(out.status)
    else:
        back = judge.score([p.swapped() for p in pairs])
        forward, reverse = out.forward, back.forward
        status = [merge_status(a, b) for a, b in zip(out.status, back.status)]
    debiased = combine_orders(forward, reverse)
    valid = np.array([s in VALID_STATUSES for s in status], dtype=bool)
    debiased = np.where(valid, debiased, np.nan)
    return OrderScores(np.asarray(forward, float), np.asarray(reverse, float), debiased, status)


def _refs(judge: Judge, references: tuple[str, ...], extractive: tuple[str, ...]) -> tuple[str, ...]:
    return extractive if getattr(judge, "reference_style", "neutral") == "extractive" else references


def check_models(cfg: ProbeConfig) -> None:
    """Every judge's model resolves and its device is there, before any data or weights load."""
    from judgeloop.devices import resolve_device
    from judgeloop.models import check_model

    try:
        for name, jc in cfg.active_judges.items():
            resolve_device(jc.device, f"judges.{name}.device")
            for key, model, device in models_of(jc, f"judges.{name}"):
                resolve_device(device, key.removesuffix(".model") + ".device")
                check_model(model, key)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def split_articles(cfg: ProbeConfig) -> tuple[list[SummExample], list[SummExample], int]:
    """The calibration articles (of ``calibration.split``) and the test articles, each non-empty."""
    examples = load_examples(cfg.data)
    splits = split_examples(examples, cfg.data.split)
    fit_ex, test_ex = splits[cfg.calibration.split], splits["test"]
    fit_ex = fit_ex[: cfg.calibration.max_articles] if cfg.calibration.max_articles else fit_ex
    test_ex = test_ex[: cfg.max_test_articles] if cfg.max_test_articles else test_ex
    for name, key, items in (
        (cfg.calibration.split, f"data.split.{cfg.calibration.split}", fit_ex),
        ("test", "data.split.test", test_ex),
    ):
        if not items:
            raise DataError(
                f"the '{name}' split is empty ({len(examples)} articles, split fractions "
                f"calibration={cfg.data.split.calibration}, test={cfg.data.split.test}, "
                f"validation={cfg.data.split.validation}); raise {key}"
            )
    return fit_ex, test_ex, len(examples)


def calibration_pairs(cfg: ProbeConfig, fit_ex: Sequence[SummExample]) -> tuple[list[LabeledPair], Any]:
    """The labeled candidate pairs the calibrators (and judges that learn from labels) are fit on, checked
    against ``calibrator.min_points`` before any judging."""
    c = cfg.calibration
    pairs, stats = build_labeled_pairs(fit_ex, c.labels, cfg.seed, c.max_pairs_per_article)
    if len(pairs) < max(c.calibrator.min_points, 1):
        raise DataError(
            f"calibration.calibrator.min_points={c.calibrator.min_points} but the {c.split} split gives "
            f"{len(pairs)} labeled pairs ({len(fit_ex)} articles, labels.type={c.labels.type}); raise "
            f"data.split.{c.split} or calibration.max_pairs_per_article, or lower calibration.calibrator.min_points"
        )
    return pairs, stats


def fit_judge(
    judge: Judge, pairs: Sequence[LabeledPair], cfg: ProbeConfig
) -> tuple[Calibrator, dict[str, Any]]:
    """Fit a judge that learns from labels, then its calibrator on the debiased logits of ``pairs``."""
    judged = [Pair(p.article, p.a, p.b, _refs(judge, p.references, p.extractive)) for p in pairs]
    labels = np.array([p.label for p in pairs], dtype=float)
    if judge.learns_from_labels:
        judge.fit_labels(judged, [int(y) for y in labels])
    scored = score_both_orders(judge, judged)
    ok = scored.valid
    cal = build_calibrator(cfg.calibration.method, cfg.calibration.calibrator)
    feats = pair_feature_matrix(pairs, valid=ok)[ok] if cal.uses_features else None
    cal.fit(scored.debiased[ok], labels[ok], feats)
    info = {
        "n_fit": int(ok.sum()),
        # how well the debiased logit ranks the human labels: below 0.5, calibration turns verdicts around
        "fit_auc": auc(expit(scored.debiased[ok]), labels[ok]) if ok.any() else float("nan"),
        "fit_status": dict(Counter(scored.status)),
        "position_bias": _position_bias(scored),
        "fit_labels": bool(judge.learns_from_labels),
        # reversed (AUC < 0.5) or position-only: named first in the report (judgeloop.calibration.health)
        "health": judge_health(scored.forward[ok], scored.reverse[ok], labels[ok]),
    }
    return cal, info


def _position_bias(scored: OrderScores) -> float:
    ok = scored.valid
    return float(np.mean(scored.forward[ok] + scored.reverse[ok])) if ok.any() else float("nan")


def _rate(success: np.ndarray, confidence: float) -> dict[str, Any]:
    k, n = int(success.sum()), int(success.size)
    lo, hi = wilson_interval(k, n, confidence)
    return {"success_rate": k / n if n else float("nan"), ci_key(confidence): [lo, hi], "k": k}


def _bootstrap_ci(values: np.ndarray, cfg: ProbeConfig, rng: np.random.Generator) -> list[float]:
    """Percentile interval of the mean of ``values`` over resampled articles (NaN: none or no resamples)."""
    if values.size == 0 or cfg.bootstrap_samples == 0:
        return [float("nan"), float("nan")]
    idx = rng.integers(0, values.size, size=(cfg.bootstrap_samples, values.size))
    means = values[idx].mean(axis=1)
    alpha = (1 - cfg.confidence) / 2
    return [float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))]


def stage_successes(scored: OrderScores, p: np.ndarray) -> dict[str, np.ndarray]:
    """Per pair, whether the adversarial summary (``a``) wins at each stage; a failed judgement never does."""
    ok = scored.valid
    with np.errstate(invalid="ignore"):
        return {
            "forward": ok & (scored.forward > 0),
            "reverse": ok & (scored.reverse < 0),
            "debiased": ok & (scored.debiased > 0),
            "calibrated": ok & (p > 0.5),
        }


def summarize_attack(
    wins: dict[str, np.ndarray],
    p: np.ndarray,
    scored: OrderScores,
    control: dict[str, np.ndarray] | None,
    cfg: ProbeConfig,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """One attack's entry of the report: the final rate with its interval, the stages, failures, lift."""
    key, ok = ci_key(cfg.confidence), scored.valid
    stages = {s: _rate(wins[s], cfg.confidence) for s in STAGES}
    if control is not None:
        for s in STAGES:
            diff = wins[s].astype(float) - control[s].astype(float)
            stages[s]["lift_vs_control"] = {"value": float(diff.mean()), key: _bootstrap_ci(diff, cfg, rng)}
    final = stages["calibrated"]
    entry: dict[str, Any] = {
        "success_rate": final["success_rate"],
        key: final[key],
        "n": int(ok.size),
        "n_failed": int((~ok).sum()),
        "status": dict(Counter(scored.status)),
        "stages": stages,
        "mean_calibrated_p": float(np.mean(p[ok])) if ok.any() else float("nan"),
        f"mean_calibrated_p_{key}": _bootstrap_ci(p[ok], cfg, rng),
        "position_bias": _position_bias(scored),
    }
    if control is not None:
        entry["lift_vs_control"] = final["lift_vs_control"]
    return entry


def probe_one_judge(
    name: str, jc: JudgeConfig, items: Sequence[ProbeItem], fit_pairs: Sequence[LabeledPair], cfg: ProbeConfig
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Build one judge, fit it (and its calibrator) on the calibration pairs, probe every attack."""
    start = time.perf_counter()
    judge = build_judge(jc)
    cal, info = fit_judge(judge, fit_pairs, cfg)
    logger.info(
        "judge %s: fit on %d calibration pairs in %.1f s", name, len(fit_pairs), time.perf_counter() - start
    )
    pairs = [
        Pair(it.article, it.adversarial, it.honest, _refs(judge, it.references, it.extractive))
        for it in items
    ]
    scored = score_both_orders(judge, pairs)
    ok = scored.valid
    feats = features_for(
        cal,
        [it.article for it in items],
        [it.adversarial for it in items],
        [it.honest for it in items],
        valid=ok,
    )
    p = np.full(len(items), np.nan)
    if ok.any():
        p[ok] = cal.predict_proba(scored.debiased[ok], None if feats is None else feats[ok])
    wins = stage_successes(scored, p)
    kinds = np.array([it.attack for it in items])
    rng = np.random.default_rng(cfg.seed)
    control = {s: w[kinds == "control"] for s, w in wins.items()}
    attacks = {}
    for kind in cfg.attacks:
        m = kinds == kind
        sub = OrderScores(
            scored.forward[m], scored.reverse[m], scored.debiased[m], list(np.array(scored.status)[m])
        )
        w = {s: v[m] for s, v in wins.items()}
        attacks[kind] = summarize_attack(w, p[m], sub, None if kind == "control" else control, cfg, rng)
    rows = [
        {
            "judge": name,
            "attack": it.attack,
            "article_id": it.article_id,
            "forward": float(scored.forward[i]),
            "reverse": float(scored.reverse[i]),
            "debiased": float(scored.debiased[i]),
            "p_calibrated": float(p[i]),
            "status": scored.status[i],
            "adversarial": it.adversarial,
            "honest": it.honest,
            **{f"win_{s}": bool(wins[s][i]) for s in STAGES},
        }
        for i, it in enumerate(items)
    ]
    report = {
        "type": jc.type,
        "model": jc.model if jc.type != "panel" else " + ".join(m.model for m in jc.panel.members),
        "position_debias": bool(judge.position_debias),
        "learns_from_labels": bool(judge.learns_from_labels),
        "calibrator": cal.state_dict(),
        **info,
        # probe pairs whose verdict calibration turned around (a calibrator through p(0) = 0.5 with a
        # positive slope turns none)
        "calibration_flips": int((wins["calibrated"] != wins["debiased"]).sum()),
        "runtime_s": round(time.perf_counter() - start, 1),
        "attacks": attacks,
    }
    logger.info("judge %s probed in %.1f s", name, report["runtime_s"])
    return report, rows


def detector_report(
    items: Sequence[ProbeItem], test_ex: Sequence[SummExample], cfg: ProbeConfig
) -> dict[str, Any]:
    """The detectors' rates on each attack's summaries, on the honest summaries and, as false positives, on
    the test articles' human references."""
    d = cfg.detectors
    by_kind = {
        k: hack_rates(
            [i.article for i in items if i.attack == k], [i.adversarial for i in items if i.attack == k], d
        )
        for k in cfg.attacks
    }
    honest = {i.article_id: (i.article, i.honest) for i in items}
    refs = [(ex.article, r) for ex in test_ex for r in ex.neutral]
    return {
        "thresholds": asdict(d),
        "attacks": by_kind,
        "honest": hack_rates([a for a, _ in honest.values()], [s for _, s in honest.values()], d),
        "references": hack_rates([a for a, _ in refs], [r for _, r in refs], d),
        "n_references": len(refs),
    }


def probe(cfg: ProbeConfig) -> ProbeResult:
    """Check, split, build the attacks, probe every judge; returns the report and the per-pair rows."""
    start = time.perf_counter()
    check_models(cfg)
    fit_ex, test_ex, n_articles = split_articles(cfg)
    items, skipped = build_probe_items(test_ex, cfg)
    if not items:
        raise DataError(
            f"no test article has two candidates rated on {cfg.honest_rating}; check honest_rating "
            "(SummEval's are expert_* and turker_* of coherence, consistency, fluency, relevance)"
        )
    fit_pairs, label_stats = calibration_pairs(cfg, fit_ex)
    logger.info(
        "probe: %d test articles x %d attacks, %d calibration pairs",
        len(items) // len(cfg.attacks),
        len(cfg.attacks),
        len(fit_pairs),
    )
    judges: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    flags = [detect_hacks(it.article, it.adversarial, cfg.detectors).as_dict() for it in items]
    for name, jc in cfg.active_judges.items():
        judges[name], judge_rows = probe_one_judge(name, jc, items, fit_pairs, cfg)
        rows += [{**r, "detected": f} for r, f in zip(judge_rows, flags)]
    report = {
        "articles": {
            "calibration": len(fit_ex),
            "test": len(items) // len(cfg.attacks),
            "test_skipped": skipped,
            "total": n_articles,
        },
        "honest_rating": list(cfg.honest_rating),
        "attacks": list(cfg.attacks),
        "confidence": cfg.confidence,
        "calibration": {
            "method": cfg.calibration.method,
            "split": cfg.calibration.split,
            "labels": asdict(cfg.calibration.labels),
            "n_pairs": len(fit_pairs),
            "label_stats": label_stats.as_dict(),
        },
        "judges": judges,
        "detectors": detector_report(items, test_ex, cfg),
        "runtime_s": round(time.perf_counter() - start, 1),
    }
    return ProbeResult(report, rows)
