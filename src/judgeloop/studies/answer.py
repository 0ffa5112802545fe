"""The study behind ``judgeloop answer``: retrieve, read, and answer or refuse, with the refusal threshold
chosen on a risk-coverage curve and each refusal given its reason.

Every question (SQuAD 2.0 sample: answerable and unanswerable) gets its top-k passages from the pool of
all the file's paragraphs (dense similarity) and the reader's answer with them. What the pipeline saw is
kept per question:

* the weak-retrieval gate (:class:`~judgeloop.retrieval.gate.WeakRetrievalGate` on the top similarity,
  fitted on the calibration split with "gold paragraph missing from the top-k" as weak): *no passage above
  the gate*;
* the conformal retrieval set (:class:`~judgeloop.retrieval.conformal.ConformalRetriever`, document
  guarantee at ``1 - conformal_alpha``, fitted on the calibration split or loaded from
  ``conformal_path``): *conformal set empty* when no shown passage is in it;
* the reader with each in-set passage alone, when two or more are in the set: *passages disagree* when
  their answers share less than ``disagreement_max_f1`` token F1;
* the reader's P(the passages answer it): *reader predicts unanswerable* below 0.5.

The answer confidence (:class:`~judgeloop.routing.abstention.AnswerConfidence`: calibrated E[F1] with
``confidence_target: f1``, or P(F1 >= ``correct_min_f1``) with ``correct``) is fitted on the calibration split, the threshold
(:class:`~judgeloop.routing.abstention.RiskThreshold`) is the one that meets ``target_risk`` there, and the
test split gets the curve, the selective F1 at fixed coverages against always answering and against a plain
similarity threshold (paired bootstrap intervals over questions), and the refusals by reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from judgeloop.config import ConfigError, bounded, check_fields
from judgeloop.intervals import bootstrap_interval
from judgeloop.logging import get_logger
from judgeloop.routing.abstention import REASONS, aurc, refusal_reasons, risk_coverage, selective_risk
from judgeloop.studies.routing import QAStudyConfig, RouteDataConfig, load_questions
from judgeloop.text import fmt_number

logger = get_logger(__name__)

FEATURES = ("answer_logprob", "answerable_logit", "top1_similarity", "num_in_set")


@dataclass
class AbstainSection:
    """How the answer step refuses: the target risk, the confidence's features, the reason signals."""

    target_risk: float = bounded(0.5, gt=0.0, lt=1.0, hint="; e.g. abstain.target_risk=0.3", shape="section")
    calibration_fraction: float = bounded(0.5, gt=0.0, lt=1.0, hint="; e.g. 0.5", shape="section")
    confidence_features: list[str] = field(
        default_factory=lambda: ["answer_logprob", "answerable_logit", "top1_similarity"]
    )
    confidence_target: Literal["f1", "correct"] = "f1"  # E[F1], or P(F1 >= correct_min_f1)
    correct_min_f1: float = bounded(0.5, gt=0.0, le=1.0, shape="section")
    conformal_alpha: float = bounded(0.1, gt=0.0, lt=1.0, hint="; e.g. 0.1 for 90% sets", shape="section")
    conformal_path: str | None = None  # a conformal.json fitted on this pool; null = fit on calibration
    disagreement_max_f1: float = bounded(0.5, gt=0.0, le=1.0, shape="section")
    coverages: list[float] = field(default_factory=lambda: [0.8, 0.9])
    num_bootstrap: int = bounded(1000, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("abstain", self)
        unknown = [f for f in self.confidence_features if f not in FEATURES]
        if unknown or not self.confidence_features:
            raise ValueError(
                f"abstain.confidence_features has unknown feature(s) {unknown}; choose from {list(FEATURES)}"
            )
        bad = [c for c in self.coverages if not 0.0 < c <= 1.0]
        if bad or not self.coverages:
            raise ValueError(
                f"abstain.coverages={self.coverages} must be a non-empty list of values in (0, 1]"
            )


@dataclass
class AnswerConfig(QAStudyConfig):
    """Schema of ``judgeloop answer``: a :class:`QAStudyConfig` over every question (unanswerable ones
    included) and how the answer step refuses."""

    data: RouteDataConfig = field(
        default_factory=lambda: RouteDataConfig(answerable_only=False, max_questions=None)
    )
    output_dir: str = "runs/answer"
    abstain: AbstainSection = field(default_factory=AbstainSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.retriever.type != "dense":
            raise ValueError(
                f"retriever.type={self.retriever.type!r}: the answer step's conformal sets need dense "
                "similarities in [-1, 1]; set retriever.type=dense"
            )


@dataclass
class Retrieved:
    """Dense retrieval of every question over the whole pool."""

    sim: np.ndarray  # (Q, P) cosine similarities
    top: np.ndarray  # (Q, k) pool indices, best first
    gold: np.ndarray  # (Q, P) bool: the question's own paragraph


@dataclass
class Outcomes:
    """Per-question arrays ``(Q,)`` of one run, and the split."""

    cal: np.ndarray  # calibration question indices
    test: np.ndarray  # test question indices
    f1: np.ndarray
    unanswerable: np.ndarray
    features: dict[str, np.ndarray]
    confidence: np.ndarray  # calibrated E[F1] or P(correct)
    answered: np.ndarray  # bool, at the threshold chosen on calibration
    flags: dict[str, np.ndarray]
    reasons: list[str | None]  # test refusals only

    @property
    def loss(self) -> np.ndarray:
        return 1.0 - self.f1

    @property
    def top1(self) -> np.ndarray:
        return self.features["top1_similarity"]


def _scorer(cfg: AnswerConfig) -> dict[str, Any]:
    e = cfg.retriever.encoder
    return {"encoder": e.name, "pooling": e.pooling, "max_length": e.max_length, "score_map": "affine"}


def check_inputs(cfg: AnswerConfig, pool: list[str]) -> Any:
    """The checks that need more than the config, before any model loads: both models resolve, and a
    given conformal file was fitted on this pool with this encoder. Returns the loaded retriever or None."""
    from judgeloop.models import check_model
    from judgeloop.retrieval.conformal import corpus_fingerprint, load_conformal_file

    try:
        check_model(cfg.model.name, "model.name")
        check_model(cfg.retriever.encoder.name, "retriever.encoder.name")
        if cfg.abstain.conformal_path is None:
            return None
        corpus = corpus_fingerprint([str(i) for i in range(len(pool))], pool)
        return load_conformal_file(cfg.abstain.conformal_path, corpus, _scorer(cfg), "abstain.conformal_path")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def retrieve_all(cfg: AnswerConfig, examples: list[Any], pool: list[str]) -> Retrieved:
    """Similarities of every question to every pool passage, the top-k, and the gold mask."""
    from judgeloop.retrieval.dense import encode_with

    e = cfg.retriever.encoder
    enc = e.load()
    pool_emb = encode_with(enc, pool, cfg.cache_dir, e.batch_size)  # (P, D)
    q_emb = encode_with(enc, [ex.question for ex in examples], cfg.cache_dir, e.batch_size, is_query=True)
    sim = np.asarray(q_emb @ pool_emb.T, dtype=np.float64)  # (Q, P), unit vectors
    k = min(cfg.retriever.top_k, len(pool))
    top = np.argsort(-sim, axis=1, kind="stable")[:, :k]
    where = {p: i for i, p in enumerate(pool)}
    gold = np.zeros(sim.shape, dtype=bool)
    for i, ex in enumerate(examples):
        for p in ex.gold_passages:
            gold[i, where[p]] = True
    return Retrieved(sim, top, gold)


def fit_conformal(cfg: AnswerConfig, r: Retrieved, cal: np.ndarray) -> Any:
    """The document-guarantee conformal retriever on the calibration questions' whole-pool scores."""
    from judgeloop.retrieval.conformal import ConformalRetriever, map_scores

    s = map_scores(r.sim[cal], "affine")
    miss = np.zeros(cal.size, dtype=np.int64)  # every pool passage is scored: no relevant one is missing
    return ConformalRetriever(cfg.abstain.conformal_alpha, "document").fit(s, r.gold[cal], miss)


def gate_flags(r: Retrieved, cal: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
    """``(Q,)`` the gate's "no passage above it" flag and its description (threshold on the top similarity)."""
    from judgeloop.retrieval.gate import WeakRetrievalGate

    top1 = r.sim[np.arange(len(r.sim)), r.top[:, 0]]
    weak = ~r.gold[np.arange(len(r.sim))[:, None], r.top].any(axis=1)  # gold paragraph not shown
    try:
        gate = WeakRetrievalGate(min_separation=0.5).fit({"max_score": top1[cal]}, weak[cal])
    except ValueError as err:  # one class on calibration: no gate, reported
        return np.zeros(len(r.sim), dtype=bool), {"fitted": False, "why": str(err)}
    flag = gate.predict({"max_score": top1})
    t = gate.state_.thresholds["max_score"] * gate.state_.orientation["max_score"]
    return flag, {
        "fitted": True,
        "signal": "top-1 similarity",
        "threshold": t,
        "orientation": gate.state_.orientation["max_score"],
        "weak_rate_cal": float(weak[cal].mean()),
    }


def load_reader(cfg: AnswerConfig) -> tuple[Any, Any]:
    """The reader's (model, tokenizer)."""
    from judgeloop.models import load_causal_lm, load_tokenizer

    return load_causal_lm(cfg.model.name), load_tokenizer(cfg.model.name)


def read_answers(
    cfg: AnswerConfig, reader: tuple[Any, Any], examples: list[Any], shown: list[list[str]]
) -> dict[str, Any]:
    """The reader's answers with its shown passages and its P(the passages answer it), through a cache in
    ``cache_dir`` keyed by the reader, its settings and every prompt's text (greedy decoding: the same
    prompts give the same answers, so a rerun that changes only the abstention settings reads nothing)."""
    import json

    from judgeloop.hashing import json_digest, texts_digest
    from judgeloop.io import atomic_write_json
    from judgeloop.retrieval.embedding_cache import resolve_cache_dir
    from judgeloop.routing.llm import EXTRACT_ANSWER

    m = cfg.model
    key = json_digest(
        [
            m.name,
            m.max_new_tokens,
            EXTRACT_ANSWER,
            texts_digest(x for ex, ps in zip(examples, shown) for x in [ex.question, *ps]),
        ]
    )
    folder = resolve_cache_dir(cfg.cache_dir, "answers")  # auto: the judgeloop cache, not the working dir
    path = folder / f"reader-{key}.json" if folder is not None else None
    if path is not None and path.is_file():
        logger.info("reusing the reader's answers from %s", path)
        got = json.loads(path.read_text())
        return {
            "answers": got["answers"],
            "p_yes": np.asarray(got["p_yes"]),
            "logprob_mean": np.asarray([math.nan if x is None else x for x in got["logprob_mean"]]),
        }
    out = _read(cfg, reader, examples, shown)
    if path is not None:
        atomic_write_json(
            path,
            {
                "answers": out["answers"],
                "p_yes": out["p_yes"].tolist(),
                "logprob_mean": out["logprob_mean"].tolist(),
            },
        )
    return out


def _read(
    cfg: AnswerConfig, reader: tuple[Any, Any], examples: list[Any], shown: list[list[str]]
) -> dict[str, Any]:
    """:func:`read_answers` without the cache."""
    from judgeloop.routing.llm import (
        EXTRACT_ANSWER,
        answer_with_passages,
        answerable_probability,
        strip_answer_label,
    )

    model, tok = reader
    m = cfg.model
    qs = [ex.question for ex in examples]
    answers, gens = answer_with_passages(
        model, tok, qs, shown, m.max_new_tokens, m.batch_size, EXTRACT_ANSWER
    )
    p_yes = answerable_probability(model, tok, qs, shown, m.batch_size)
    return {
        "answers": [strip_answer_label(x) for x in answers],
        "p_yes": p_yes,
        "logprob_mean": np.asarray([g.logprob_mean for g in gens]),
    }


def single_passage_answers(
    cfg: AnswerConfig,
    reader: tuple[Any, Any],
    examples: list[Any],
    shown: list[list[str]],
    in_set: np.ndarray,
    which: np.ndarray,
) -> dict[int, list[str]]:
    """For the questions in ``which`` with two or more shown passages in the conformal set, the reader's
    answer with each of those passages alone (the disagreement check)."""
    from judgeloop.routing.llm import EXTRACT_ANSWER, answer_with_passages, strip_answer_label

    model, tok = reader
    m = cfg.model
    items = [
        (i, j)
        for i in np.nonzero(which)[0].tolist()
        if in_set[i].sum() >= 2
        for j in np.nonzero(in_set[i])[0].tolist()
    ]
    answers, _ = answer_with_passages(
        model,
        tok,
        [examples[i].question for i, _ in items],
        [[shown[i][j]] for i, j in items],
        m.max_new_tokens,
        m.batch_size,
        EXTRACT_ANSWER,
    )
    per: dict[int, list[str]] = {}
    for (i, _), a in zip(items, answers):
        per.setdefault(i, []).append(strip_answer_label(a))
    return per


def _disagree(singles: dict[int, list[str]], n: int, max_f1: float) -> np.ndarray:
    from judgeloop.metrics.qa import token_f1

    out = np.zeros(n, dtype=bool)
    for i, answers in singles.items():
        ans = [a for a in answers if a.strip()]
        out[i] = any(token_f1(a, [b]) < max_f1 for x, a in enumerate(ans) for b in ans[x + 1 :])
    return out


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    return np.log(q / (1 - q))


def _features(read: dict[str, Any], top1: np.ndarray, in_set: np.ndarray) -> dict[str, np.ndarray]:
    """The candidate confidence features per question (``FEATURES``); a missing log-prob (an empty answer)
    counts as -20 nats a token."""
    lp = np.where(np.isfinite(read["logprob_mean"]), read["logprob_mean"], -20.0)
    return {
        "answer_logprob": lp,
        "answerable_logit": _logit(read["p_yes"]),
        "top1_similarity": top1,
        "num_in_set": in_set.sum(axis=1).astype(float),
    }


def _rows(examples: list[Any], o: Outcomes, read: dict[str, Any], in_set: np.ndarray) -> list[dict[str, Any]]:
    """One ``answers.jsonl`` row per question."""
    in_test = set(o.test.tolist())
    return [
        {
            "id": ex.id,
            "split": "test" if i in in_test else "calibration",
            "question": ex.question,
            "answers": ex.answers,
            "unanswerable": bool(o.unanswerable[i]),
            "answer": read["answers"][i],
            "f1": float(o.f1[i]),
            "confidence": float(o.confidence[i]),
            "answered": bool(o.answered[i]),
            "reason": o.reasons[i],
            "flags": {k: bool(v[i]) for k, v in o.flags.items()},
            "top1_similarity": float(o.top1[i]),
            "p_answerable": float(read["p_yes"][i]),
            "in_set": in_set[i].tolist(),
            "single_passage_answers": read["singles"].get(i, []),
        }
        for i, ex in enumerate(examples)
    ]


def answer_study(cfg: AnswerConfig) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Retrieve, read, fit confidence and threshold on the calibration split, report on test. Returns the
    report, one row per question and the fitted state (conformal, gate, confidence, threshold)."""
    from judgeloop.metrics.qa import token_f1
    from judgeloop.retrieval.conformal import corpus_fingerprint, map_scores
    from judgeloop.routing.abstention import AnswerConfidence, RiskThreshold

    a = cfg.abstain
    examples, pool = load_questions(cfg.data)
    loaded = check_inputs(cfg, pool)
    rng = np.random.default_rng(cfg.seed)
    if cfg.data.max_questions is not None and cfg.data.max_questions < len(examples):
        examples = [
            examples[i] for i in np.sort(rng.choice(len(examples), cfg.data.max_questions, replace=False))
        ]
    n = len(examples)
    perm = rng.permutation(n)
    n_cal = int(round(a.calibration_fraction * n))
    cal, test = np.sort(perm[:n_cal]), np.sort(perm[n_cal:])
    if n_cal < 2 or n - n_cal < 2:
        raise ConfigError(
            f"abstain.calibration_fraction={a.calibration_fraction} leaves a split under 2 of {n} questions"
        )
    logger.info(
        "%d questions (%d calibration / %d test), pool of %d passages", n, cal.size, test.size, len(pool)
    )

    r = retrieve_all(cfg, examples, pool)
    conformal = loaded if loaded is not None else fit_conformal(cfg, r, cal)
    shown_scores = map_scores(r.sim[np.arange(n)[:, None], r.top], "affine")  # (Q, k)
    in_set = conformal.predict(shown_scores)  # (Q, k) bool
    gate_flag, gate_info = gate_flags(r, cal)
    reader = load_reader(cfg)
    shown = [[pool[j] for j in row] for row in r.top]
    read = read_answers(cfg, reader, examples, shown)

    golds = [ex.answers for ex in examples]
    f1 = np.asarray([token_f1(ans, g) for ans, g in zip(read["answers"], golds)])
    unanswerable = np.asarray([not g for g in golds])
    top1 = r.sim[np.arange(n), r.top[:, 0]]
    feats = _features(read, top1, in_set)
    confidence = AnswerConfidence(a.confidence_features).fit(
        {k: v[cal] for k, v in feats.items()},
        f1[cal] if a.confidence_target == "f1" else f1[cal] >= a.correct_min_f1,
    )
    conf = confidence.predict(feats)
    loss = 1.0 - f1
    thr = RiskThreshold(a.target_risk).fit(conf[cal], loss[cal])
    sim_thr = RiskThreshold(a.target_risk).fit(top1[cal], loss[cal])
    answered = thr.predict(conf)
    # the disagreement check is paid only where a reason is needed: the refused test questions
    refused_test = ~answered & np.isin(np.arange(n), test)
    read["singles"] = single_passage_answers(cfg, reader, examples, shown, in_set, refused_test)
    read["num_generations"] = n + sum(len(v) for v in read["singles"].values())
    read["num_answerability_passes"] = n
    flags = {
        "no_passage_above_gate": gate_flag,
        "conformal_set_empty": ~in_set.any(axis=1),
        "passages_disagree": _disagree(read["singles"], n, a.disagreement_max_f1),
        "reader_predicts_unanswerable": read["p_yes"] < 0.5,
    }
    reasons = refusal_reasons(flags, ~answered)
    in_test = np.isin(np.arange(n), test)
    reasons = [x if in_test[i] else None for i, x in enumerate(reasons)]  # reasons are reported on test only
    o = Outcomes(cal, test, f1, unanswerable, feats, conf, answered, flags, reasons)
    report = build_report(
        cfg, examples, pool, r, o, thr, sim_thr, gate_info, conformal, read, loaded is not None
    )
    rows = _rows(examples, o, read, in_set)
    state = {
        "conformal": conformal,
        "corpus": corpus_fingerprint([str(i) for i in range(len(pool))], pool),
        "scorer": _scorer(cfg),
        "confidence": confidence.state_dict(),
        "threshold": thr.state_dict(),
    }
    return report, rows, state


def _selective(conf: np.ndarray, loss: np.ndarray, c: float, idx: np.ndarray) -> float:
    """Selective F1 at coverage ``c`` of the questions ``idx`` (a bootstrap resample or all of them)."""
    return 1.0 - selective_risk(conf[idx], loss[idx], c)


def _selective_at(
    conf: np.ndarray, top1: np.ndarray, loss: np.ndarray, c: float, num_bootstrap: int, seed: int
) -> dict[str, Any]:
    """One coverage's row of :func:`selective_table`."""

    def system(idx: np.ndarray) -> float:
        return _selective(conf, loss, c, idx)

    def always_answer(idx: np.ndarray) -> float:
        return 1.0 - float(loss[idx].mean())

    def similarity(idx: np.ndarray) -> float:
        return _selective(top1, loss, c, idx)

    def system_minus_always(idx: np.ndarray) -> float:
        return system(idx) - always_answer(idx)

    def system_minus_similarity(idx: np.ndarray) -> float:
        return system(idx) - similarity(idx)

    n = conf.size
    entry: dict[str, Any] = {"coverage": c, "answered": max(1, math.ceil(c * n - 1e-9))}
    for fn in (system, always_answer, similarity, system_minus_always, system_minus_similarity):
        ci = bootstrap_interval(fn, n, num_bootstrap, seed=seed)  # one seed: the same resamples for all
        entry[fn.__name__] = {
            "delta" if "_minus_" in fn.__name__ else "f1": fn(np.arange(n)),
            "ci95": list(ci),
        }
    return entry


def selective_table(
    cfg: AnswerConfig, conf: np.ndarray, top1: np.ndarray, loss: np.ndarray
) -> dict[str, Any]:
    """Selective F1 at each coverage for the system (calibrated confidence), always answering and the
    plain similarity ranking, with percentile-bootstrap intervals over test questions; the deltas are
    paired (both sides computed on the same resample)."""
    a = cfg.abstain
    return {f"{c:g}": _selective_at(conf, top1, loss, c, a.num_bootstrap, cfg.seed) for c in a.coverages}


def _reason_table(
    reasons: list[str | None], unanswerable: np.ndarray, f1: np.ndarray, test: np.ndarray
) -> dict[str, Any]:
    refused = [i for i in test.tolist() if reasons[i] is not None]
    out: dict[str, Any] = {}
    for name in REASONS:
        idx = [i for i in refused if reasons[i] == name]
        out[name] = {
            "count": len(idx),
            "share_of_refusals": len(idx) / len(refused) if refused else math.nan,
            "unanswerable": int(sum(unanswerable[i] for i in idx)),
            "answerable_correct_lost": int(sum((not unanswerable[i]) and f1[i] >= 0.5 for i in idx)),
        }
    return out


def _operating_point(cfg: AnswerConfig, o: Outcomes, answered: np.ndarray) -> dict[str, Any]:
    """Coverage and risk on test of answering ``answered`` ``(T,)``, with the risk's bootstrap interval and
    the refusal rates on answerable and unanswerable questions."""
    loss, u = o.loss[o.test], o.unanswerable[o.test]

    def risk(idx: np.ndarray) -> float:
        keep = answered[idx]
        return float(loss[idx][keep].mean()) if keep.any() else math.nan

    ci = bootstrap_interval(risk, o.test.size, cfg.abstain.num_bootstrap, seed=cfg.seed)
    return {
        "coverage": float(answered.mean()),
        "risk": float(loss[answered].mean()) if answered.any() else None,
        "risk_ci95": list(ci),
        "refusal_rate_answerable": float((~answered[~u]).mean()) if (~u).any() else None,
        "refusal_rate_unanswerable": float((~answered[u]).mean()) if u.any() else None,
    }


def build_report(
    cfg: AnswerConfig,
    examples: list[Any],
    pool: list[str],
    r: Retrieved,
    o: Outcomes,
    thr: Any,
    sim_thr: Any,
    gate_info: dict[str, Any],
    conformal: Any,
    read: dict[str, Any],
    conformal_loaded: bool,
) -> dict[str, Any]:
    """The report: data, the fitted pieces, the test curve, selective F1, the operating point, reasons."""
    a = cfg.abstain
    test, conf, loss, top1, f1 = o.test, o.confidence, o.loss, o.top1, o.f1
    cov, risk = risk_coverage(conf[test], loss[test])
    shown_gold = r.gold[np.arange(len(r.sim))[:, None], r.top].any(axis=1)
    return {
        "data": {
            "format": cfg.data.format,
            "path": cfg.data.path,
            "num_questions": len(examples),
            "num_unanswerable": int(o.unanswerable.sum()),
            "n_cal": int(o.cal.size),
            "n_test": int(test.size),
            "pool_size": len(pool),
        },
        "model": cfg.model.name,
        "retriever": f"dense top-{cfg.retriever.top_k} ({cfg.retriever.encoder.name})",
        "gold_passage_shown_rate_test": float(shown_gold[test].mean()),
        "loss": "1 - SQuAD token F1 (an answer to an unanswerable question has F1 0)",
        "confidence": {
            "features": a.confidence_features,
            "target": "F1" if a.confidence_target == "f1" else f"F1 >= {a.correct_min_f1}",
            "auc_label": f"F1 >= {a.correct_min_f1}",
            "auc_test": _auc(conf[test], f1[test] >= a.correct_min_f1),
        },
        "always_answer_f1_test": float(f1[test].mean()),
        "risk_coverage": [{"coverage": float(c), "risk": float(x)} for c, x in zip(cov, risk)],
        "aurc": {
            "system": aurc(conf[test], loss[test]),
            "similarity": aurc(top1[test], loss[test]),
            "answer_logprob": aurc(o.features["answer_logprob"][test], loss[test]),
            "random": float(loss[test].mean()),
        },
        "selective_f1": selective_table(cfg, conf[test], top1[test], loss[test]),
        "threshold": {
            "target_risk": a.target_risk,
            "confidence": thr.threshold_,
            "met_on_calibration": thr.met_,
            "calibration": {"coverage": thr.coverage_, "risk": thr.risk_},
            "test": _operating_point(cfg, o, o.answered[test]),
        },
        "similarity_threshold": {
            "threshold": sim_thr.threshold_,
            "met_on_calibration": sim_thr.met_,
            "calibration": {"coverage": sim_thr.coverage_, "risk": sim_thr.risk_},
            "test": _operating_point(cfg, o, sim_thr.predict(top1[test])),
        },
        "refusals": _reason_table(o.reasons, o.unanswerable, f1, test),
        "flag_rates_test": {k: float(v[test].mean()) for k, v in o.flags.items()},
        "gate": gate_info,
        "conformal": {
            "alpha": conformal.alpha,
            "threshold": conformal.threshold_,
            "loaded": conformal_loaded,
            "empty_set_rate_test": float(o.flags["conformal_set_empty"][test].mean()),
        },
        "cost": {
            "generations": read["num_generations"],
            "answerability_passes": read["num_answerability_passes"],
            "generations_per_question": read["num_generations"] / len(examples),
        },
    }


def _auc(score: np.ndarray, positive: np.ndarray) -> float:
    from judgeloop.retrieval.gate import auc

    return auc(score, positive)


def plot_risk_coverage(report: dict[str, Any], rows: list[dict[str, Any]], path: str | Path) -> None:
    """``risk_coverage.png``: the test curves of the confidence, the similarity and the answer log-prob."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test = [x for x in rows if x["split"] == "test"]
    loss = np.asarray([1.0 - x["f1"] for x in test])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, key in (("calibrated confidence", "confidence"), ("top-1 similarity", "top1_similarity")):
        cov, risk = risk_coverage(np.asarray([x[key] for x in test]), loss)
        ax.plot(cov, risk, label=f"{label} (AURC {aurc(np.asarray([x[key] for x in test]), loss):.3f})")
    op = report["threshold"]["test"]
    if op["risk"] is not None:
        ax.scatter([op["coverage"]], [op["risk"]], color="k", zorder=3, label="threshold from calibration")
    ax.axhline(report["threshold"]["target_risk"], color="grey", ls=":", label="target risk")
    ax.set_xlabel("coverage (share answered)")
    ax.set_ylabel("selective risk (1 - F1)")
    ax.set_title(f"Risk-coverage, test split (n={len(test)})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    d = report["data"]
    th = report["threshold"]
    lines = [
        "# Answer step: abstention on a risk-coverage curve",
        "",
        f"- data: `{d['path']}`: {d['num_questions']} questions ({d['num_unanswerable']} unanswerable), "
        f"{d['n_cal']} calibration / {d['n_test']} test; pool of {d['pool_size']} passages",
        f"- reader `{report['model']}`; retriever {report['retriever']} (gold passage shown for "
        f"{report['gold_passage_shown_rate_test']:.1%} of test questions)",
        f"- loss: {report['loss']}; always answering: F1 {fmt_number(report['always_answer_f1_test'])} on test",
        f"- confidence: logistic on {', '.join(report['confidence']['features'])}, calibrated to "
        f"{report['confidence']['target']}; test AUC for {report['confidence']['auc_label']} {fmt_number(report['confidence']['auc_test'])}",
        f"- AURC (test, lower is better): confidence {fmt_number(report['aurc']['system'], 4)}, top-1 similarity "
        f"{fmt_number(report['aurc']['similarity'], 4)}, answer log-prob {fmt_number(report['aurc']['answer_logprob'], 4)}, "
        f"no ranking {fmt_number(report['aurc']['random'], 4)}",
        "",
        "## Selective F1 (test; 95% bootstrap CI over questions)",
        "",
        "| coverage | confidence | always answer | top-1 similarity | confidence - always | confidence - similarity |",
        "|---|---|---|---|---|---|",
    ]

    def ci(x: dict[str, Any], key: str = "f1") -> str:
        return f"{fmt_number(x[key])} [{fmt_number(x['ci95'][0])}, {fmt_number(x['ci95'][1])}]"

    for c, s in report["selective_f1"].items():
        lines.append(
            f"| {c} | {ci(s['system'])} | {ci(s['always_answer'])} | {ci(s['similarity'])} | "
            f"{ci(s['system_minus_always'], 'delta')} | {ci(s['system_minus_similarity'], 'delta')} |"
        )
    lines += [
        "",
        f"## The threshold chosen on calibration for target risk {th['target_risk']}",
        "",
        "| ranking | threshold | cal coverage | cal risk | test coverage | test risk [95% CI] | refused: answerable | refused: unanswerable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, t, thr_value in (
        ("confidence", th, th["confidence"]),
        ("top-1 similarity", report["similarity_threshold"], report["similarity_threshold"]["threshold"]),
    ):
        x = t["test"]
        lines.append(
            f"| {label} | {fmt_number(thr_value, 4, none='inf')} | {fmt_number(t['calibration']['coverage'])} | "
            f"{fmt_number(t['calibration']['risk'])} | {fmt_number(x['coverage'])} | {fmt_number(x['risk'])} "
            f"[{fmt_number(x['risk_ci95'][0])}, {fmt_number(x['risk_ci95'][1])}] | "
            f"{fmt_number(x['refusal_rate_answerable'])} | {fmt_number(x['refusal_rate_unanswerable'])} |"
        )
    lines += [
        "",
        "## Refusals on test by reason (first that holds, in this order)",
        "",
        "| reason | refusals | share | unanswerable | answerable with a correct answer lost |",
        "|---|---|---|---|---|",
    ]
    for name, x in report["refusals"].items():
        lines.append(
            f"| {name} | {x['count']} | {fmt_number(x['share_of_refusals'])} | {x['unanswerable']} | "
            f"{x['answerable_correct_lost']} |"
        )
    fr = report["flag_rates_test"]
    lines += [
        "",
        "Flag rates on all test questions: "
        + ", ".join(f"{k} {v:.1%}" for k, v in fr.items())
        + " (passages_disagree is checked on refused questions only: it costs a reader call per in-set passage).",
        "",
        "## Risk-coverage (test)",
        "",
        "| coverage | risk |",
        "|---|---|",
    ]
    rc = report["risk_coverage"]
    for target in np.linspace(0.1, 1.0, 10):
        p = min(rc, key=lambda x: abs(x["coverage"] - target))
        lines.append(f"| {p['coverage']:.2f} | {p['risk']:.3f} |")
    return "\n".join(lines) + "\n"
