"""The conformal retrieval study behind ``judgeloop conformal``: the schema, the random-split trials,
the online (static / sliding window / ACI) comparison, and the report.

:func:`conformal_study` retrieves the top-K candidates once, then, for each of ``num_trials`` random
calibration/test splits of the queries, fits the (Mondrian) conformal threshold on the calibration
queries and measures coverage and set size on the test queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from judgeloop.config import Range, check_at_least, check_range
from judgeloop.logging import get_logger
from judgeloop.retrieval.conformal import (
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
    """The conformal sets: levels, guarantee, candidate depth, score map, base rates."""

    alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2])
    guarantee: Literal["document", "any", "all", "labels"] = "document"
    top_k: int = 1000  # candidates per query; relevant docs beyond are infinite nonconformity
    score_map: Literal["affine", "softmax", "identity"] = "affine"
    temperature: float = 0.05
    min_group_size: int = 50
    base_rate_k: int = 10  # base rate = P(a relevant document in the top base_rate_k)
    confidence: float = 0.95
    interval: Literal["wilson", "clopper_pearson"] = "wilson"
    RANGES: ClassVar[dict[str, Range]] = {
        "min_group_size": (1, None, "[", " (queries a group needs for its own threshold)"),
        "base_rate_k": (1, None, "[", " (the depth of the base rate's top-k)"),
    }

    def __post_init__(self) -> None:
        bad = [a for a in self.alphas if not 0.0 < a < 1.0]
        if not self.alphas or bad:
            raise ValueError(f"conformal.alphas={self.alphas} must be a non-empty list of values in (0, 1)")
        check_at_least("conformal", self, "top_k", 2)
        check_range("conformal", self, "confidence", 0.0, 1.0)


@dataclass
class OnlineConfig:
    """The online comparison: static vs sliding-window vs adaptive (ACI) conformal."""

    enabled: bool = True
    alpha: float = 0.1
    gamma: float = 0.01
    window: int = 200
    warmup: int = 50
    monitor_window: int = 100
    tolerance: float = 0.05
    RANGES: ClassVar[dict[str, Range]] = {"gamma": (0, 1, "[]", " (the ACI step size; 0 = window only)")}

    def __post_init__(self) -> None:
        check_range("online", self, "alpha", 0.0, 1.0, hint="; e.g. online.alpha=0.1")
        check_at_least("online", self, "gamma", 0.0, " (the ACI step size; 0 = window only)")
        for name in ("window", "monitor_window"):
            check_at_least("online", self, name, 1)
        check_at_least("online", self, "warmup", 1, " (the static quantile needs points)")
        check_range("online", self, "tolerance", 0.0, 1.0, "[)")


@dataclass
class ConformalConfig:
    """Schema of ``judgeloop conformal``."""

    data: RetrievalDataConfig = field(default_factory=RetrievalDataConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    conformal: ConformalSection = field(default_factory=ConformalSection)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    num_trials: int = 100
    calibration_fraction: float = 0.5
    seed: int = 0
    output_dir: str = "runs/conformal"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    cache_dir: str | None = "auto"  # the judgeloop cache (embedding_cache.resolve_cache_dir); None: none

    def __post_init__(self) -> None:
        check_at_least("", self, "num_trials", 1)
        check_range("", self, "calibration_fraction", 0.0, 1.0, hint="; e.g. 0.5")


def _weighted_mean(x: np.ndarray, w: np.ndarray) -> float:
    return float((x * w).sum() / w.sum()) if w.sum() > 0 else math.nan


def run_trials(
    scores: np.ndarray,
    relevant: np.ndarray,
    num_missing: np.ndarray,
    groups: np.ndarray,
    alpha: float,
    guarantee: str,
    min_group_size: int,
    num_trials: int,
    calibration_fraction: float,
    corpus_size: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Fit on a random calibration split and measure on the rest, ``num_trials`` times.

    Returns the report entry for one ``alpha``: global and per-group mean coverage / set size over
    trials, their spread, thresholds and where each group's threshold came from.
    """

    rng = np.random.default_rng(seed)
    n = scores.shape[0]
    n_cal = int(round(calibration_fraction * n))
    if n_cal < 1 or n_cal >= n:
        raise ValueError(f"calibration_fraction={calibration_fraction} leaves an empty side with {n} queries")
    labels = sorted(set(groups.tolist()))
    cov, size, thr, full = [], [], [], []
    g_stats: dict[str, dict[str, list[Any]]] = {
        g: {"coverage": [], "size": [], "threshold": [], "n_cal": [], "source": []} for g in labels
    }
    for _ in range(num_trials):
        perm = rng.permutation(n)
        cal, test = perm[:n_cal], perm[n_cal:]
        model = ConformalRetriever(alpha, guarantee, min_group_size).fit(  # type: ignore[arg-type]
            scores[cal], relevant[cal], num_missing[cal], groups[cal].tolist()
        )
        q = model.thresholds_for(test.size, groups[test].tolist())
        out = coverage_and_size(scores[test], relevant[test], num_missing[test], q, guarantee, corpus_size)  # type: ignore[arg-type]
        cov.append(_weighted_mean(out["covered"], out["weight"]))
        size.append(float(out["size"].mean()))
        thr.append(model.threshold_)
        full.append(float(out["full"].mean()))
        for g in labels:
            mask = groups[test] == g
            t, src = model.group_threshold(g)
            fit = model.groups_.get(g)
            g_stats[g]["n_cal"].append(fit.n_cal if fit else 0)
            g_stats[g]["threshold"].append(t)
            g_stats[g]["source"].append(src)
            if mask.any() and out["weight"][mask].sum() > 0:
                g_stats[g]["coverage"].append(_weighted_mean(out["covered"][mask], out["weight"][mask]))
                g_stats[g]["size"].append(float(out["size"][mask].mean()))

    def spread(x: list[float]) -> dict[str, float]:
        a = np.asarray(x, dtype=float)
        return {
            "std": float(a.std()),
            "min": float(a.min()),
            "p05": float(np.quantile(a, 0.05)),
            "p95": float(np.quantile(a, 0.95)),
            "max": float(a.max()),
        }

    def finite_mean(x: list[float]) -> float:
        a = np.asarray(x, dtype=float)
        return float(a.mean()) if np.isfinite(a).all() else math.inf

    result: dict[str, Any] = {
        "alpha": alpha,
        "guarantee": guarantee,
        "target": 1.0 - alpha,
        "num_trials": num_trials,
        "n_cal_queries": n_cal,
        "n_test_queries": n - n_cal,
        "coverage": float(np.mean(cov)),
        "coverage_spread": spread(cov),
        "mean_set_size": float(np.mean(size)),
        "set_size_spread": spread(size),
        "threshold": finite_mean(thr),
        "frac_trials_infinite_threshold": float(np.mean(~np.isfinite(thr))),
        "frac_test_queries_full_corpus": float(np.mean(full)),
        "groups": {},
    }
    for g in labels:
        st = g_stats[g]
        sources: dict[str, int] = {}
        for s in st["source"]:
            sources[s] = sources.get(s, 0) + 1
        result["groups"][g] = {
            "n_cal": float(np.mean(st["n_cal"])),
            "coverage": float(np.mean(st["coverage"])) if st["coverage"] else math.nan,
            "coverage_std": float(np.std(st["coverage"])) if st["coverage"] else math.nan,
            "mean_set_size": float(np.mean(st["size"])) if st["size"] else math.nan,
            "threshold": finite_mean(st["threshold"]),
            "frac_trials_infinite_threshold": float(
                np.mean(~np.isfinite(np.asarray(st["threshold"], dtype=float)))
            ),
            "threshold_source": sources,
        }
    return result


def online_report(values: np.ndarray, order: np.ndarray, cfg: OnlineConfig, label: str) -> dict[str, Any]:
    """Static threshold vs sliding window vs ACI on one stream of nonconformity scores."""

    stream = values[order]
    warm = min(cfg.warmup, stream.size // 2)
    static_q = conformal_quantile(stream[:warm], cfg.alpha)
    rest = stream[warm:]
    out: dict[str, Any] = {"stream": label, "length": int(rest.size), "warmup": warm, "alpha": cfg.alpha}
    out["static"] = {"coverage": float(np.mean(rest <= static_q)), "threshold": static_q}
    for name, gamma in (("sliding_window", 0.0), ("aci", cfg.gamma)):
        aci = AdaptiveConformal(
            cfg.alpha, gamma, cfg.window, warmup=0, monitor_window=cfg.monitor_window, tolerance=cfg.tolerance
        ).fit(stream[:warm])
        r = aci.run(rest)
        half = rest.size // 2
        out[name] = {
            "coverage": float(r["covered"].mean()),
            "coverage_first_half": float(r["covered"][:half].mean()),
            "coverage_second_half": float(r["covered"][half:].mean()),
            "num_alarm_steps": int(r["alarm"].sum()),
            "final_alpha_t": float(r["alpha_t"][-1]),
        }
    return out


def conformal_study(cfg: ConformalConfig) -> dict[str, Any]:
    """Retrieve once, run the trials for every alpha and the online comparison; returns the report."""
    beir, rows = load_retrieval_data(cfg.data)
    c = cfg.conformal
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
    perm = rng.permutation(len(rq.query_ids))
    cal0 = perm[: int(round(cfg.calibration_fraction * len(perm)))]
    rates = base_rates(success[cal0], groups[cal0].tolist(), c.confidence, c.interval)

    results = []
    for alpha in c.alphas:
        logger.info("alpha=%.3f: %d trials", alpha, cfg.num_trials)
        res = run_trials(
            scores,
            rq.relevant,
            rq.num_missing,
            groups,
            alpha,
            c.guarantee,
            c.min_group_size,
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
        shuffled = np.random.default_rng(cfg.seed + 1).permutation(values.size)
        online.append(online_report(values, shuffled, cfg.online, "random order (exchangeable)"))
        # real drift: easy queries (high top-1 score) first, hard ones last
        hard_last = np.argsort(-rq.raw_scores[q_idx, 0], kind="stable")
        online.append(
            online_report(values, hard_last, cfg.online, "sorted by top-1 score, hardest last (drift)")
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
    return (
        f"{missing} of {total} relevant documents ({missing / total:.1%}) lie outside the top-"
        f"{cfg.conformal.top_k}; they score +inf, so when more than about alpha={alpha} of a calibration "
        "set is missing (or n is too small for ceil((n+1)(1-alpha)) <= n), the only set with the guarantee "
        "is the whole corpus (coverage 1). Raise conformal.top_k or alpha."
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
        "",
        "Coverage is checked over random calibration/test splits of the queries. A single split of a few "
        "hundred points moves coverage by several points by chance (see the per-trial spread below), which is "
        "why the means over trials are what to compare with 1 - alpha.",
        "",
        "| alpha | target | guarantee | mean coverage | coverage std | p05-p95 | mean set size | threshold | trials inf |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        sp = r["coverage_spread"]
        lines.append(
            f"| {r['alpha']} | {r['target']:.2f} | {r['guarantee']} | {_fmt(r['coverage'], 4)} | {_fmt(sp['std'], 4)} | "
            f"{_fmt(sp['p05'])}-{_fmt(sp['p95'])} | {_fmt(r['mean_set_size'], 1)} | {_fmt(r['threshold'])} | "
            f"{_fmt(r['frac_trials_infinite_threshold'], 2)} |"
        )
    for r in report["results"]:
        lines += [
            "",
            f"## alpha = {r['alpha']} ({r['num_trials']} trials, {r['n_cal_queries']} calibration / "
            f"{r['n_test_queries']} test queries)",
            "",
        ]
        if r.get("why_infinite"):
            lines += [f"**Infinite thresholds:** {r['why_infinite']}", ""]
        lines += [
            "| group | mean n_cal | coverage | coverage std | mean set size | threshold | source (trials) |",
            "|---|---|---|---|---|---|---|",
        ]
        for g, s in r["groups"].items():
            src = ", ".join(f"{k}: {v}" for k, v in s["threshold_source"].items())
            lines.append(
                f"| {g} | {s['n_cal']:.1f} | {_fmt(s['coverage'], 4)} | {_fmt(s['coverage_std'], 4)} | "
                f"{_fmt(s['mean_set_size'], 1)} | {_fmt(s['threshold'])} | {src} |"
            )
    rates_key = next(k for k in report if k.startswith("base_rate_at_"))
    lines += [
        "",
        f"## Base rates ({rates_key.replace('_', ' ')}, calibration half of split 0)",
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
    return "\n".join(lines) + "\n"
