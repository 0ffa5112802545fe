"""``judgeloop conformal``: conformal retrieval sets on a BEIR data set, checked over random splits.

The command encodes the corpus once (cached under ``cache_dir``, keyed by model, pooling, length and
a hash of the corpus), retrieves the top-K candidates of every query, and then, for each of
``num_trials`` random calibration/test splits of the queries, fits the (Mondrian) conformal
threshold on calibration queries and measures coverage and set size on test queries.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.io import atomic_path
from judgeloop.logging import get_logger

logger = get_logger(__name__)


# ----------------------------------------------------------------------------------------------
# Dense retrieval glue shared with ``judgeloop gate``: encode with a cache, exact top-K.
# ----------------------------------------------------------------------------------------------


def encode_texts(
    model_name: str,
    texts: Sequence[str],
    pooling: Literal["mean", "cls"] = "mean",
    max_length: int = 256,
    batch_size: int = 64,
    is_query: bool = False,
) -> np.ndarray:
    """L2-normalised embeddings ``(N, D)`` of ``texts`` from :class:`judgeloop.retrieval.encoder.BiEncoder`."""
    from judgeloop.retrieval.encoder import BiEncoder

    enc = BiEncoder.from_pretrained(model_name, pooling=pooling, normalize=True, max_length=max_length)
    emb = enc.encode(list(texts), batch_size=batch_size, show_progress=len(texts) > 1000, is_query=is_query)
    return np.asarray(emb.detach().cpu().float().numpy(), dtype=np.float32)


def texts_hash(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\x00")
    return h.hexdigest()


def encode_cached(
    model_name: str,
    texts: Sequence[str],
    cache_dir: str | Path | None,
    pooling: Literal["mean", "cls"] = "mean",
    max_length: int = 256,
    batch_size: int = 64,
    is_query: bool = False,
) -> np.ndarray:
    """:func:`encode_texts` with an on-disk cache (``.npy``, written atomically).

    The key is a hash of (model, pooling, max_length, every text), so a changed corpus or encoder
    never reuses stale vectors. ``cache_dir=None`` disables the cache.
    """
    if cache_dir is None:
        return encode_texts(model_name, texts, pooling, max_length, batch_size, is_query)
    key = hashlib.sha256(f"{model_name}|{pooling}|{max_length}|{texts_hash(texts)}".encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"emb-{key}.npy"
    if path.is_file():
        emb = np.load(path)
        if emb.shape[0] == len(texts):
            logger.info("loaded %d cached embeddings from %s", len(texts), path)
            return emb
    logger.info(
        "encoding %d texts with %s (%s pooling); caching to %s", len(texts), model_name, pooling, path
    )
    emb = encode_texts(model_name, texts, pooling, max_length, batch_size, is_query)
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        np.save(fh, emb)
    return emb


def dense_topk(
    query_emb: np.ndarray, corpus_emb: np.ndarray, k: int, chunk_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k (:func:`judgeloop.retrieval.mining.exact_topk`) on numpy arrays:
    ``(scores (Q, k), indices (Q, k))``, best first."""
    import torch

    from judgeloop.retrieval.mining import exact_topk

    scores, idx = exact_topk(torch.from_numpy(query_emb), torch.from_numpy(corpus_emb), k, chunk_size)
    return np.asarray(scores.numpy(), dtype=np.float64), np.asarray(idx.numpy(), dtype=np.int64)


def build_bm25(corpus_texts: Sequence[str]) -> Any:
    """A bm25s index over ``corpus_texts`` (English stop words removed)."""
    import bm25s

    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(list(corpus_texts), stopwords="en", show_progress=False), show_progress=False
    )
    return retriever


def bm25_topk(retriever: Any, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores (Q, k), corpus indices (Q, k))`` from a :func:`build_bm25` index."""
    import bm25s

    # token strings, looked up in the corpus vocabulary (ids from a fresh tokenize call would not match it)
    tokens = bm25s.tokenize(list(queries), stopwords="en", return_ids=False, show_progress=False)
    idx, scores = retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    return np.asarray(scores, dtype=np.float64), np.asarray(idx, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

SCIFACT = "../shared/data/scifact"


@dataclass
class RetrievalDataConfig:
    corpus_path: str = f"{SCIFACT}/corpus.jsonl"
    queries_path: str = f"{SCIFACT}/queries_train.jsonl"
    qrels_path: str = f"{SCIFACT}/qrels_train.tsv"
    # a field of the queries file holding each query's group label ("a/b" has parent "a")
    group_field: str | None = None
    # built-in grouping when group_field is unset: "base_rate" = quantile buckets of the top-1
    # retrieval score (label-free; their calibration base rates are reported), "query_length" =
    # quantile buckets of the query's word count, "none" = one global group
    grouping: Literal["base_rate", "query_length", "none"] = "base_rate"
    num_buckets: int = 3
    max_queries: int | None = None  # first N queries (by id order) for quick runs
    max_corpus: int | None = None  # keep the relevant docs plus the first N others (quick runs)

    def __post_init__(self) -> None:
        if self.num_buckets < 1:
            raise ValueError(f"data.num_buckets={self.num_buckets} must be >= 1")


@dataclass
class EncoderConfig:
    name: str = "sentence-transformers/all-MiniLM-L6-v2"
    pooling: Literal["mean", "cls"] = "mean"
    max_length: int = 256
    batch_size: int = 64


@dataclass
class ConformalSection:
    alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.2])
    guarantee: Literal["document", "any", "all", "labels"] = "document"
    top_k: int = 1000  # candidates per query; relevant docs beyond are infinite nonconformity
    score_map: Literal["affine", "softmax", "identity"] = "affine"
    temperature: float = 0.05
    min_group_size: int = 50
    base_rate_k: int = 10  # base rate = P(a relevant document in the top base_rate_k)
    confidence: float = 0.95
    interval: Literal["wilson", "clopper_pearson"] = "wilson"

    def __post_init__(self) -> None:
        bad = [a for a in self.alphas if not 0.0 < a < 1.0]
        if not self.alphas or bad:
            raise ValueError(f"conformal.alphas={self.alphas} must be a non-empty list of values in (0, 1)")
        if self.top_k < 2:
            raise ValueError(f"conformal.top_k={self.top_k} must be >= 2")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"conformal.confidence={self.confidence} must be in (0, 1)")


@dataclass
class OnlineConfig:
    enabled: bool = True
    alpha: float = 0.1
    gamma: float = 0.01
    window: int = 200
    warmup: int = 50
    monitor_window: int = 100
    tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"online.alpha={self.alpha} must be in (0, 1); e.g. online.alpha=0.1")
        if self.gamma < 0.0:
            raise ValueError(f"online.gamma={self.gamma} must be >= 0 (the ACI step size; 0 = window only)")
        for name in ("window", "monitor_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"online.{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 1:
            raise ValueError(f"online.warmup={self.warmup} must be >= 1 (the static quantile needs points)")
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"online.tolerance={self.tolerance} must be in [0, 1)")


@dataclass
class ConformalConfig:
    data: RetrievalDataConfig = field(default_factory=RetrievalDataConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    conformal: ConformalSection = field(default_factory=ConformalSection)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    num_trials: int = 100
    calibration_fraction: float = 0.5
    seed: int = 0
    output_dir: str = "runs/conformal"
    cache_dir: str | None = "runs/cache"

    def __post_init__(self) -> None:
        if self.num_trials < 1:
            raise ValueError(f"num_trials={self.num_trials} must be >= 1")
        if not 0.0 < self.calibration_fraction < 1.0:
            raise ValueError(f"calibration_fraction={self.calibration_fraction} must be in (0, 1); e.g. 0.5")


# ----------------------------------------------------------------------------------------------
# Data: queries, qrels, top-K candidates
# ----------------------------------------------------------------------------------------------


@dataclass
class RetrievedQueries:
    """Top-K retrieval results of Q queries over a corpus of N documents."""

    query_ids: list[str]
    query_texts: list[str]
    doc_ids: list[str]  # corpus order (N,)
    doc_texts: list[str]
    raw_scores: np.ndarray  # (Q, K)
    indices: np.ndarray  # (Q, K) corpus indices
    relevant: np.ndarray  # (Q, K) bool
    num_missing: np.ndarray  # (Q,)
    positives: list[set[str]]
    query_rows: dict[str, dict[str, Any]] = field(default_factory=dict)


def load_retrieval_data(data: RetrievalDataConfig) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The BEIR data (qrels positives only) and the raw query rows (for ``group_field``)."""
    from judgeloop.io import DataError, read_jsonl
    from judgeloop.retrieval.beir import load_beir

    beir = load_beir(data.corpus_path, data.queries_path, data.qrels_path)
    rows = {str(r["_id"]): r for r in read_jsonl(data.queries_path, required=["_id"], kinds={"_id": "id"})}
    positives = beir.positives()
    qids = sorted(q for q in beir.queries if q in positives)
    if data.max_queries is not None:
        qids = qids[: data.max_queries]
    if not qids:
        raise DataError(f"{data.qrels_path}: no query has a relevant document (grade >= 1)")
    corpus = beir.corpus
    if data.max_corpus is not None:
        keep = set().union(*(positives[q] for q in qids))
        others = [d for d in sorted(corpus) if d not in keep][: data.max_corpus]
        corpus = {d: corpus[d] for d in sorted(keep | set(others))}
    beir = beir.subset(qids)
    beir.corpus = corpus
    return beir, rows


def retrieve_dense(beir: Any, encoder: EncoderConfig, top_k: int, cache_dir: str | None) -> RetrievedQueries:
    """Encode corpus and queries (cached) and keep each query's exact top-K candidates."""
    from judgeloop.retrieval.beir import doc_text

    doc_ids = sorted(beir.corpus)
    doc_texts = [doc_text(beir.corpus[d]) for d in doc_ids]
    qids = list(beir.queries)
    qtexts = [beir.queries[q] for q in qids]
    corpus_emb = encode_cached(
        encoder.name, doc_texts, cache_dir, encoder.pooling, encoder.max_length, encoder.batch_size
    )
    query_emb = encode_cached(
        encoder.name,
        qtexts,
        cache_dir,
        encoder.pooling,
        encoder.max_length,
        encoder.batch_size,
        is_query=True,
    )
    scores, idx = dense_topk(query_emb, corpus_emb, top_k)  # (Q, K)
    positives = [{d for d, g in beir.qrels[q].items() if g >= 1} for q in qids]
    relevant = np.zeros(idx.shape, dtype=bool)
    num_missing = np.zeros(len(qids), dtype=np.int64)
    for i, pos in enumerate(positives):
        got = [doc_ids[j] in pos for j in idx[i]]
        relevant[i] = got
        num_missing[i] = len(pos) - int(sum(got))
    return RetrievedQueries(qids, qtexts, doc_ids, doc_texts, scores, idx, relevant, num_missing, positives)


def query_groups(
    rq: RetrievedQueries, data: RetrievalDataConfig, rows: dict[str, dict[str, Any]]
) -> np.ndarray:
    """One group label per query: ``data.group_field`` if set, else the built-in grouping."""
    from judgeloop.io import DataError
    from judgeloop.retrieval.conformal import quantile_buckets

    if data.group_field is not None:
        labels = []
        for q in rq.query_ids:
            row = rows.get(q, {})
            if data.group_field not in row:
                raise DataError(
                    f"{data.queries_path}: query '{q}' has no field '{data.group_field}' "
                    f"(fields: {sorted(row)}); fix data.group_field or unset it for the built-in grouping"
                )
            labels.append(str(row[data.group_field]))
        return np.asarray(labels, dtype=object)
    if data.grouping == "none":
        return np.asarray(["all"] * len(rq.query_ids), dtype=object)
    if data.grouping == "query_length":
        lengths = np.asarray([len(t.split()) for t in rq.query_texts], dtype=float)
        return quantile_buckets(lengths, data.num_buckets, prefix="length")
    return quantile_buckets(rq.raw_scores[:, 0], data.num_buckets, prefix="top1")


# ----------------------------------------------------------------------------------------------
# Trials
# ----------------------------------------------------------------------------------------------


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
    from judgeloop.retrieval.conformal import ConformalRetriever, coverage_and_size

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
        return {"std": float(a.std()), "min": float(a.min()), "p05": float(np.quantile(a, 0.05)),
                "p95": float(np.quantile(a, 0.95)), "max": float(a.max())}  # fmt: skip

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
    from judgeloop.retrieval.conformal import AdaptiveConformal, conformal_quantile

    stream = values[order]
    warm = min(cfg.warmup, stream.size // 2)
    static_q = conformal_quantile(stream[:warm], cfg.alpha)
    rest = stream[warm:]
    out: dict[str, Any] = {"stream": label, "length": int(rest.size), "warmup": warm, "alpha": cfg.alpha}
    out["static"] = {"coverage": float(np.mean(rest <= static_q)), "threshold": static_q}
    for name, gamma in (("sliding_window", 0.0), ("aci", cfg.gamma)):
        aci = AdaptiveConformal(cfg.alpha, gamma, cfg.window, warmup=0, monitor_window=cfg.monitor_window,
                                tolerance=cfg.tolerance).fit(stream[:warm])  # fmt: skip
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


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------


def run(cfg: ConformalConfig) -> dict[str, Any]:
    from judgeloop.config import to_yaml
    from judgeloop.io import atomic_write_json, atomic_write_text
    from judgeloop.retrieval.conformal import base_rates, map_scores, nonconformity

    out_dir = Path(cfg.output_dir)
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
        res = run_trials(scores, rq.relevant, rq.num_missing, groups, alpha, c.guarantee, c.min_group_size,
                         cfg.num_trials, cfg.calibration_fraction, len(rq.doc_ids), seed=cfg.seed)  # fmt: skip
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
        },  # fmt: skip
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
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "config.yaml", to_yaml(cfg))
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", render_markdown(report))
    logger.info("wrote %s", out_dir / "report.md")
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
    if x is None:
        return "inf"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if math.isnan(x):
            return "n/a"
        return f"{x:.{nd}f}"
    return str(x)


def render_markdown(report: dict[str, Any]) -> str:
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
    lines += ["", f"## Base rates ({rates_key.replace('_', ' ')}, calibration half of split 0)", "",
              "| group | n | successes | rate | CI |", "|---|---|---|---|---|"]  # fmt: skip
    for g, s in report[rates_key].items():
        lines.append(
            f"| {g} | {s['n']} | {s['successes']} | {_fmt(s['rate'])} | [{_fmt(s['low'])}, {_fmt(s['high'])}] |"
        )
    if report["online"]:
        lines += ["", "## Online: static vs sliding window vs ACI", "",
                  "| stream | alpha | static | sliding window | ACI | ACI 1st / 2nd half | ACI alarm steps | window alarm steps |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for o in report["online"]:
            a, w = o["aci"], o["sliding_window"]
            lines.append(
                f"| {o['stream']} | {o['alpha']} | {_fmt(o['static']['coverage'])} | {_fmt(w['coverage'])} | "
                f"{_fmt(a['coverage'])} | {_fmt(a['coverage_first_half'])} / {_fmt(a['coverage_second_half'])} | "
                f"{a['num_alarm_steps']} | {w['num_alarm_steps']} |"
            )
    return "\n".join(lines) + "\n"
