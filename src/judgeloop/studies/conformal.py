"""The conformal retrieval study behind ``judgeloop conformal``: the schema, the random-split trials,
the online (static / sliding window / ACI) comparison, and the report.

:func:`conformal_study` retrieves the top-K candidates once, then, for each of ``num_trials`` random
calibration/test splits of the queries, fits the (Mondrian) conformal threshold on the calibration
queries and measures coverage and set size on the test queries. The threshold is ``tau(alpha, beta)``
from each group's base rate (``conformal.threshold_rule=base_rate``, the default) or the plain split-conformal
quantile (``quantile``); groups in ``conformal.holdout_groups`` never calibrate, so they are tested as
unseen groups (the most conservative threshold); ``conformal.max_set_size`` caps the sets and the report
gives what the cap costs in coverage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from judgeloop.config import Bound, bounded, check_fields
from judgeloop.io import DataError
from judgeloop.logging import get_logger
from judgeloop.retrieval.conformal import (
    MOST_CONSERVATIVE,
    AdaptiveConformal,
    ConformalRetriever,
    base_rates,
    conformal_quantile,
    coverage_and_size,
    map_scores,
    nonconformity,
)
from judgeloop.retrieval.dense import (
    EncoderConfig,
    RetrievalDataConfig,
    RetrievedQueries,
    load_retrieval_data,
    query_groups,
    retrieve_dense,
)
from judgeloop.text import fmt_number

logger = get_logger(__name__)


@dataclass
class ConformalSection:
    """The conformal sets: levels, guarantee, candidate depth, score map, threshold rule, base rates, cap."""

    alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2])
    guarantee: Literal["document", "any", "all", "labels"] = "document"
    top_k: int = bounded(1000, ge=2, shape="section")
    score_map: Literal["affine", "softmax", "identity"] = "affine"
    temperature: float = bounded(0.05, gt=0, hint=" (a sampling / softmax temperature)")
    # "base_rate": tau(alpha, beta) from each group's base rate (the share of its calibration points whose
    # relevant document is among the top_k candidates) and that rate's beta interval; "quantile": the plain
    # split-conformal quantile (judgeloop.retrieval.conformal)
    threshold_rule: Literal["quantile", "base_rate"] = "base_rate"
    min_group_size: int = bounded(50, ge=1, hint=" (queries a group needs for its own threshold)")
    base_rate_k: int = bounded(10, ge=1, hint=" (the depth of the base rate's top-k)")
    RENAMED: ClassVar[dict[str, str]] = {"confidence": "beta"}
    beta: float = bounded(
        0.95, gt=0.0, lt=1.0, hint=" (the base rate interval's confidence level)", shape="section"
    )
    interval: Literal["wilson", "clopper_pearson"] = "wilson"
    max_set_size: int | None = bounded(None, ge=1, hint=" or null (no cap)", shape="section")
    holdout_groups: list[str] = field(default_factory=list)  # never calibrate: tested as unseen groups

    def __post_init__(self) -> None:
        check_fields("conformal", self)
        bad = [a for a in self.alphas if not 0.0 < a < 1.0]
        if not self.alphas or bad:
            raise ValueError(f"conformal.alphas={self.alphas} must be a non-empty list of values in (0, 1)")
        if self.max_set_size is not None and self.guarantee == "labels":
            raise ValueError(
                f"conformal.max_set_size={self.max_set_size} caps a retrieval set, but conformal.guarantee=labels "
                "gives per-document label sets (at most 2 labels each); unset conformal.max_set_size"
            )
        if self.max_set_size is not None and self.max_set_size > self.top_k:
            raise ValueError(
                f"conformal.max_set_size={self.max_set_size} exceeds conformal.top_k={self.top_k}: the cap keeps "
                "the best candidates of the top_k; lower the cap or raise conformal.top_k"
            )
        dup = sorted({g for g in self.holdout_groups if self.holdout_groups.count(g) > 1})
        if dup:
            raise ValueError(
                f"conformal.holdout_groups={self.holdout_groups} names {dup} twice; name each once"
            )


@dataclass
class OnlineConfig:
    """The online comparison: static vs sliding-window vs adaptive (ACI) conformal."""

    enabled: bool = True
    alpha: float = bounded(0.1, gt=0.0, lt=1.0, hint="; e.g. online.alpha=0.1", shape="section")
    gamma: float = bounded(
        0.01,
        Bound(0, 1, "[]", " (the ACI step size; 0 = window only)"),
        ge=0.0,
        hint=" (the ACI step size; 0 = window only)",
        shape="section",
    )
    window: int = bounded(200, ge=1, shape="section")
    warmup: int = bounded(50, ge=1, hint=" (the static quantile needs points)", shape="section")
    monitor_window: int = bounded(100, ge=1, shape="section")
    tolerance: float = bounded(0.05, ge=0.0, lt=1.0, shape="section")
    # set-size alarm: on while the mean set size of the last monitor_window steps exceeds this (null: off)
    max_mean_set_size: float | None = bounded(
        None, gt=0.0, hint=" (documents) or null (no set-size alarm)", shape="section"
    )

    def __post_init__(self) -> None:
        check_fields("online", self)


@dataclass
class ConformalConfig:
    """Schema of ``judgeloop conformal``."""

    data: RetrievalDataConfig = field(default_factory=RetrievalDataConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    conformal: ConformalSection = field(default_factory=ConformalSection)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    num_trials: int = bounded(100, ge=1, shape="section")
    calibration_fraction: float = bounded(0.5, gt=0.0, lt=1.0, hint="; e.g. 0.5", shape="section")
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/conformal"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    cache_dir: str | None = "auto"  # the judgeloop cache (embedding_cache.resolve_cache_dir); None: none

    def __post_init__(self) -> None:
        check_fields("", self)
        held = self.conformal.holdout_groups
        if held and self.data.group_field is None:  # the built-in groups' names are known before any work
            labels = builtin_group_labels(self.data.grouping, self.data.num_buckets)
            check_holdout_groups(held, labels, f"data.grouping={self.data.grouping}")


def builtin_group_labels(grouping: str, num_buckets: int) -> list[str]:
    """The group names of a built-in grouping (:func:`judgeloop.retrieval.dense.query_groups`)."""
    if grouping == "none":
        return ["all"]
    prefix = "length" if grouping == "query_length" else "top1"
    return [f"{prefix}/{i}" for i in range(1, num_buckets + 1)]


def check_holdout_groups(held: list[str], labels: list[str], where: str) -> None:
    """``conformal.holdout_groups`` must name groups that exist and leave one to calibrate on.

    Raises:
        ValueError: one line naming the key, the value, the groups there are and the fix.
    """
    unknown = [g for g in held if g not in labels]
    if unknown:
        raise ValueError(
            f"conformal.holdout_groups={held}: no group {unknown} under {where} (groups: {sorted(labels)}); "
            "name groups that exist, or set conformal.holdout_groups=[]"
        )
    if set(labels) <= set(held):
        raise ValueError(
            f"conformal.holdout_groups={held} holds out every group under {where}; leave at least one to calibrate on"
        )


def _weighted_mean(x: np.ndarray, w: np.ndarray) -> float:
    return float((x * w).sum() / w.sum()) if w.sum() > 0 else math.nan


def _spread(x: list[float]) -> dict[str, float]:
    a = np.asarray(x, dtype=float)
    return {
        "std": float(a.std()),
        "min": float(a.min()),
        "p05": float(np.quantile(a, 0.05)),
        "p95": float(np.quantile(a, 0.95)),
        "max": float(a.max()),
    }


def _finite_mean(x: list[float]) -> float:
    a = np.asarray(x, dtype=float)
    return float(a.mean()) if np.isfinite(a).all() else math.inf


def _nan_mean(x: list[float]) -> float:
    a = np.asarray(x, dtype=float)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else math.nan


GROUP_KEYS = ("coverage", "size", "threshold", "n_cal", "source", "rate", "low", "alpha_eff", "expected")
CAP_KEYS = ("coverage_capped", "size_capped", "capped")


def run_trials(
    scores: np.ndarray,
    relevant: np.ndarray,
    num_missing: np.ndarray,
    groups: np.ndarray,
    alpha: float,
    section: ConformalSection,
    num_trials: int,
    calibration_fraction: float,
    corpus_size: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Fit on a random calibration split and measure on the rest, ``num_trials`` times.

    Queries of ``section.holdout_groups`` never calibrate and are tested in every trial (unseen groups);
    ``calibration_fraction`` splits the others. With ``section.max_set_size`` every test set is measured
    twice, free and capped.

    Returns the report entry for one ``alpha``: global and per-group mean coverage / set size over
    trials, their spread, thresholds and where each group's threshold came from, the base rate behind
    each threshold (``threshold_rule=base_rate``), the rule's expected coverage, and the cap's cost.
    """

    rng = np.random.default_rng(seed)
    n = scores.shape[0]
    held_mask = np.isin(groups, list(section.holdout_groups))
    pool, held = np.flatnonzero(~held_mask), np.flatnonzero(held_mask)
    n_cal = int(round(calibration_fraction * pool.size))
    if n_cal < 1 or n_cal >= pool.size:
        raise ValueError(
            f"calibration_fraction={calibration_fraction} leaves an empty side with {pool.size} queries"
        )
    cap = section.max_set_size
    labels = sorted(set(groups.tolist()))
    glob: dict[str, list[float]] = {
        k: [] for k in ("cov", "size", "thr", "full", "cov_cap", "size_cap", "capped")
    }
    g_stats: dict[str, dict[str, list[Any]]] = {g: {k: [] for k in GROUP_KEYS + CAP_KEYS} for g in labels}
    for _ in range(num_trials):
        perm = rng.permutation(pool)
        cal, test = perm[:n_cal], np.concatenate([perm[n_cal:], held])
        model = ConformalRetriever(
            alpha,
            section.guarantee,
            section.min_group_size,
            threshold_rule=section.threshold_rule,
            beta=section.beta,
            interval=section.interval,
            log_unseen=False,  # one line per group and alpha below, not one per trial
        ).fit(scores[cal], relevant[cal], num_missing[cal], groups[cal].tolist())
        q = model.thresholds_for(test.size, groups[test].tolist())
        args = (scores[test], relevant[test], num_missing[test], q, section.guarantee, corpus_size)
        out = coverage_and_size(*args)  # type: ignore[arg-type]
        glob["cov"].append(_weighted_mean(out["covered"], out["weight"]))
        glob["size"].append(float(out["size"].mean()))
        glob["thr"].append(model.threshold_)
        glob["full"].append(float(out["full"].mean()))
        capped = coverage_and_size(*args, max_set_size=cap) if cap is not None else None  # type: ignore[arg-type]
        if capped is not None:
            glob["cov_cap"].append(_weighted_mean(capped["covered"], capped["weight"]))
            glob["size_cap"].append(float(capped["size"].mean()))
            glob["capped"].append(float(capped["capped"].mean()))
        for g in labels:
            _record_group(g_stats[g], model, g, groups[test] == g, out, capped, alpha)

    cov, thr = glob["cov"], glob["thr"]
    result: dict[str, Any] = {
        "alpha": alpha,
        "guarantee": section.guarantee,
        "threshold_rule": section.threshold_rule,
        "target": 1.0 - alpha,
        "num_trials": num_trials,
        "n_cal_queries": n_cal,
        "n_test_queries": int(n - n_cal),
        "coverage": float(np.mean(cov)),
        "coverage_spread": _spread(cov),
        "mean_set_size": float(np.mean(glob["size"])),
        "set_size_spread": _spread(glob["size"]),
        "threshold": _finite_mean(thr),
        "frac_trials_infinite_threshold": float(np.mean(~np.isfinite(thr))),
        "frac_test_queries_full_corpus": float(np.mean(glob["full"])),
        "groups": {g: _group_entry(g_stats[g], g, alpha, section, num_trials) for g in labels},
    }
    if cap is not None:
        result["cap"] = {
            "max_set_size": cap,
            "coverage": float(np.mean(glob["cov_cap"])),
            "mean_set_size": float(np.mean(glob["size_cap"])),
            "coverage_cost": float(np.mean(cov) - np.mean(glob["cov_cap"])),
            "frac_test_queries_capped": float(np.mean(glob["capped"])),
        }
    return result


def _record_group(
    st: dict[str, list[Any]],
    model: ConformalRetriever,
    group: str,
    mask: np.ndarray,
    out: dict[str, np.ndarray],
    capped: dict[str, np.ndarray] | None,
    alpha: float,
) -> None:
    """One trial's figures for one group: its threshold, where it came from, its base rate, and its test
    queries' (``mask``) coverage and set size, free (``out``) and capped."""
    t, src = model.group_threshold(group)
    fit = model.groups_.get(group)
    st["n_cal"].append(fit.n_cal if fit else 0)
    st["threshold"].append(t)
    st["source"].append(src)
    info = model.base_rates_.get(group) if src == "own" else None
    for k in ("rate", "low", "alpha_eff"):
        st[k].append(info[k] if info else math.nan)
    st["expected"].append(_expected_coverage(model, group, src, alpha, info))
    if mask.any() and out["weight"][mask].sum() > 0:
        st["coverage"].append(_weighted_mean(out["covered"][mask], out["weight"][mask]))
        st["size"].append(float(out["size"][mask].mean()))
        if capped is not None:
            st["coverage_capped"].append(_weighted_mean(capped["covered"][mask], capped["weight"][mask]))
            st["size_capped"].append(float(capped["size"][mask].mean()))
            st["capped"].append(float(capped["capped"][mask].mean()))


def _group_entry(
    st: dict[str, list[Any]], group: str, alpha: float, section: ConformalSection, num_trials: int
) -> dict[str, Any]:
    """One group's report entry over the trials; logs one line if it was unseen in some trials."""
    sources: dict[str, int] = {}
    for src in st["source"]:
        sources[src] = sources.get(src, 0) + 1
    c = np.asarray(st["coverage"], dtype=float)
    se = float(c.std() / math.sqrt(c.size)) if c.size else math.nan
    entry: dict[str, Any] = {
        "n_cal": float(np.mean(st["n_cal"])),
        "coverage": float(c.mean()) if c.size else math.nan,
        "coverage_std": float(c.std()) if c.size else math.nan,
        # the standard error of the mean over trials; the band's low end is 1 - alpha - 2 se
        "coverage_se": se,
        "in_band": bool(c.size and c.mean() >= 1.0 - alpha - 2 * se),
        "expected_coverage": _nan_mean(st["expected"]),
        "mean_set_size": float(np.mean(st["size"])) if st["size"] else math.nan,
        "threshold": _finite_mean(st["threshold"]),
        "frac_trials_infinite_threshold": float(
            np.mean(~np.isfinite(np.asarray(st["threshold"], dtype=float)))
        ),
        "threshold_source": sources,
    }
    if section.threshold_rule == "base_rate":
        entry["base_rate"] = {k: _nan_mean(st[k]) for k in ("rate", "low", "alpha_eff")}
    if section.max_set_size is not None and st["coverage_capped"]:
        entry["cap"] = {
            "coverage": float(np.mean(st["coverage_capped"])),
            "mean_set_size": float(np.mean(st["size_capped"])),
            "coverage_cost": float(c.mean() - np.mean(st["coverage_capped"])),
            "frac_test_queries_capped": float(np.mean(st["capped"])),
        }
    unseen = sources.get(MOST_CONSERVATIVE, 0)
    if unseen:
        taus = [t for t, src in zip(st["threshold"], st["source"]) if src == MOST_CONSERVATIVE]
        logger.info(
            "alpha=%s: unseen group %r (no calibration data in %d of %d trials) gets the most conservative "
            "threshold, tau=%s (mean over those trials)",
            alpha,
            group,
            unseen,
            num_trials,
            _fmt(_finite_mean(taus), 4),
        )
    return entry


def _expected_coverage(
    model: ConformalRetriever, group: str, source: str, alpha: float, info: dict[str, float] | None
) -> float:
    """The coverage the fitted rule aims at for ``group`` (continuous scores, no ties): the plain rule's
    ``j / (n + 1)`` with ``j = ceil((n + 1)(1 - alpha))``, or the base-rate rule's ``(k / n) * j' / (k + 1)``
    with ``j' = ceil((k + 1)(1 - alpha'))``; 1 for an infinite threshold; NaN for a borrowed threshold."""
    if source != "own":
        return math.nan
    if not math.isfinite(model.groups_[group].threshold):
        return 1.0
    if info is None:  # the plain quantile
        n = model.groups_[group].n_cal
        return min(1.0, math.ceil((n + 1) * (1.0 - alpha) - 1e-9) / (n + 1))
    n_all, k, a = info["n"], info["k"], info["alpha_eff"]
    return (k / n_all) * min(1.0, math.ceil((k + 1) * (1.0 - a) - 1e-9) / (k + 1))


def _sizes(candidates: list[np.ndarray], thresholds: np.ndarray | float) -> np.ndarray:
    """``(T,)`` set size per step: candidates with ``1 - s <= q``; ``inf`` for an infinite threshold."""
    q = np.broadcast_to(np.asarray(thresholds, dtype=float), (len(candidates),))
    return np.asarray(
        [math.inf if not math.isfinite(t) else float((c <= t).sum()) for c, t in zip(candidates, q)]
    )


def _size_summary(sizes: np.ndarray) -> dict[str, float]:
    finite = sizes[np.isfinite(sizes)]
    return {
        "median_set_size": float(np.median(sizes)) if sizes.size else math.nan,
        "mean_finite_set_size": float(finite.mean()) if finite.size else math.nan,
        "frac_whole_corpus": float(np.mean(~np.isfinite(sizes))) if sizes.size else math.nan,
    }


def online_report(
    values: np.ndarray,
    order: np.ndarray,
    cfg: OnlineConfig,
    label: str,
    candidates: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Static threshold vs sliding window vs ACI on one stream of nonconformity scores.

    ``candidates``: per point (in ``values``' order), ``1 - s`` of its query's top-K candidates, to log set
    sizes and run the set-size alarm (``cfg.max_mean_set_size``).
    """

    stream = values[order]
    cands = None if candidates is None else [candidates[i] for i in order]
    warm = min(cfg.warmup, stream.size // 2)
    static_q = conformal_quantile(stream[:warm], cfg.alpha)
    rest = stream[warm:]
    rest_cands = None if cands is None else cands[warm:]
    out: dict[str, Any] = {"stream": label, "length": int(rest.size), "warmup": warm, "alpha": cfg.alpha}
    out["static"] = {"coverage": float(np.mean(rest <= static_q)), "threshold": static_q}
    if rest_cands is not None:
        out["static"].update(_size_summary(_sizes(rest_cands, static_q)))
    out["max_mean_set_size"] = cfg.max_mean_set_size
    for name, gamma in (("sliding_window", 0.0), ("aci", cfg.gamma)):
        aci = AdaptiveConformal(
            cfg.alpha,
            gamma,
            cfg.window,
            warmup=0,
            monitor_window=cfg.monitor_window,
            tolerance=cfg.tolerance,
            max_mean_set_size=cfg.max_mean_set_size,
        ).fit(stream[:warm])
        r = aci.run(rest, rest_cands)
        half = rest.size // 2
        out[name] = {
            "coverage": float(r["covered"].mean()),
            "coverage_first_half": float(r["covered"][:half].mean()),
            "coverage_second_half": float(r["covered"][half:].mean()),
            "num_alarm_steps": int(r["alarm"].sum()),
            "final_alpha_t": float(r["alpha_t"][-1]),
        }
        if rest_cands is not None:
            out[name].update(_size_summary(r["size"]))
            out[name]["num_size_alarm_steps"] = int(r["size_alarm"].sum())
    return out


def conformal_study(cfg: ConformalConfig) -> dict[str, Any]:
    """Retrieve once, run the trials for every alpha and the online comparison; returns the report."""
    beir, rows = load_retrieval_data(cfg.data)
    c = cfg.conformal
    if c.holdout_groups and cfg.data.group_field is not None:  # before any encoding
        field_ = cfg.data.group_field
        labels = sorted({str(rows[q][field_]) for q in beir.queries if field_ in rows.get(q, {})})
        try:
            check_holdout_groups(c.holdout_groups, labels, f"data.group_field={field_}")
        except ValueError as err:
            raise DataError(f"{cfg.data.queries_path}: {err}") from None
    rq = retrieve_dense(beir, cfg.encoder, c.top_k, cfg.cache_dir)
    groups = query_groups(rq, cfg.data, rows)
    scores = map_scores(rq.raw_scores, c.score_map, c.temperature)  # (Q, K) in [0, 1]
    n_rel = rq.relevant.sum() + rq.num_missing.sum()
    recall_k = float(rq.relevant.sum() / n_rel)
    k_br = min(c.base_rate_k, rq.relevant.shape[1])
    success = np.asarray(rq.relevant[:, :k_br].any(axis=1), dtype=bool)  # (Q,)
    logger.info(
        "%d queries, %d docs, recall@%d = %.4f", len(rq.query_ids), len(rq.doc_ids), c.top_k, recall_k
    )

    # base rates on the calibration half of the first split (what a deployed system would estimate)
    rng = np.random.default_rng(cfg.seed)
    pool = np.flatnonzero(~np.isin(groups, list(c.holdout_groups)))
    perm = rng.permutation(pool)
    cal0 = perm[: int(round(cfg.calibration_fraction * len(perm)))]
    rates = base_rates(success[cal0], groups[cal0].tolist(), c.beta, c.interval)

    results = []
    for alpha in c.alphas:
        logger.info("alpha=%.3f: %d trials", alpha, cfg.num_trials)
        res = run_trials(
            scores,
            rq.relevant,
            rq.num_missing,
            groups,
            alpha,
            c,
            cfg.num_trials,
            cfg.calibration_fraction,
            len(rq.doc_ids),
            seed=cfg.seed,
        )
        res["why_infinite"] = _why_infinite(res, rq, alpha, cfg)
        results.append(res)

    online: list[dict[str, Any]] = []
    if cfg.online.enabled and c.guarantee != "labels":
        values, q_idx = nonconformity(scores, rq.relevant, rq.num_missing, c.guarantee)  # type: ignore[arg-type]
        cands = [1.0 - scores[i] for i in q_idx]  # each point's query's candidates, for the set sizes
        shuffled = np.random.default_rng(cfg.seed + 1).permutation(values.size)
        online.append(online_report(values, shuffled, cfg.online, "random order (exchangeable)", cands))
        # real drift: easy queries (high top-1 score) first, hard ones last
        hard_last = np.argsort(-rq.raw_scores[q_idx, 0], kind="stable")
        online.append(
            online_report(values, hard_last, cfg.online, "sorted by top-1 score, hardest last (drift)", cands)
        )

    report: dict[str, Any] = {
        "data": {
            "corpus_path": cfg.data.corpus_path,
            "queries_path": cfg.data.queries_path,
            "num_queries": len(rq.query_ids),
            "corpus_size": len(rq.doc_ids),
            "num_relevant_pairs": int(n_rel),
            "grouping": cfg.data.group_field or cfg.data.grouping,
        },
        "encoder": cfg.encoder.name,
        "pooling": cfg.encoder.pooling,
        "score_map": c.score_map,
        "top_k": c.top_k,
        "tau": {"threshold_rule": c.threshold_rule, "beta": c.beta, "interval": c.interval},
        "max_set_size": c.max_set_size,
        "holdout_groups": list(c.holdout_groups),
        f"recall_at_{c.top_k}": recall_k,
        f"base_rate_at_{k_br}": rates,
        "results": results,
        "online": online,
    }
    if len(results) == 1:
        report.update(results[0])
    return report


def _why_infinite(
    res: dict[str, Any], rq: RetrievedQueries, alpha: float, cfg: ConformalConfig
) -> str | None:
    if res["frac_trials_infinite_threshold"] == 0 and all(
        g["frac_trials_infinite_threshold"] == 0 for g in res["groups"].values()
    ):
        return None
    missing = int(rq.num_missing.sum())
    total = int(rq.relevant.sum() + missing)
    head = (
        f"{missing} of {total} relevant documents ({missing / total:.1%}) lie outside the top-"
        f"{cfg.conformal.top_k}; they score +inf. "
    )
    if cfg.conformal.threshold_rule == "base_rate":
        return head + (
            f"tau(alpha, beta) asks a group's k in-pool points for level (1 - alpha) / pi_low; when pi_low, the low "
            f"end of the base rate's beta={cfg.conformal.beta} interval, is below 1 - alpha = {1 - alpha:.2f}, or "
            "ceil((k+1)(1-alpha')) > k (few points: a wide interval), the only set with the guarantee is the whole "
            "corpus (coverage 1). Raise alpha, lower conformal.beta, raise conformal.top_k, or calibrate on more "
            "queries per group."
        )
    return head + (
        f"When more than about alpha={alpha} of a calibration set is missing (or n is too small for "
        "ceil((n+1)(1-alpha)) <= n), the only set with the guarantee is the whole corpus (coverage 1). "
        "Raise conformal.top_k or alpha."
    )


def _fmt(x: Any, nd: int = 3) -> str:
    return fmt_number(x, nd, none="inf")  # a None threshold is an infinite one


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    d = report["data"]
    lines = [
        "# Conformal retrieval report",
        "",
        f"- data: `{d['queries_path']}`: {d['num_queries']} queries, {d['num_relevant_pairs']} relevant pairs, "
        f"corpus of {d['corpus_size']} documents",
        f"- encoder: `{report['encoder']}` ({report['pooling']} pooling); score map `{report['score_map']}`; "
        f"top-K = {report['top_k']}, recall@K = {_fmt(report['recall_at_' + str(report['top_k'])], 4)}",
        f"- groups: `{d['grouping']}`",
    ]
    rule = report.get("tau", {"threshold_rule": "quantile"})
    if rule["threshold_rule"] == "base_rate":
        lines.append(
            f"- threshold rule: `base_rate`, tau(alpha, beta) with beta = {rule['beta']} ({rule['interval']} interval "
            "of each group's base rate: the share of its calibration points whose relevant document is among the "
            "top-K candidates; the conditional level is (1 - alpha) / pi_low)"
        )
    else:
        lines.append("- threshold rule: `quantile`, the plain split-conformal quantile per group")
    if report.get("holdout_groups"):
        lines.append(
            f"- held out of calibration (unseen groups, given the most conservative threshold): "
            f"{', '.join(f'`{g}`' for g in report['holdout_groups'])}"
        )
    cap = report.get("max_set_size")
    if cap is not None:
        lines.append(
            f"- sets capped at the best {cap} candidates (`conformal.max_set_size`); both sides reported"
        )
    lines += [
        "",
        "Coverage is checked over random calibration/test splits of the queries. A single split of a few "
        "hundred points moves coverage by several points by chance (see the per-trial spread below), which is "
        "why the means over trials are what to compare with 1 - alpha. A group is *in its band* when its mean "
        "coverage is at least 1 - alpha - 2 se (se: the standard error of the mean over trials); *expected* is "
        "the coverage the fitted rule aims at (continuous scores; see `_expected_coverage`).",
        "",
        "| alpha | target | guarantee | mean coverage | coverage std | p05-p95 | mean set size | threshold | trials inf |"
        + (" capped coverage | cost | capped set size |" if cap is not None else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if cap is not None else ""),
    ]
    for r in report["results"]:
        sp = r["coverage_spread"]
        row = (
            f"| {r['alpha']} | {r['target']:.2f} | {r['guarantee']} | {_fmt(r['coverage'], 4)} | {_fmt(sp['std'], 4)} | "
            f"{_fmt(sp['p05'])}-{_fmt(sp['p95'])} | {_fmt(r['mean_set_size'], 1)} | {_fmt(r['threshold'])} | "
            f"{_fmt(r['frac_trials_infinite_threshold'], 2)} |"
        )
        if "cap" in r:
            row += f" {_fmt(r['cap']['coverage'], 4)} | {_fmt(r['cap']['coverage_cost'], 4)} | {_fmt(r['cap']['mean_set_size'], 1)} |"
        lines.append(row)
    for r in report["results"]:
        lines += [
            "",
            f"## alpha = {r['alpha']} ({r['num_trials']} trials, {r['n_cal_queries']} calibration / "
            f"{r['n_test_queries']} test queries)",
            "",
        ]
        if r.get("why_infinite"):
            lines += [f"**Infinite thresholds:** {r['why_infinite']}", ""]
        lines += _group_table(r)
    lines += _rates_and_online(report)
    return "\n".join(lines) + "\n"


def _group_table(r: dict[str, Any]) -> list[str]:
    """One alpha's per-group table (markdown lines)."""
    base = r.get("threshold_rule") == "base_rate"
    capped = "cap" in r
    lines = [
        "| group | mean n_cal |"
        + (" base rate | pi_low | alpha' |" if base else "")
        + " coverage | ± 2 se | expected | in band | mean set size | threshold | trials inf | source (trials) |"
        + (" capped coverage | cost | capped set size |" if capped else ""),
        "|---|---|"
        + ("---|---|---|" if base else "")
        + "---|---|---|---|---|---|---|---|"
        + ("---|---|---|" if capped else ""),
    ]
    for g, s in r["groups"].items():
        src = ", ".join(f"{k}: {v}" for k, v in s["threshold_source"].items())
        row = f"| {g} | {s['n_cal']:.1f} |"
        if base:
            b = s["base_rate"]
            row += f" {_fmt(b['rate'], 4)} | {_fmt(b['low'], 4)} | {_fmt(b['alpha_eff'], 4)} |"
        row += (
            f" {_fmt(s['coverage'], 4)} | {_fmt(2 * s['coverage_se'], 4)} | {_fmt(s['expected_coverage'], 4)} | "
            f"{'yes' if s['in_band'] else '**no**'} | {_fmt(s['mean_set_size'], 1)} | {_fmt(s['threshold'])} | "
            f"{_fmt(s['frac_trials_infinite_threshold'], 2)} | {src} |"
        )
        if capped:
            c = s.get("cap")
            row += (
                f" {_fmt(c['coverage'], 4)} | {_fmt(c['coverage_cost'], 4)} | {_fmt(c['mean_set_size'], 1)} |"
                if c
                else " - | - | - |"
            )
        lines.append(row)
    return lines


def _rates_and_online(report: dict[str, Any]) -> list[str]:
    """The success-rate table and the online tables (markdown lines)."""
    rates_key = next(k for k in report if k.startswith("base_rate_at_"))
    lines = [
        "",
        f"## Success rates ({rates_key.replace('_', ' ')}, calibration half of split 0; reported, not used "
        "by the threshold)",
        "",
        "| group | n | successes | rate | CI |",
        "|---|---|---|---|---|",
    ]
    for g, s in report[rates_key].items():
        lines.append(
            f"| {g} | {s['n']} | {s['successes']} | {_fmt(s['rate'])} | [{_fmt(s['low'])}, {_fmt(s['high'])}] |"
        )
    if report["online"]:
        lines += [
            "",
            "## Online: static vs sliding window vs ACI",
            "",
            "| stream | alpha | static | sliding window | ACI | ACI 1st / 2nd half | ACI alarm steps | window alarm steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for o in report["online"]:
            a, w = o["aci"], o["sliding_window"]
            lines.append(
                f"| {o['stream']} | {o['alpha']} | {_fmt(o['static']['coverage'])} | {_fmt(w['coverage'])} | "
                f"{_fmt(a['coverage'])} | {_fmt(a['coverage_first_half'])} / {_fmt(a['coverage_second_half'])} | "
                f"{a['num_alarm_steps']} | {w['num_alarm_steps']} |"
            )
        if "median_set_size" in report["online"][0]["aci"]:
            limit = report["online"][0].get("max_mean_set_size")
            lines += [
                "",
                "Set sizes per step (median; mean of the finite ones; share of whole-corpus sets) and the set-size "
                + (
                    f"alarm (rolling mean set size > {limit}):"
                    if limit is not None
                    else "alarm (off: `online.max_mean_set_size` unset):"
                ),
                "",
                "| stream | static | sliding window | ACI | window size-alarm steps | ACI size-alarm steps |",
                "|---|---|---|---|---|---|",
            ]

            def sz(x: dict[str, Any]) -> str:
                return f"{_fmt(x['median_set_size'], 1)}; {_fmt(x['mean_finite_set_size'], 1)}; {_fmt(x['frac_whole_corpus'], 3)}"

            for o in report["online"]:
                a, w = o["aci"], o["sliding_window"]
                lines.append(
                    f"| {o['stream']} | {sz(o['static'])} | {sz(w)} | {sz(a)} | {w['num_size_alarm_steps']} | "
                    f"{a['num_size_alarm_steps']} |"
                )
    return lines
