"""The study behind ``judgeloop route``: confidence routing for QA against never / always /
random-matched / oracle routing.

Every sampled question gets both a closed-book probe (answer + confidence) and a retrieval-augmented
answer (top-k passages from the pool of all the file's passages). The threshold is chosen on a
selection split (max F1, optionally under a retrieval budget), frozen, and applied to the test split,
where all five policies are scored on the same answers. On the test split every policy's F1 is compared
with never / always / random-matched routing by a paired bootstrap over questions, with Holm's
correction across the family; the confidence gets the account's three diagnostics
(:mod:`judgeloop.routing.diagnostics`). The routed model runs in process or behind an OpenAI-compatible
server (``model.type: served``). :func:`route_study` returns the report and the per-question rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from judgeloop.config import bounded, check_fields
from judgeloop.judges.served_client import EndpointConfig, check_served
from judgeloop.logging import get_logger
from judgeloop.retrieval.bm25 import bm25_topk, build_bm25
from judgeloop.retrieval.dense import EncoderConfig, dense_topk, encode_with
from judgeloop.text import fmt_number

logger = get_logger(__name__)


@dataclass
class RouteDataConfig:
    """The QA data of ``judgeloop route`` (SQuAD 2.0 or PubMedQA) and its size."""

    format: Literal["squad2", "pubmedqa"] = "squad2"
    path: str = "../shared/data/squad2_sample/squad2_sample.jsonl"
    answerable_only: bool = True  # SQuAD 2.0: drop unanswerable questions
    max_questions: int | None = bounded(80, ge=4, hint=" (two splits of two) or null", shape="section")

    def __post_init__(self) -> None:
        check_fields("data", self)


@dataclass
class LMConfig:
    """The language model that answers (and is probed for confidence)."""

    name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    max_new_tokens: int = bounded(16, ge=0)
    batch_size: int = bounded(8, ge=0)

    def __post_init__(self) -> None:
        check_fields("model", self)


@dataclass
class RoutedServerConfig(EndpointConfig):
    """The server of a served routed model (``model.server``, with ``model.type: served``): an
    OpenAI-compatible ``/v1/chat/completions`` (vLLM, llama.cpp, SGLang, a hosted API)."""

    SECTION: ClassVar[str] = "model.server"


@dataclass
class RoutedLMConfig(LMConfig):
    """The routed model of ``judgeloop route``: in process (``type: local``, ``name`` a Hugging Face model)
    or behind a server (``type: served``, ``server``; ``name`` is then not used)."""

    type: Literal["local", "served"] = "local"
    server: RoutedServerConfig = field(default_factory=RoutedServerConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.type == "served":
            check_served(self.server, "model.type=served")
        elif self.server.base_url:
            raise ValueError(
                f"model.server.base_url={self.server.base_url!r} is set but model.type=local (the in-process "
                f"model {self.name!r} would answer); set model.type=served, or drop model.server"
            )


@dataclass
class RetrieverSection:
    """The retriever of the RAG arm: dense or BM25, and how many passages."""

    type: Literal["dense", "bm25"] = "dense"
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    top_k: int = bounded(2, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("retriever", self)


@dataclass
class RouterSection:
    """How the router's threshold is chosen: confidence kind, selection split, budget."""

    confidence: Literal["logit", "verbalized"] = "logit"
    selection_fraction: float = bounded(0.5, gt=0.0, lt=1.0, shape="section")
    max_retrieval_rate: float | None = bounded(
        None, ge=0.0, le=1.0, hint=" or null (no budget)", shape="section"
    )
    # the probe's token budget (null: model.max_new_tokens); a verbalized JSON reply needs ~24 tokens
    probe_max_new_tokens: int | None = bounded(None, ge=1, hint=" or null (model.max_new_tokens)")
    correct_min_f1: float = bounded(0.5, ge=0.0, lt=1.0)  # a closed-book answer is correct above this F1
    num_bootstrap: int = bounded(2000, ge=100)  # replicates of the paired intervals and the diagnostics
    alpha: float = bounded(0.05, gt=0.0, lt=1.0)  # family-wise error rate of the Holm-corrected comparisons

    def __post_init__(self) -> None:
        check_fields("router", self)


@dataclass
class QAStudyConfig:
    """What the question-answering studies share (``judgeloop route`` and ``judgeloop answer``): the
    questions, the reader, the retriever, the seed and where outputs and the embedding cache go."""

    data: RouteDataConfig = field(default_factory=RouteDataConfig)
    model: LMConfig = field(default_factory=LMConfig)
    retriever: RetrieverSection = field(default_factory=RetrieverSection)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/route"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    cache_dir: str | None = "auto"  # the judgeloop cache (embedding_cache.resolve_cache_dir); None: none

    def __post_init__(self) -> None:
        check_fields("", self)


@dataclass
class RouteConfig(QAStudyConfig):
    """Schema of ``judgeloop route``: a :class:`QAStudyConfig` and how the router chooses its threshold."""

    model: RoutedLMConfig = field(default_factory=RoutedLMConfig)
    router: RouterSection = field(default_factory=RouterSection)


def load_questions(cfg: RouteDataConfig) -> tuple[list[Any], list[str]]:
    """The questions and the pool of passages they are retrieved from (every paragraph of the file)."""
    from judgeloop.routing.readers import passage_pool, read_pubmedqa, read_squad2

    if cfg.format == "squad2":
        questions = read_squad2(cfg.path, cfg.answerable_only)
        pool = passage_pool(read_squad2(cfg.path, answerable_only=False))
    else:
        questions = read_pubmedqa(cfg.path)
        pool = passage_pool(questions)
    return questions, pool


def retrieve_passages(
    cfg: RouteConfig, questions: list[str], pool: list[str]
) -> tuple[list[list[int]], float]:
    """Top-k pool indices per question and the per-question retrieval latency (seconds)."""
    r = cfg.retriever
    k = min(r.top_k, len(pool))
    if r.type == "bm25":
        index = build_bm25(pool)
        t0 = time.perf_counter()
        _, idx = bm25_topk(index, questions, k)
        return idx.tolist(), (time.perf_counter() - t0) / len(questions)
    e = r.encoder
    pool_emb = encode_with(e, pool, cfg.cache_dir, e.batch_size)
    t0 = time.perf_counter()  # the per-question cost: load the encoder, encode the questions, search
    q_emb = encode_with(e, questions, None, e.batch_size, is_query=True)
    _, idx = dense_topk(q_emb, pool_emb, k)
    return idx.tolist(), (time.perf_counter() - t0) / len(questions)


def routed_model(cfg: RouteConfig) -> Any:
    """The routed model (a :class:`~judgeloop.routing.llm.TextGenerator`) through the answer cache of
    ``cache_dir``. A served one is checked first (the server answers, serves ``model.server.model``, takes
    the key): a one-line error before any retrieval or generation."""
    from judgeloop.retrieval.embedding_cache import resolve_cache_dir
    from judgeloop.routing.llm import CachedLM, LocalLM, ServedLM

    m = cfg.model
    lm: Any
    if m.type == "served":
        from judgeloop.judges.served_client import ChatClient, read_api_key

        client = ChatClient(m.server, read_api_key(m.server))
        client.connect()
        lm = ServedLM(client)
    else:
        from judgeloop.models import load_causal_lm, load_tokenizer

        lm = LocalLM(load_causal_lm(m.name), load_tokenizer(m.name), m.name, m.batch_size)
    folder = resolve_cache_dir(cfg.cache_dir, "answers")  # auto: the judgeloop cache, not the working dir
    return CachedLM(lm, folder) if folder is not None else lm


def route_study(cfg: RouteConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Probe closed-book, answer with retrieval, fit the router on the selection split and compare it with
    the baselines on the test split; returns the report and one prediction row per question."""
    from judgeloop.routing.diagnostics import confidence_diagnostics
    from judgeloop.routing.llm import SHORT_ANSWER, YES_NO_MAYBE, answer_with, probe_with
    from judgeloop.routing.metrics import exact_match, token_f1
    from judgeloop.routing.router import ConfidenceRouter, RoutingOutcomes, routing_table

    rng = np.random.default_rng(cfg.seed)
    examples, pool = load_questions(cfg.data)  # the data's checks first: a bad row stops before any work
    lm = routed_model(cfg)  # a served model's connection is checked before retrieval and generation
    if cfg.data.max_questions is not None and cfg.data.max_questions < len(examples):
        keep = np.sort(rng.choice(len(examples), cfg.data.max_questions, replace=False))
        examples = [examples[i] for i in keep]
    qs = [ex.question for ex in examples]
    logger.info("%d questions, pool of %d passages", len(qs), len(pool))

    top, retrieval_s = retrieve_passages(cfg, qs, pool)
    passages = [[pool[j] for j in row] for row in top]
    gold_hit = np.asarray([any(p in ex.gold_passages for p in ps) for ex, ps in zip(examples, passages)])

    m, rc = cfg.model, cfg.router
    instruction = YES_NO_MAYBE if cfg.data.format == "pubmedqa" else SHORT_ANSWER
    probe_tokens = rc.probe_max_new_tokens or m.max_new_tokens
    closed, conf, probe_gens = probe_with(lm, qs, rc.confidence, probe_tokens, instruction)
    rag, rag_gens = answer_with(lm, qs, passages, m.max_new_tokens, instruction)

    golds = [ex.answers for ex in examples]
    o = RoutingOutcomes(
        confidence=conf,
        em_closed=np.asarray([exact_match(a, g) for a, g in zip(closed, golds)]),
        f1_closed=np.asarray([token_f1(a, g) for a, g in zip(closed, golds)]),
        em_rag=np.asarray([exact_match(a, g) for a, g in zip(rag, golds)]),
        f1_rag=np.asarray([token_f1(a, g) for a, g in zip(rag, golds)]),
        tokens_probe=np.asarray([_tokens(g) for g in probe_gens]),
        tokens_rag=np.asarray([_tokens(g) for g in rag_gens]),
        latency_probe=np.asarray([g.seconds for g in probe_gens]),
        latency_rag=np.asarray([g.seconds + retrieval_s for g in rag_gens]),
        passages_rag=np.full(len(qs), float(len(passages[0]))),
    )
    perm = rng.permutation(len(qs))
    n_sel = int(round(rc.selection_fraction * len(qs)))
    sel, test = perm[:n_sel], perm[n_sel:]
    router = ConfidenceRouter(rc.max_retrieval_rate).fit(conf[sel], o.f1_closed[sel], o.f1_rag[sel])
    retrieve_test = router.predict(conf[test])
    table = routing_table(o.subset(test), retrieve_test)
    report: dict[str, Any] = {
        "data": {
            "format": cfg.data.format,
            "path": cfg.data.path,
            "num_questions": len(qs),
            "num_selection": int(sel.size),
            "num_test": int(test.size),
            "pool_size": len(pool),
        },
        "model": m.name if m.type == "local" else f"{m.server.model} (served at {m.server.base_url})",
        "model_type": m.type,
        "confidence": rc.confidence,
        "probe_max_new_tokens": probe_tokens,
        "retriever": f"{cfg.retriever.type} top-{cfg.retriever.top_k}"
        + (f" ({cfg.retriever.encoder.name})" if cfg.retriever.type == "dense" else ""),
        "retrieval_recall_at_k": float(gold_hit.mean()),
        "missing_confidence": int(np.isnan(conf).sum()),
        "threshold": router.threshold_,
        "selection": {"f1": router.selection_f1_, "retrieval_rate": router.selection_retrieval_rate_},
        "auc_confidence_vs_closed_correct": _auc_or_nan(conf[test], o.f1_closed[test] > 0.5),
        "test": table,
        "comparisons": compare_policies(o.subset(test), retrieve_test, rc.num_bootstrap, rc.alpha, cfg.seed),
        "diagnostics": confidence_diagnostics(
            conf, o.f1_closed, o.f1_rag, rc.correct_min_f1, num_bootstrap=rc.num_bootstrap, seed=cfg.seed
        ),
        "account": account_figures(table),
        "selection_table": routing_table(o.subset(sel), router.predict(conf[sel])),
    }
    in_sel = set(sel.tolist())
    rows = [
        {
            "id": ex.id,
            "split": "selection" if i in in_sel else "test",
            "question": ex.question,
            "answers": ex.answers,
            "closed": closed[i],
            "confidence": conf[i],
            "rag": rag[i],
            "f1_closed": o.f1_closed[i],
            "f1_rag": o.f1_rag[i],
            "gold_passage_retrieved": bool(gold_hit[i]),
            "probe_raw": probe_gens[i].raw,
        }
        for i, ex in enumerate(examples)
    ]
    return report, rows


def _tokens(g: Any) -> float:
    """Prompt + generated tokens of one call; NaN where a server did not count them."""
    return float(g.prompt_tokens + g.new_tokens) if g.prompt_tokens >= 0 and g.new_tokens >= 0 else math.nan


#: the policies compared, and the baselines each is compared with (a policy is not compared with itself)
COMPARED = ("router", "oracle", "always")
BASELINES = ("never", "always", "random_matched")


def compare_policies(
    o: Any, retrieve: np.ndarray, num_bootstrap: int = 2000, alpha: float = 0.05, seed: int = 0
) -> dict[str, Any]:
    """The F1 of the router, the oracle and always-retrieve against never / always / random-matched on the
    same questions: the paired difference per question, its bootstrap 95% interval, minimum detectable
    difference and p-value (:func:`judgeloop.studies.stats.paired_bootstrap_test`), and Holm's adjustment
    across the whole family (:func:`judgeloop.studies.stats.holm`).

    ``random_matched`` is random routing at the compared policy's own retrieval rate ``p``: its per-question
    F1 is the exact expectation ``(1 - p) * f1_closed + p * f1_rag``, so the difference is paired too.
    The intervals are the unadjusted 95% ones; ``significant`` is the Holm-adjusted p at or below ``alpha``.
    """
    from judgeloop.studies.stats import holm, paired_bootstrap_test

    f1c, f1r = np.asarray(o.f1_closed, float), np.asarray(o.f1_rag, float)
    retrieves = {  # each policy's decision per question (the oracle retrieves where it strictly helps)
        "router": np.asarray(retrieve, bool),
        "oracle": f1r > f1c,
        "always": np.ones(f1c.size, bool),
        "never": np.zeros(f1c.size, bool),
    }
    names, tests = [], []
    for pol in COMPARED:
        mine = np.where(retrieves[pol], f1r, f1c)
        for base in BASELINES:
            if base == pol or (pol == "always" and base == "random_matched"):
                continue  # random at always' rate (1) is always itself
            if base == "random_matched":
                rate = float(retrieves[pol].mean())
                other = (1 - rate) * f1c + rate * f1r
            else:
                other = np.where(retrieves[base], f1r, f1c)
            delta, pval = paired_bootstrap_test(mine - other, num_bootstrap, seed)
            names.append(f"{pol} - {base}")
            tests.append((delta, pval))
    adjusted = holm([pv for _, pv in tests])
    out: dict[str, Any] = {
        "metric": "f1",
        "alpha": alpha,
        "family_size": sum(p is not None for _, p in tests),
    }
    rows = {}
    for name, (delta, pval), adj in zip(names, tests, adjusted):
        rows[name] = {
            **delta.as_dict(),
            "p": pval,
            "p_holm": adj,
            "significant": adj is not None and adj <= alpha,
        }
    out["rows"] = rows
    return out


#: the verbalized-confidence routing account's figures (BeyondUncertainty, Sah, Lian & Zhang 2026)
ACCOUNT = {
    "f1_routed": 0.483,
    "f1_never": 0.401,
    "f1_always": 0.467,
    "fewer_passages_vs_always": 0.204,
    "more_tokens_vs_always_probe_charged": 0.282,
}


def account_figures(table: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Our test-split figures in the account's terms beside its own: F1 routed / never / always, the share
    of passages the router saves against always-retrieve, and its extra tokens against always-retrieve with
    the probe charged (our ``router`` row always pays the probe)."""
    r, n, a = table["router"], table["never"], table["always"]
    fewer = 1 - r["passages_retrieved"] / a["passages_retrieved"] if a["passages_retrieved"] else math.nan
    more = r["total_tokens"] / a["total_tokens"] - 1 if a["total_tokens"] else math.nan
    return {
        "ours": {
            "f1_routed": r["f1"],
            "f1_never": n["f1"],
            "f1_always": a["f1"],
            "fewer_passages_vs_always": fewer,
            "more_tokens_vs_always_probe_charged": more,
        },
        "account": dict(ACCOUNT),
    }


def _auc_or_nan(conf: np.ndarray, correct: np.ndarray) -> float:
    from judgeloop.retrieval.gate import auc

    ok = np.isfinite(conf)
    return auc(conf[ok], correct[ok]) if ok.any() else math.nan


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    d = report["data"]
    lines = [
        "# Confidence routing report",
        "",
        f"- data: `{d['path']}` ({d['format']}): {d['num_questions']} questions, {d['num_selection']} to choose "
        f"the threshold, {d['num_test']} test; passage pool {d['pool_size']}",
        f"- model: `{report['model']}`; confidence: {report['confidence']}; retriever: {report['retriever']} "
        f"(gold passage in top-k for {report['retrieval_recall_at_k']:.1%})",
        f"- threshold (frozen on the selection split): {fmt_number(report['threshold'], 4)}; questions without a "
        f"confidence (routed to retrieval): {report['missing_confidence']}",
        f"- AUC of confidence for a correct closed-book answer (F1 > 0.5), test: "
        f"{fmt_number(report['auc_confidence_vs_closed_correct'])}",
        "",
        "## Test split",
        "",
        "| policy | EM | F1 | retrieval rate | passages | total tokens | tokens/q | latency s/q |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["test"].items():
        lines.append(
            f"| {name} | {fmt_number(r['exact_match'])} | {fmt_number(r['f1'])} | {fmt_number(r['retrieval_rate'])} | "
            f"{fmt_number(r['passages_retrieved'], 1)} | {fmt_number(r['total_tokens'], 0)} | {fmt_number(r['tokens_per_question'], 1)} | "
            f"{fmt_number(r['latency_s_per_question'])} |"
        )
    lines += [
        "",
        "Costs: closed-book answers cost the probe; retrieved answers cost the RAG call (+ the probe for the "
        "router and the oracle, which need it to decide). `random_matched` is the exact expectation of random "
        "routing with the router's retrieval count. Latency is batch wall time / batch size (CPU) in process, "
        "each call's own wall time when served.",
    ]
    c = report.get("comparisons")
    if c:
        lines += [
            "",
            f"## Paired F1 differences, test split (Holm across {c['family_size']} comparisons, "
            f"alpha {c['alpha']})",
            "",
            "| comparison | delta F1 | 95% CI | MDD | p | p (Holm) | significant |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in c["rows"].items():
            ci = r["ci95"]
            ci_text = "n/a" if ci[0] is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
            lines.append(
                f"| {name} | {_signed(r['delta'])} | {ci_text} | {fmt_number(r['mdd'])} | "
                f"{fmt_number(r['p'])} | {fmt_number(r['p_holm'])} | {'yes' if r['significant'] else 'no'} |"
            )
        lines += [
            "",
            "Paired bootstrap over test questions; `random_matched` is random routing at the compared "
            "policy's own retrieval rate. MDD: the smallest difference this run detects with 80% power.",
        ]
    dg = report.get("diagnostics")
    if dg:
        lines += [
            "",
            f"## Confidence diagnostics (all {dg['n'] + dg['missing']} questions; {dg['missing']} without a "
            "confidence left out)",
            "",
            "| diagnostic | value | 95% CI |",
            "|---|---|---|",
        ]
        for key, label in (
            ("ece", f"ECE vs closed-book correct (F1 > {dg['correct_min_f1']})"),
            ("spearman_rho", "Spearman rho, confidence vs closed-book F1"),
            ("auroc_uncertainty_retrieval_helps", "AUROC of 1 - confidence for retrieval helps"),
        ):
            e = dg[key]
            if e["value"] is None:
                lines.append(f"| {label} | n/a ({e['why_none']}) | |")
                continue
            ci = e["ci95"]
            ci_text = "n/a" if ci[0] is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
            lines.append(f"| {label} | {fmt_number(e['value'])} | {ci_text} |")
    acc = report.get("account")
    if acc:
        o, a = acc["ours"], acc["account"]
        lines += [
            "",
            "## Beside the account (BeyondUncertainty, Sah, Lian & Zhang 2026)",
            "",
            "| figure | ours | account |",
            "|---|---|---|",
            f"| F1 routed | {fmt_number(o['f1_routed'])} | {a['f1_routed']:.3f} |",
            f"| F1 never retrieve | {fmt_number(o['f1_never'])} | {a['f1_never']:.3f} |",
            f"| F1 always retrieve | {fmt_number(o['f1_always'])} | {a['f1_always']:.3f} |",
            f"| fewer passages than always | {_pct(o['fewer_passages_vs_always'], signed=False)} | "
            f"{_pct(a['fewer_passages_vs_always'], signed=False)} |",
            f"| more tokens than always, probe charged | {_pct(o['more_tokens_vs_always_probe_charged'])} | "
            f"{_pct(a['more_tokens_vs_always_probe_charged'])} |",
        ]
    return "\n".join(lines) + "\n"


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"
