"""The study behind ``judgeloop agent``: the retrieval agent's policies compared on one data set.

Questions (a BEIR set's claims, PubMedQA or the SQuAD 2.0 sample, the corpus built from their contexts)
are split into calibration and test. On every question the study *explores* a small tree of action
sequences through the loop (:mod:`judgeloop.retrieval.agent`): dense alone, dense plus each other evidence
action, and the escalation chain up to ``max_rounds``; each leaf is answered. A judgeloop judge (the
``embedding`` judge: how much closer the question with the answer sits to the evidence than the question
with a refusal) scores every answer; on the calibration split it is calibrated (Platt scaling) against the
labels (F1 >= 0.5 for QA, a relevant abstract in the window for BEIR). Also on the calibration split: the
weak-retrieval gate (:class:`~judgeloop.retrieval.gate.WeakRetrievalGate`), the conformal retrieval set
(:class:`~judgeloop.retrieval.conformal.ConformalRetriever`), the answer confidence
(:class:`~judgeloop.routing.abstention.AnswerConfidence`) and its risk-coverage threshold, and two learned
controllers (:class:`~judgeloop.retrieval.agent_policies.ActionValueController`): one trained on the
calibrated judge's reward, one on the raw judge's (``sigmoid`` of its score).

On the test split every policy (``one_shot``, ``always_escalate``, ``gate_once``, ``confidence_triggered``,
``learned_calibrated``, ``learned_raw``, ``oracle``) runs through the loop; the report gives each one's
answer quality (EM/F1, or evidence recall for BEIR), the judge's support, evidence recall, rounds,
retrievals, LM calls, tokens and latency per question, with bootstrap intervals and paired differences
against ``one_shot`` (interval and minimum detectable difference, :func:`judgeloop.studies.stats.paired_bootstrap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from judgeloop.config import ConfigError, bounded, check_choices, check_fields
from judgeloop.logging import get_logger
from judgeloop.retrieval.agent import EVIDENCE_ACTIONS, AgentState, Budget, ScriptedPolicy, run_episode
from judgeloop.retrieval.dense import SCIFACT, EncoderConfig

logger = get_logger(__name__)

POLICIES = (
    "one_shot",
    "always_escalate",
    "gate_once",
    "confidence_triggered",
    "learned_calibrated",
    "learned_raw",
    "oracle",
)
GATE_SIGNALS = ["max_score", "score_std", "top_gap", "bm25_overlap", "term_coverage"]
CONFIDENCE_FEATURES = ["judge_raw", "answer_logprob", "top1", "num_in_set"]


@dataclass
class AgentDataConfig:
    """The questions and the corpus: ``format: beir`` reads ``corpus_path``, ``queries_path`` and
    ``qrels_path`` (as ``judgeloop gate`` does); ``squad2`` / ``pubmedqa`` read ``path`` and retrieve from
    the pool of the file's contexts (as ``judgeloop route`` does)."""

    format: Literal["beir", "squad2", "pubmedqa"] = "beir"
    corpus_path: str | None = f"{SCIFACT}/corpus.jsonl"
    queries_path: str | None = f"{SCIFACT}/queries_train.jsonl"
    qrels_path: str | None = f"{SCIFACT}/qrels_train.tsv"
    path: str | None = None
    answerable_only: bool = False  # squad2: drop the unanswerable questions
    max_questions: int | None = bounded(80, ge=4, hint=" (two splits of two) or null", shape="section")
    max_corpus_docs: int | None = bounded(None, ge=0)  # beir: relevant documents plus this many others

    def __post_init__(self) -> None:
        check_fields("data", self)
        beir = {
            "corpus_path": self.corpus_path,
            "queries_path": self.queries_path,
            "qrels_path": self.qrels_path,
        }
        if self.format == "beir":
            missing = [k for k, v in beir.items() if not v]
            if missing:
                raise ConfigError(
                    f"data.format=beir needs data.{missing[0]} (a BEIR corpus, queries and qrels)"
                )
        else:
            if not self.path:
                raise ConfigError(f"data.format={self.format} needs data.path (the {self.format} JSONL file)")
            defaults = {
                "corpus_path": f"{SCIFACT}/corpus.jsonl",
                "queries_path": f"{SCIFACT}/queries_train.jsonl",
                "qrels_path": f"{SCIFACT}/qrels_train.tsv",
            }
            given = [k for k, v in beir.items() if v and v != defaults[k]]
            if given:
                raise ConfigError(
                    f"data.{given[0]} is read for data.format=beir only; {self.format} retrieves from the "
                    "contexts of data.path: remove it"
                )


@dataclass
class AgentLMConfig:
    """The causal LM that rewrites, writes HyDE passages, decomposes and reads; generation lengths."""

    name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    batch_size: int = bounded(8, ge=1, shape="section")
    answer_max_new_tokens: int = bounded(12, ge=1, shape="section")
    rewrite_max_new_tokens: int = bounded(24, ge=1, shape="section")
    hyde_max_new_tokens: int = bounded(48, ge=1, shape="section")
    decompose_max_new_tokens: int = bounded(40, ge=1, shape="section")
    max_passage_tokens: int = bounded(160, ge=8, shape="section")

    def __post_init__(self) -> None:
        check_fields("model", self)


@dataclass
class ActionCosts:
    """The cost of each action in the reward (in units of judged answer quality, which lies in [0, 1])."""

    dense: float = bounded(0.0, ge=0.0)
    bm25: float = bounded(0.01, ge=0.0)
    fuse: float = bounded(0.01, ge=0.0)
    rewrite: float = bounded(0.03, ge=0.0)
    hyde: float = bounded(0.03, ge=0.0)
    decompose: float = bounded(0.05, ge=0.0)
    answer: float = bounded(0.0, ge=0.0)
    refuse: float = bounded(0.0, ge=0.0)

    def __post_init__(self) -> None:
        check_fields("costs", self)

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


@dataclass
class AgentJudgeSection:
    """The judge of the final answer (the ``embedding`` judge) and the refusal it compares answers with."""

    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    scale: float = bounded(20.0, gt=0.0)
    refusal_text: str = "I cannot answer this from the passages."

    def __post_init__(self) -> None:
        check_fields("judge", self)


@dataclass
class AgentConfig:
    """Schema of ``judgeloop agent``."""

    RUN_FREE_KEYS: ClassVar[tuple[str, ...]] = ("lm_cache_path",)  # a cache: the same outputs either way
    data: AgentDataConfig = field(default_factory=AgentDataConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    model: AgentLMConfig = field(default_factory=AgentLMConfig)
    judge: AgentJudgeSection = field(default_factory=AgentJudgeSection)
    costs: ActionCosts = field(default_factory=ActionCosts)
    actions: list[str] = field(default_factory=lambda: list(EVIDENCE_ACTIONS))
    escalation_order: list[str] = field(default_factory=lambda: ["fuse", "rewrite", "hyde", "decompose"])
    gate_escalation: str = "fuse"
    max_rounds: int = bounded(3, ge=1, hint=" (the first retrieval is a round)")
    max_tokens: int | None = bounded(None, ge=1, hint=" or null (no limit)")
    max_seconds: float | None = bounded(None, gt=0.0, hint=" or null (no limit)")
    answer_k: int = bounded(2, ge=1, hint=" (passages the reader gets)")
    depth: int = bounded(10, ge=1, hint=" (candidates each probe keeps)")
    signal_k: int = bounded(5, ge=2, hint=" (the gate's window; top_gap needs two)")
    refuse_reward: float = bounded(0.2, ge=0.0, le=1.0)
    correct_min_f1: float = bounded(0.5, gt=0.0, le=1.0, hint=" (the judge's label: F1 at least this)")
    target_risk: float = bounded(
        0.5, gt=0.0, lt=1.0, hint=" (mean 1 - quality allowed on answered questions)"
    )
    conformal_alpha: float = bounded(0.1, gt=0.0, lt=1.0)
    calibration_fraction: float = bounded(0.5, gt=0.0, lt=1.0)
    controller_l2: float = bounded(1.0, ge=0.0)
    num_bootstrap: int = bounded(2000, ge=10)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/agent"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    cache_dir: str | None = "auto"  # the embedding cache (embedding_cache.resolve_cache_dir); None: none
    # the LM outputs (JSONL, keyed by model, generation length and prompt); null: output_dir/lm_cache.jsonl.
    # Runs that differ in policy settings only can share one and generate nothing twice.
    lm_cache_path: str | None = None

    def __post_init__(self) -> None:
        check_fields("", self)
        check_choices("actions", self.actions, EVIDENCE_ACTIONS)
        if "dense" not in self.actions:
            raise ConfigError(
                f"actions={self.actions} lacks 'dense': every policy starts with a dense retrieval"
            )
        check_choices(
            "escalation_order",
            self.escalation_order,
            [a for a in self.actions if a != "dense"],
            hint=" (an escalation is an action in 'actions' other than dense)",
        )
        if self.gate_escalation not in self.actions or self.gate_escalation == "dense":
            raise ConfigError(
                f"gate_escalation={self.gate_escalation!r} must be one of the actions other than dense: "
                f"{[a for a in self.actions if a != 'dense']}"
            )
        if self.signal_k > self.depth:
            raise ConfigError(
                f"signal_k={self.signal_k} exceeds depth={self.depth}; the gate's window is cut from each probe's candidates"
            )


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


@dataclass
class AgentData:
    """Questions with their gold answers (None for BEIR) and gold documents (corpus indices), and the corpus."""

    fmt: str
    qids: list[str]
    questions: list[str]
    golds: list[list[str]] | None
    gold_docs: list[set[int]]
    doc_ids: list[str]
    doc_texts: list[str]

    @property
    def reads(self) -> bool:
        return self.golds is not None


def load_agent_data(cfg: AgentConfig) -> AgentData:
    """The questions (``data.max_questions`` drawn with ``seed``) and the corpus."""
    d = cfg.data
    rng = np.random.default_rng(cfg.seed)
    if d.format == "beir":
        from judgeloop.retrieval.beir import doc_text
        from judgeloop.retrieval.dense import RetrievalDataConfig, load_retrieval_data

        assert d.corpus_path and d.queries_path and d.qrels_path
        beir, _ = load_retrieval_data(
            RetrievalDataConfig(
                d.corpus_path, d.queries_path, d.qrels_path, max_corpus_docs=d.max_corpus_docs
            )
        )
        qids = list(beir.queries)
        if d.max_questions is not None and d.max_questions < len(qids):
            qids = [qids[i] for i in np.sort(rng.choice(len(qids), d.max_questions, replace=False))]
        doc_ids = sorted(beir.corpus)
        where = {x: i for i, x in enumerate(doc_ids)}
        gold = [{where[x] for x, g in beir.qrels[q].items() if g >= 1 and x in where} for q in qids]
        texts = [doc_text(beir.corpus[x]) for x in doc_ids]
        return AgentData("beir", qids, [beir.queries[q] for q in qids], None, gold, doc_ids, texts)
    from judgeloop.studies.routing import RouteDataConfig, load_questions

    assert d.path
    examples, pool = load_questions(RouteDataConfig(d.format, d.path, d.answerable_only, None))
    if d.max_questions is not None and d.max_questions < len(examples):
        examples = [examples[i] for i in np.sort(rng.choice(len(examples), d.max_questions, replace=False))]
    where = {p: i for i, p in enumerate(pool)}
    return AgentData(
        d.format,
        [ex.id for ex in examples],
        [ex.question for ex in examples],
        [list(ex.answers) for ex in examples],
        [{where[p] for p in ex.gold_passages} for ex in examples],
        [f"p{i}" for i in range(len(pool))],
        list(pool),
    )


def check_inputs(cfg: AgentConfig) -> None:
    """Every model resolves (before any data or weights load)."""
    from judgeloop.models import check_model

    try:
        check_model(cfg.encoder.name, "encoder.name")
        check_model(cfg.judge.model, "judge.model")
        check_model(cfg.model.name, "model.name")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def build_toolbox(cfg: AgentConfig, data: AgentData, cache_path: Path | None) -> Any:
    """The :class:`~judgeloop.retrieval.agent_tools.CorpusToolbox` of ``data``'s corpus."""
    from judgeloop.models import load_causal_lm, load_tokenizer
    from judgeloop.retrieval.agent_tools import CorpusToolbox, LMCache, LMSettings
    from judgeloop.retrieval.bm25 import build_bm25
    from judgeloop.retrieval.dense import encode_with
    from judgeloop.routing.llm import EXTRACT_ANSWER, YES_NO_MAYBE

    e = cfg.encoder
    enc = e.load()
    corpus_emb = encode_with(enc, data.doc_texts, cfg.cache_dir, e.batch_size)  # (N, D)

    def encode_query(texts: list[str]) -> np.ndarray:
        return encode_with(enc, texts, None, e.batch_size, is_query=True)

    m = cfg.model
    settings = LMSettings(
        m.rewrite_max_new_tokens,
        m.hyde_max_new_tokens,
        m.decompose_max_new_tokens,
        m.answer_max_new_tokens,
        m.batch_size,
        m.max_passage_tokens,
        YES_NO_MAYBE if data.fmt == "pubmedqa" else EXTRACT_ANSWER,
    )
    return CorpusToolbox(
        data.doc_ids,
        data.doc_texts,
        corpus_emb,
        encode_query,
        build_bm25(data.doc_texts),
        load_causal_lm(m.name),
        load_tokenizer(m.name),
        LMCache(cache_path, m.name),
        settings,
        reads=data.reads,
    )


def split(cfg: AgentConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibration and test question indices (sorted)."""
    perm = np.random.default_rng(cfg.seed + 1).permutation(n)
    n_cal = int(round(cfg.calibration_fraction * n))
    if n_cal < 2 or n - n_cal < 2:
        raise ConfigError(
            f"calibration_fraction={cfg.calibration_fraction} leaves a split under 2 of {n} questions"
        )
    return np.sort(perm[:n_cal]), np.sort(perm[n_cal:])


def budget_of(cfg: AgentConfig) -> Budget:
    return Budget(cfg.max_rounds, cfg.max_tokens, cfg.max_seconds)


# ----------------------------------------------------------------------------------------------
# Scoring an outcome
# ----------------------------------------------------------------------------------------------


def score_outcome(data: AgentData, i: int, answer: str | None, window: list[int]) -> dict[str, float]:
    """True quality of question ``i``'s outcome: EM, F1 (QA; a refusal scores 1 on an unanswerable
    question, as SQuAD 2.0's empty answer does), evidence recall of the window, and ``quality`` (F1 for QA,
    evidence recall for BEIR; a refusal scores 0 on BEIR)."""
    from judgeloop.metrics.qa import exact_match, token_f1

    gold = data.gold_docs[i]
    recall = len(gold & set(window)) / len(gold) if gold else math.nan
    if data.golds is None:
        return {
            "em": math.nan,
            "f1": math.nan,
            "evidence_recall": recall,
            "quality": 0.0 if answer is None else recall,
        }
    g = data.golds[i]
    a = "" if answer is None else answer
    em, f1 = exact_match(a, g), token_f1(a, g)
    return {"em": em, "f1": f1, "evidence_recall": recall, "quality": f1}


def label_of(data: AgentData, scores: dict[str, float], min_f1: float) -> int:
    """The judge's calibration label: F1 >= ``min_f1`` (QA) or a relevant document in the window (BEIR)."""
    if data.golds is None:
        return int(scores["evidence_recall"] > 0)
    return int(scores["f1"] >= min_f1)


@dataclass
class Fitted:
    """What the calibration split fixes: judge calibrator, gate, conformal retriever, answer confidence and
    its threshold, the two controllers."""

    judge: Any
    calibrator: Any = None
    gate: Any = None
    gate_info: dict[str, Any] = field(default_factory=dict)
    conformal: Any = None
    confidence: Any = None
    threshold: Any = None
    controllers: dict[str, Any] = field(default_factory=dict)


class Observer:
    """The signals a policy sees at a state: the gate's signals on the window (its flag once fitted), the
    conformal set's size in the answer window, and with ``draft`` the reader's answer at the window (charged
    to the budget), the judge's raw score and calibrated probability, and the answer confidence."""

    def __init__(self, cfg: AgentConfig, data: AgentData, tb: Any, fitted: Fitted, draft: bool) -> None:
        self.cfg, self.data, self.tb, self.fitted, self.draft = cfg, data, tb, fitted, draft
        self._bm25: dict[str, np.ndarray] = {}

    def __call__(self, state: AgentState, toolbox: Any, budget: Budget) -> dict[str, float]:
        from judgeloop.retrieval.agent import draft_answer

        if not state.rankings:
            return {}
        sig = self.window_signals(state.question, state.window(self.cfg.signal_k), state.window())
        sig["rounds"] = float(state.rounds)
        if self.draft:
            out = draft_answer(state, toolbox, budget)
            if out is not None:
                sig.update(self.answer_signals(state.question, state.window(), out.text, out.logprob_mean))
        if self.fitted.confidence is not None and "judge_raw" in sig:
            x = {k: np.asarray([sig.get(k, 0.0)]) for k in CONFIDENCE_FEATURES}
            sig["confidence"] = float(self.fitted.confidence.predict(x)[0])
        return sig

    def window_signals(
        self, question: str, sig_window: list[int], answer_window: list[int]
    ) -> dict[str, float]:
        from judgeloop.retrieval.conformal import map_scores
        from judgeloop.retrieval.gate import GateInputs, compute_signals

        sims = self.tb.similarity(question, sig_window)
        order = np.argsort(-sims, kind="stable")
        if question not in self._bm25:
            self._bm25[question] = np.asarray(self.tb.retrieve("bm25", question, len(sig_window))[0])
        inputs = GateInputs(
            scores=sims[order][None, :],
            ids=np.asarray(sig_window)[order][None, :],
            bm25_ids=self._bm25[question][None, :],
            queries=[question],
            docs=[[self.tb.doc_texts[j] for j in sig_window]],
        )
        raw = {k: float(v[0]) for k, v in compute_signals(inputs, GATE_SIGNALS).items()}
        out = {
            "top1": raw["max_score"],
            "top_gap": raw["top_gap"],
            "score_std": raw["score_std"],
            "bm25_overlap": raw["bm25_overlap"],
            "term_coverage": raw["term_coverage"],
            **{f"gate:{k}": v for k, v in raw.items()},
        }
        f = self.fitted
        if f.gate is not None:
            out["gate_weak"] = float(f.gate.predict({k: np.asarray([v]) for k, v in raw.items()})[0])
        if f.conformal is not None:
            s = map_scores(self.tb.similarity(question, answer_window)[None, :], "affine")
            out["num_in_set"] = float(f.conformal.predict(s).sum())
        return out

    def answer_signals(
        self, question: str, window: list[int], answer: str, logprob: float
    ) -> dict[str, float]:
        raw = judge_raw(self.cfg, self.fitted.judge, self.tb, question, window, answer)
        out = {"judge_raw": raw, "answer_logprob": logprob if math.isfinite(logprob) else -20.0}
        if self.fitted.calibrator is not None:
            out["judged"] = float(self.fitted.calibrator.predict_proba([raw])[0])
        return out


def judge_raw(cfg: AgentConfig, judge: Any, tb: Any, question: str, window: list[int], answer: str) -> float:
    """The judge's raw score of ``answer`` against the refusal, with the window's text as the article."""
    from judgeloop.judges.base import Pair

    article = "\n".join(tb.doc_texts[j] for j in window) or question
    a = question if not tb.reads else f"{question} {answer}"
    b = cfg.judge.refusal_text if not tb.reads else f"{question} {cfg.judge.refusal_text}"
    out = judge.score([Pair(article, a, b)])
    return float(out.scores[0])


# ----------------------------------------------------------------------------------------------
# Exploration: the tree of action sequences every question is answered at
# ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One explored leaf: question ``q``, the state after ``script`` and its answer, signals and scores."""

    q: int
    script: tuple[str, ...]
    state: AgentState
    answer: str | None
    logprob: float
    signals: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    label: int = 0
    judged: dict[str, float] = field(default_factory=dict)  # "calibrated" / "raw" -> judged quality


def explored_scripts(cfg: AgentConfig) -> list[tuple[str, ...]]:
    """Dense alone, dense plus each other evidence action, and the escalation chain up to ``max_rounds``."""
    out: list[tuple[str, ...]] = [("dense",)]
    if cfg.max_rounds >= 2:
        out += [("dense", a) for a in cfg.actions if a != "dense"]
    chain = list(cfg.escalation_order)
    for j in range(2, min(cfg.max_rounds - 1, len(chain)) + 1):
        out.append(("dense", *chain[:j]))
    return list(dict.fromkeys(out))


def explore(cfg: AgentConfig, data: AgentData, tb: Any, obs: Observer) -> list[Outcome]:
    """Every question through every explored script (LM outputs prefetched in batches), answered."""
    from judgeloop.retrieval.agent import LM_ACTIONS, draft_answer

    budget = budget_of(cfg)
    for a in LM_ACTIONS:
        if a in cfg.actions:
            tb.prefetch(a, data.questions)
    leaves = []
    for i, q in enumerate(data.questions):
        for script in explored_scripts(cfg):
            st = run_episode(
                q, tb, ScriptedPolicy([*script, "refuse"]), budget, None, cfg.actions, cfg.answer_k, cfg.depth
            )
            leaves.append((i, script, st))
    tb.prefetch("answer", [data.questions[i] for i, _, _ in leaves], [st.window() for _, _, st in leaves])
    outcomes = []
    for i, script, st in leaves:
        out = draft_answer(st, tb, budget)
        answer = None if out is None else out.text
        o = Outcome(i, script, st, answer, math.nan if out is None else out.logprob_mean)
        o.scores = score_outcome(data, i, answer, st.window())
        o.label = label_of(data, o.scores, cfg.correct_min_f1)
        outcomes.append(o)
    logger.info("explored %d leaves of %d questions", len(outcomes), len(data.questions))
    return outcomes


def outcome_signals(obs: Observer, o: Outcome) -> dict[str, float]:
    """The signals a policy would see at the outcome's state (the answer drafted there)."""
    st = o.state
    sig = obs.window_signals(st.question, st.window(obs.cfg.signal_k), st.window())
    sig["rounds"] = float(st.rounds)
    if o.answer is not None:
        sig.update(obs.answer_signals(st.question, st.window(), o.answer, o.logprob))
    return sig


# ----------------------------------------------------------------------------------------------
# What the calibration split fixes
# ----------------------------------------------------------------------------------------------


def fit_judge_calibrator(outcomes: list[Outcome], cal: set[int]) -> Any:
    """Platt scaling (with an intercept: an answer against a refusal has no symmetry) of the judge's raw
    score on the calibration leaves' labels."""
    from judgeloop.calibration.calibrators import CalibrationError, PlattCalibrator
    from judgeloop.io import DataError

    rows = [
        o
        for o in outcomes
        if o.q in cal and o.answer is not None and math.isfinite(o.signals.get("judge_raw", math.nan))
    ]
    try:
        return PlattCalibrator(symmetric=False, fit_intercept=True).fit(
            [o.signals["judge_raw"] for o in rows], [o.label for o in rows]
        )
    except CalibrationError as err:
        raise DataError(f"cannot calibrate the answer judge on the calibration split: {err}") from None


def fit_gate(cfg: AgentConfig, outcomes: list[Outcome], cal: set[int]) -> tuple[Any, dict[str, Any]]:
    """The weak-retrieval gate on the calibration questions' first retrieval (weak: a relevant document
    missing from the answer window); None with the reason when no signal separates."""
    from judgeloop.retrieval.gate import WeakRetrievalGate, gate_metrics

    roots = [o for o in outcomes if o.q in cal and o.script == ("dense",)]
    weak = np.asarray([o.scores["evidence_recall"] < 1.0 for o in roots])
    signals = {k: np.asarray([o.signals[f"gate:{k}"] for o in roots]) for k in GATE_SIGNALS}
    try:
        gate = WeakRetrievalGate(min_separation=0.55, combine="single").fit(signals, weak)
    except ValueError as err:
        return None, {"fitted": False, "why": str(err), "weak_rate_cal": float(weak.mean())}
    name = gate.state_.signals[0]
    return gate, {
        "fitted": True,
        "signal": name,
        "threshold": gate.state_.orientation[name] * gate.state_.thresholds[name],
        "fires_when": "<=" if gate.state_.orientation[name] > 0 else ">=",
        "cal": gate_metrics(gate.predict(signals), weak),
    }


def fit_conformal(cfg: AgentConfig, data: AgentData, tb: Any, cal: np.ndarray) -> Any:
    """The document-guarantee conformal retriever on the calibration questions' whole-corpus scores."""
    from judgeloop.retrieval.conformal import ConformalRetriever, map_scores

    q = tb.query_embedding([data.questions[i] for i in cal])  # (C, D)
    sim = q @ tb.corpus_emb.T  # (C, N)
    gold = np.zeros(sim.shape, dtype=bool)
    for r, i in enumerate(cal):
        gold[r, list(data.gold_docs[i])] = True
    miss = np.zeros(len(cal), dtype=np.int64)  # every document is scored: no relevant one is missing
    return ConformalRetriever(cfg.conformal_alpha, "document").fit(map_scores(sim, "affine"), gold, miss)


def controller_rows(
    cfg: AgentConfig, outcomes: list[Outcome], cal: set[int], kind: str
) -> tuple[np.ndarray, list[str], list[float]]:
    """The controller's training rows on the calibration questions: at each explored state, each action
    explored from it and its reward-to-go (the ``kind`` judge's quality of the answer it led to minus the
    cost of that action and of answering)."""
    from judgeloop.retrieval.agent_policies import feature_vector

    c = cfg.costs.as_dict()
    by = {(o.q, o.script): o for o in outcomes if o.q in cal}
    X, acts, rewards = [], [], []
    for (q, script), o in by.items():
        if o.answer is None:
            continue
        X.append(feature_vector(o.signals))
        acts.append("answer")
        rewards.append(o.judged[kind] - c["answer"])
        parent = by.get((q, script[:-1]))
        if len(script) >= 2 and parent is not None:
            X.append(feature_vector(parent.signals))
            acts.append(script[-1])
            rewards.append(o.judged[kind] - c[script[-1]] - c["answer"])
    return np.asarray(X), acts, rewards


def fit_all(
    cfg: AgentConfig, data: AgentData, tb: Any, outcomes: list[Outcome], cal: np.ndarray, judge: Any
) -> Fitted:
    """Fit, on the calibration split only: judge calibrator, gate, conformal set, answer confidence and its
    risk-coverage threshold, and the two controllers; the leaves' signals are recomputed with them."""
    from judgeloop.retrieval.agent_policies import ActionValueController
    from judgeloop.routing.abstention import AnswerConfidence, RiskThreshold

    cal_set = set(cal.tolist())
    fitted = Fitted(judge)
    obs = Observer(cfg, data, tb, fitted, draft=False)
    for o in outcomes:
        o.signals = outcome_signals(obs, o)
    fitted.calibrator = fit_judge_calibrator(outcomes, cal_set)
    fitted.gate, fitted.gate_info = fit_gate(cfg, outcomes, cal_set)
    fitted.conformal = fit_conformal(cfg, data, tb, cal)
    for o in outcomes:
        o.signals = outcome_signals(obs, o)
        raw = o.signals.get("judge_raw", math.nan)
        o.judged = {"calibrated": o.signals.get("judged", math.nan), "raw": float(1 / (1 + np.exp(-raw)))}
    rows = [o for o in outcomes if o.q in cal_set and o.answer is not None]
    x = {k: np.asarray([o.signals.get(k, 0.0) for o in rows]) for k in CONFIDENCE_FEATURES}
    quality = np.asarray([o.scores["quality"] for o in rows])
    fitted.confidence = AnswerConfidence(CONFIDENCE_FEATURES).fit(x, quality)
    fitted.threshold = RiskThreshold(cfg.target_risk).fit(fitted.confidence.predict(x), 1.0 - quality)
    for o in outcomes:
        if "judge_raw" in o.signals:
            xo = {k: np.asarray([o.signals.get(k, 0.0)]) for k in CONFIDENCE_FEATURES}
            o.signals["confidence"] = float(fitted.confidence.predict(xo)[0])
    for kind in ("calibrated", "raw"):
        X, acts, rewards = controller_rows(cfg, outcomes, cal_set, kind)
        fitted.controllers[kind] = ActionValueController(cfg.controller_l2).fit(X, acts, rewards)
    return fitted


# ----------------------------------------------------------------------------------------------
# The policies on the test split
# ----------------------------------------------------------------------------------------------


def oracle_script(cfg: AgentConfig, data: AgentData, outcomes: list[Outcome], i: int) -> list[str]:
    """The explored actions with the best true quality minus cost for question ``i`` (refusing included)."""
    c = cfg.costs.as_dict()
    refusal = score_outcome(data, i, None, [])["quality"] - c["refuse"]
    best, value = ["refuse"], refusal
    for o in outcomes:
        if o.q != i or o.answer is None:
            continue
        acts = [a for a in o.state.actions if a in EVIDENCE_ACTIONS]  # the leaf's terminal step dropped
        v = o.scores["quality"] - sum(c[a] for a in acts) - c["answer"]
        if v > value + 1e-12:
            best, value = [*acts, "answer"], v
    return best


def make_policies(cfg: AgentConfig, fitted: Fitted) -> dict[str, tuple[Any, bool | None]]:
    """Name -> (policy, observer: None none, False signals only, True with a drafted answer)."""
    from judgeloop.retrieval.agent_policies import (
        ConfidenceTriggered,
        GateOnce,
        LearnedPolicy,
        always_escalate,
        one_shot,
    )

    return {
        "one_shot": (one_shot(), None),
        "always_escalate": (always_escalate(cfg.escalation_order), None),
        "gate_once": (GateOnce(cfg.gate_escalation), False),
        "confidence_triggered": (
            ConfidenceTriggered(fitted.threshold.threshold_, cfg.escalation_order),
            True,
        ),
        "learned_calibrated": (
            LearnedPolicy(fitted.controllers["calibrated"], cfg.refuse_reward, "learned_calibrated"),
            True,
        ),
        "learned_raw": (LearnedPolicy(fitted.controllers["raw"], cfg.refuse_reward, "learned_raw"), True),
    }


def episode_metrics(
    cfg: AgentConfig, data: AgentData, tb: Any, fitted: Fitted, i: int, st: AgentState
) -> dict[str, float]:
    """Per question: EM/F1, quality, evidence recall, the judge's support (calibrated), costs and rewards."""
    from judgeloop.retrieval.agent_policies import action_reward

    answer = None if st.refused else st.answer
    m = score_outcome(data, i, answer, st.window())
    judged = math.nan
    if answer is not None:
        raw = judge_raw(cfg, fitted.judge, tb, st.question, st.window(), answer)
        judged = float(fitted.calibrator.predict_proba([raw])[0])
    c = cfg.costs.as_dict()
    return {
        **m,
        "judged_support": judged,
        "refused": float(st.refused),
        "rounds": float(st.rounds),
        "retrievals": float(st.retrievals),
        "lm_calls": float(st.lm_calls),
        "tokens": float(st.tokens),
        "seconds": float(st.seconds),
        "repeats": float(st.repeats),
        "reward_true": m["quality"] - sum(c.get(a, 0.0) for a in st.actions),
        "reward_judged": action_reward(
            0.0 if math.isnan(judged) else judged, st.actions, c, st.refused, cfg.refuse_reward
        ),
    }


def run_policies(
    cfg: AgentConfig, data: AgentData, tb: Any, fitted: Fitted, outcomes: list[Outcome], test: np.ndarray
) -> tuple[dict[str, list[dict[str, float]]], list[dict[str, Any]]]:
    """Every policy on every test question: per-policy metric rows (test order) and one trace row per question."""
    budget = budget_of(cfg)
    policies = make_policies(cfg, fitted)
    observers = {d: (None if d is None else Observer(cfg, data, tb, fitted, d)) for d in (None, False, True)}
    metrics: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    traces = []
    for i in test.tolist():
        q = data.questions[i]
        row: dict[str, Any] = {
            "id": data.qids[i],
            "question": q,
            "gold_answers": None if data.golds is None else data.golds[i],
            "gold_docs": sorted(data.doc_ids[j] for j in data.gold_docs[i]),
            "policies": {},
        }
        runs = {name: (pol, observers[d]) for name, (pol, d) in policies.items()}
        runs["oracle"] = (ScriptedPolicy(oracle_script(cfg, data, outcomes, i), "oracle"), None)
        for name in POLICIES:
            pol, obs = runs[name]
            st = run_episode(q, tb, pol, budget, obs, cfg.actions, cfg.answer_k, cfg.depth)
            m = episode_metrics(cfg, data, tb, fitted, i, st)
            metrics[name].append(m)
            row["policies"][name] = {**compact_trace(st), "metrics": m}
        traces.append(row)
    return metrics, traces


def compact_trace(st: AgentState) -> dict[str, Any]:
    """The trace with candidate scores rounded and each probe's candidates cut to the window's depth."""
    t = st.trace()
    for s in t["steps"]:
        s["signals"] = {k: round(v, 4) for k, v in s["signals"].items() if not k.startswith("gate:")}
    return t


# ----------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------

NOTE = (
    "Multi-hop: no multi-hop set (HotpotQA, 2WikiMultiHopQA, MuSiQue) is in ../shared/data and none installs "
    "offline here, so decompose is measured on single-hop questions only. The oracle takes, per question, the "
    "explored action sequence (or refusal) with the best true quality minus cost: an upper bound for the "
    "menu, not a policy."
)


def judge_summary(
    cfg: AgentConfig, outcomes: list[Outcome], test: set[int], fitted: Fitted
) -> dict[str, Any]:
    """How the judge reads the test leaves: AUC for the label, Brier of the calibrated and raw probabilities."""
    from judgeloop.retrieval.gate import auc

    rows = [o for o in outcomes if o.q in test and o.answer is not None]
    y = np.asarray([o.label for o in rows], dtype=float)
    cal_p = np.asarray([o.judged["calibrated"] for o in rows])
    raw_p = np.asarray([o.judged["raw"] for o in rows])
    return {
        "name": f"embedding judge ({cfg.judge.model}, scale {cfg.judge.scale}): question + answer vs question + refusal, against the window",
        "label": f"F1 >= {cfg.correct_min_f1}"
        if cfg.data.format != "beir"
        else "a relevant document in the window",
        "calibrator": fitted.calibrator.state_dict() if hasattr(fitted.calibrator, "state_dict") else None,
        "auc_test": auc(cal_p, y.astype(bool)) if rows else math.nan,
        "brier_calibrated_test": float(np.mean((cal_p - y) ** 2)) if rows else math.nan,
        "brier_raw_test": float(np.mean((raw_p - y) ** 2)) if rows else math.nan,
        "label_rate_test": float(y.mean()) if rows else math.nan,
        "n_test_leaves": len(rows),
    }


def agent_study(cfg: AgentConfig, out_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load, explore, fit on calibration, run every policy on test; returns the report and the trace rows.
    LM outputs are cached in ``out_dir/lm_cache.jsonl`` (a restarted run continues from them)."""
    from judgeloop.judges.embedding import EmbeddingJudge
    from judgeloop.studies.agent_report import action_counts, summarize_policy

    check_inputs(cfg)
    data = load_agent_data(cfg)
    cal, test = split(cfg, len(data.questions))
    logger.info(
        "%d questions (%d calibration / %d test), corpus %d",
        len(data.questions),
        cal.size,
        test.size,
        len(data.doc_ids),
    )
    tb = build_toolbox(cfg, data, Path(cfg.lm_cache_path or Path(out_dir) / "lm_cache.jsonl"))
    judge = EmbeddingJudge(cfg.judge.model, scale=cfg.judge.scale, max_length=256)
    fitted = Fitted(judge)
    outcomes = explore(cfg, data, tb, Observer(cfg, data, tb, fitted, draft=False))
    fitted = fit_all(cfg, data, tb, outcomes, cal, judge)
    metrics, traces = run_policies(cfg, data, tb, fitted, outcomes, test)
    thr = fitted.threshold
    report: dict[str, Any] = {
        "data": {
            "format": cfg.data.format,
            "source": cfg.data.path if cfg.data.format != "beir" else cfg.data.queries_path,
            "num_questions": len(data.questions),
            "n_cal": int(cal.size),
            "n_test": int(test.size),
            "corpus_size": len(data.doc_ids),
        },
        "model": cfg.model.name,
        "encoder": cfg.encoder.name,
        "answer_k": cfg.answer_k,
        "budget": {
            "max_rounds": cfg.max_rounds,
            "max_tokens": cfg.max_tokens,
            "max_seconds": cfg.max_seconds,
        },
        "costs": cfg.costs.as_dict(),
        "refuse_reward": cfg.refuse_reward,
        "explored_scripts": [list(s) for s in explored_scripts(cfg)],
        "judge": judge_summary(cfg, outcomes, set(test.tolist()), fitted),
        "gate": fitted.gate_info,
        "conformal": {"alpha": cfg.conformal_alpha, "threshold": fitted.conformal.threshold_},
        "confidence": {
            "features": CONFIDENCE_FEATURES,
            "target_risk": cfg.target_risk,
            "threshold": thr.threshold_,
            "met_on_calibration": thr.met_,
            "cal_coverage": thr.coverage_,
            "cal_risk": thr.risk_,
        },
        "controllers": {k: c.state_dict() for k, c in fitted.controllers.items()},
        "policies": {
            name: summarize_policy(metrics[name], metrics["one_shot"], cfg.num_bootstrap, cfg.seed)
            for name in POLICIES
        },
        "actions_taken": {name: action_counts(traces, name) for name in POLICIES},
        "lm_cache_outputs": len(tb.cache.rows),
        "note": NOTE,
    }
    return report, traces
