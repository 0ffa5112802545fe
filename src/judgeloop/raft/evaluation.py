"""RAFT evaluation (behind ``judgeloop eval-raft``): answer accuracy of a base and a RAFT-tuned model in
three document settings.

For each held-out question of a RAFT set (the builder's ``eval`` split) the prompt is re-rendered with

* ``oracle_distractors``: the oracle chunk and the example's distractors (shuffled, seeded per question);
* ``distractors_only``: the distractors alone;
* ``oracle_only``: the oracle chunk alone.

Yes/no/maybe questions (PubMedQA) are scored by constrained decoding: the assistant turn is forced to
start with ``<ANSWER>:`` and the candidate with the highest log-probability wins (fast, and immune to
format failures; note it skips the reasoning the tuned model was trained to write first). Span / title /
free answers are generated greedily after ``<ANSWER>:`` and scored by SQuAD exact match and token F1.
Quote validity is measured on a few free generations (oracle + distractors): the share whose quotes
are all verbatim substrings of the oracle. With ``marks.compare`` every model is evaluated twice, without
and with evidence marks in the prompts (:mod:`judgeloop.raft.marks`), and the report gains the paired
deltas per question. :func:`evaluate_raft` returns the report.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from judgeloop.config import ConfigError, bounded, check_choices, check_fields
from judgeloop.intervals import wilson_interval
from judgeloop.io import read_jsonl
from judgeloop.logging import get_logger
from judgeloop.metrics.qa import exact_match, token_f1
from judgeloop.models.scoring import next_token_logprobs
from judgeloop.raft.marks import EvalMarksConfig, doc_marks, load_eval_marks, paired_marks
from judgeloop.raft.targets import (
    ANSWER_MARKER,
    extract_quotes,
    parse_answer,
    quotes_are_verbatim,
    render_messages,
)

logger = get_logger(__name__)

SETTINGS: tuple[str, ...] = ("oracle_distractors", "distractors_only", "oracle_only")
YNM = ("yes", "no", "maybe")


@dataclass
class EvalRaftConfig:
    """Evaluate ``base_model`` and (when ``adapter_dir`` is set) ``base_model`` + that LoRA adapter.

    ``data_dir``: a ``build-raft`` output; ``split``: which JSONL to read (``eval``); ``max_questions``:
    the first N rows; ``num_generations``: free generations per model for the quote-validity rate.
    """

    data_dir: str = "runs/raft/pubmedqa"
    split: str = "eval"
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    adapter_dir: str | None = "runs/sft/pubmedqa/adapter"
    max_questions: int | None = bounded(60, ge=1, hint=" or null", shape="section")
    settings: list[str] = field(default_factory=lambda: list(SETTINGS))
    batch_size: int = bounded(4, ge=1, shape="section")
    num_generations: int = bounded(8, ge=0)
    max_new_tokens: int = bounded(160, ge=1, shape="section")
    max_answer_tokens: int = bounded(24, ge=0)
    marks: EvalMarksConfig = field(default_factory=EvalMarksConfig)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    output_dir: str = "runs/eval_raft/pubmedqa"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)

    def __post_init__(self) -> None:
        check_fields("", self)
        check_choices("settings", self.settings, SETTINGS)


# ------------------------------------------------------------------------------------------ settings


def setting_docs(meta: Mapping[str, Any], setting: str, seed: int = 0) -> list[tuple[str, str]]:
    """The (id, text) documents shown for ``setting``; order is seeded per question and shared by settings."""
    distractors = list(zip(meta["distractor_ids"], meta["distractor_texts"]))
    oracle = (meta["oracle_chunk_id"], meta["oracle_text"])
    if setting == "oracle_only":
        return [oracle]
    if setting == "distractors_only":
        return distractors
    docs = [oracle, *distractors]
    random.Random(f"{seed}\x00eval\x00{meta['question_id']}").shuffle(docs)
    return docs


def eval_prompt(
    tokenizer: Any,
    row: Mapping[str, Any],
    setting: str,
    seed: int = 0,
    marks: Mapping[str, str] | None = None,
) -> str:
    """Chat-formatted prompt (system + user, generation prompt added) for one row in one setting, its
    documents marked when ``marks`` (doc id -> mark text) is given."""
    meta = row["meta"]
    system = row["messages"][0]["content"]
    docs = setting_docs(meta, setting, seed)
    msgs = render_messages(system, meta["question"], meta["kind"], docs, marks=marks)
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------- scoring


def candidate_token_ids(tokenizer: Any, prefix: str, candidates: Sequence[str]) -> list[int]:
    """The single token that continues ``prefix`` with each ``" " + candidate``.

    Raises:
        ValueError: a candidate is not one token after the prefix for this tokenizer.
    """
    base = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    out = []
    for cand in candidates:
        full = tokenizer(prefix + " " + cand, add_special_tokens=False)["input_ids"]
        if full[: len(base)] != base or len(full) != len(base) + 1:
            raise ValueError(
                f"answer {cand!r} is not a single token after {prefix[-20:]!r} for this tokenizer; "
                "constrained yes/no/maybe scoring needs single-token answers"
            )
        out.append(full[-1])
    return out


def score_choices(
    model: Any, tokenizer: Any, prompts: Sequence[str], candidates: Sequence[str], batch_size: int
) -> Any:
    """Log-probabilities (N, C) of each candidate answer right after ``<ANSWER>:`` for each prompt.

    Single-token answers (yes/no/maybe for SmolLM2) need one forward pass per prompt; otherwise each
    candidate continuation is scored in full.
    """
    import torch

    texts = [p + ANSWER_MARKER for p in prompts]
    try:
        ids = candidate_token_ids(tokenizer, texts[0], candidates)
        logp = next_token_logprobs(model, tokenizer, texts, batch_size)  # (N, V)
        return logp[:, ids]  # (N, C)
    except ValueError:
        pass
    out = torch.zeros(len(texts), len(candidates))
    for j, cand in enumerate(candidates):
        for i, t in enumerate(texts):
            base = tokenizer(t, add_special_tokens=False)["input_ids"]
            full = tokenizer(t + " " + cand, add_special_tokens=False)["input_ids"]
            ids_t = torch.tensor([full])
            with torch.inference_mode():
                lp = torch.log_softmax(model(input_ids=ids_t).logits[0].float(), dim=-1)  # (T, V)
            # token full[k] is predicted at position k - 1
            out[i, j] = sum(float(lp[k - 1, full[k]]) for k in range(len(base), len(full)))
    return out


def _generate(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int
) -> list[str]:
    import torch

    tokenizer.padding_side = "left"
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(
            list(prompts[start : start + batch_size]),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.inference_mode():
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def evaluate_model(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    cfg: EvalRaftConfig,
    marks: Sequence[Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """Accuracy per setting and the quote-validity rate for one model; ``marks``: per row, the evidence
    marks of its documents (None: unmarked prompts). Per-question outcomes are kept (``correct``, and
    ``valid`` / ``has_answer`` per generation) for paired comparisons."""
    model.eval()
    result: dict[str, Any] = {"settings": {}}

    def mark(i: int) -> Mapping[str, str] | None:
        return None if marks is None else marks[i]

    for setting in cfg.settings:
        prompts = [eval_prompt(tokenizer, r, setting, cfg.seed, mark(i)) for i, r in enumerate(rows)]
        ynm = [i for i, r in enumerate(rows) if r["meta"]["kind"] == "yes_no_maybe"]
        other = [i for i, r in enumerate(rows) if r["meta"]["kind"] != "yes_no_maybe"]
        entry: dict[str, Any] = {"n": len(rows)}
        if ynm:
            logp = score_choices(model, tokenizer, [prompts[i] for i in ynm], YNM, cfg.batch_size)  # (N, 3)
            pred = [YNM[int(j)] for j in logp.argmax(dim=1)]
            gold = [rows[i]["meta"]["answer"] for i in ynm]
            correct = sum(p == g for p, g in zip(pred, gold))
            lo, hi = wilson_interval(correct, len(ynm))
            mass = logp.exp().sum(dim=1)  # probability left on yes/no/maybe (the rest: other tokens)
            entry.update(
                {
                    "accuracy": correct / len(ynm),
                    "accuracy_ci95": [lo, hi],
                    "num_scored": len(ynm),
                    "predicted": dict(Counter(pred)),
                    "confusion": {
                        g: dict(Counter(p for p, gg in zip(pred, gold) if gg == g)) for g in sorted(set(gold))
                    },
                    "mean_answer_mass": float(mass.mean()),
                    "correct": [int(p == g) for p, g in zip(pred, gold)],
                }
            )
        if other:
            texts = _generate(
                model,
                tokenizer,
                [prompts[i] + ANSWER_MARKER for i in other],
                cfg.max_answer_tokens,
                cfg.batch_size,
            )
            preds = [t.strip().split("\n")[0].strip() for t in texts]
            gold = [rows[i]["meta"]["answer"] for i in other]
            entry.update(
                {
                    "exact_match": sum(exact_match(p, g) for p, g in zip(preds, gold)) / len(other),
                    "f1": sum(token_f1(p, g) for p, g in zip(preds, gold)) / len(other),
                    "num_generated": len(other),
                }
            )
        result["settings"][setting] = entry
        logger.info(
            "%s: %s", setting, {k: v for k, v in entry.items() if k in ("accuracy", "exact_match", "f1")}
        )
    if cfg.num_generations > 0:
        gen_rows = list(rows[: cfg.num_generations])
        prompts = [
            eval_prompt(tokenizer, r, "oracle_distractors", cfg.seed, mark(i)) for i, r in enumerate(gen_rows)
        ]
        texts = _generate(model, tokenizer, prompts, cfg.max_new_tokens, cfg.batch_size)
        valid = [quotes_are_verbatim(t, r["meta"]["oracle_text"]) for t, r in zip(texts, gen_rows)]
        any_doc = [
            quotes_are_verbatim(t, [d for _, d in setting_docs(r["meta"], "oracle_distractors")])
            for t, r in zip(texts, gen_rows)
        ]
        answers = [parse_answer(t) for t in texts]
        result["quotes"] = {
            "num_generations": len(texts),
            "has_quote_rate": sum(bool(extract_quotes(t)) for t in texts) / len(texts),
            "quote_validity_rate": sum(valid) / len(texts),
            "quote_verbatim_any_doc_rate": sum(any_doc) / len(texts),
            "has_answer_marker_rate": sum(a is not None for a in answers) / len(texts),
            "valid": [int(v) for v in valid],
            "has_answer": [int(a is not None) for a in answers],
            "samples": [
                {"question_id": r["meta"]["question_id"], "generation": t, "quotes_valid": v}
                for r, t, v in zip(gen_rows[:3], texts[:3], valid[:3])
            ],
        }
        logger.info(
            "quote validity %.2f (has quote %.2f) over %d generations",
            result["quotes"]["quote_validity_rate"],
            result["quotes"]["has_quote_rate"],
            len(texts),
        )
    return result


def load_tuned(base_model: str, adapter_dir: str) -> Any:
    """``base_model`` with the LoRA adapter merged in."""
    from peft import PeftModel

    from judgeloop.models import load_causal_lm

    if not Path(adapter_dir).is_dir():
        raise ValueError(
            f"adapter_dir={adapter_dir} does not exist; train one with `judgeloop sft` or set it to null"
        )
    return PeftModel.from_pretrained(load_causal_lm(base_model), adapter_dir).merge_and_unload()


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown (what the command writes to ``report.md``)."""
    lines = [f"# RAFT evaluation ({report['num_questions']} questions from {report['data_dir']})", ""]
    lines.append(f"Majority-class accuracy: {report['majority_accuracy']:.3f} ({report['majority_label']})")
    lines.append("")
    lines.append("| model | setting | accuracy | 95% CI | EM | F1 |")
    lines.append("|---|---|---|---|---|---|")
    for name, res in report["models"].items():
        for setting, e in res["settings"].items():
            acc = f"{e['accuracy']:.3f}" if "accuracy" in e else "-"
            ci = (
                f"[{e['accuracy_ci95'][0]:.2f}, {e['accuracy_ci95'][1]:.2f}]" if "accuracy_ci95" in e else "-"
            )
            em = f"{e['exact_match']:.3f}" if "exact_match" in e else "-"
            f1 = f"{e['f1']:.3f}" if "f1" in e else "-"
            lines.append(f"| {name} | {setting} | {acc} | {ci} | {em} | {f1} |")
    lines.append("")
    lines.append(
        "| model | generations | has quote | quotes verbatim in oracle | verbatim in any doc | has <ANSWER> |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, res in report["models"].items():
        q = res.get("quotes")
        if q:
            lines.append(
                f"| {name} | {q['num_generations']} | {q['has_quote_rate']:.2f} | {q['quote_validity_rate']:.2f} "
                f"| {q['quote_verbatim_any_doc_rate']:.2f} | {q['has_answer_marker_rate']:.2f} |"
            )
    if report.get("marks"):
        lines += _render_marks(report["marks"])
    return "\n".join(lines) + "\n"


def _render_marks(marks: Mapping[str, Any]) -> list[str]:
    """The evidence-mark comparison: per model and setting, accuracy without / with marks, paired delta."""

    def cell(d: Mapping[str, Any]) -> str:
        lo, hi = d["ci95"]
        return f"{d['without']:.3f} | {d['with']:.3f} | {d['delta']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {d['changed']} of {d['n']}"

    lines = [
        "",
        f"## Evidence marks (levels {marks['levels']}): without vs with, paired per question",
        "",
        "| model | measure | without | with | delta [95% bootstrap CI] | questions that changed |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in marks.items():
        if name in ("levels", "example"):
            continue
        for setting, d in m["accuracy"].items():
            lines.append(f"| {name} | accuracy, {setting} | {cell(d)} |")
        if "quote_validity" in m:
            lines.append(f"| {name} | quote validity (free generations) | {cell(m['quote_validity'])} |")
            lines.append(f"| {name} | has <ANSWER> (free generations) | {cell(m['has_answer_marker'])} |")
    return lines


def evaluate_raft(cfg: EvalRaftConfig) -> dict[str, Any]:
    """Evaluate the base (and tuned) model in every setting; returns the report."""
    from judgeloop.models import load_causal_lm, load_tokenizer

    rows = read_jsonl(
        Path(cfg.data_dir) / f"{cfg.split}.jsonl",
        required=["messages", "meta"],
        kinds={"messages": "list", "meta": "mapping"},
    )
    if cfg.max_questions is not None:
        rows = rows[: cfg.max_questions]
    marks = None
    if cfg.adapter_dir and not Path(cfg.adapter_dir).is_dir():  # before any model loads
        raise ConfigError(
            f"adapter_dir={cfg.adapter_dir} does not exist; train one with `judgeloop sft` or set it to null"
        )
    if cfg.marks.compare:
        try:  # checked against the build's corpus before any model loads
            conformal, scorer = load_eval_marks(cfg.marks, cfg.data_dir)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        marks = [
            {d: m["text"] for d, m in x.items()} for x in doc_marks(scorer, conformal, rows, cfg.marks.levels)
        ]
    tokenizer = load_tokenizer(cfg.base_model)
    models: dict[str, Any] = {"base": lambda: load_causal_lm(cfg.base_model)}
    if cfg.adapter_dir:
        models["tuned"] = lambda: load_tuned(cfg.base_model, cfg.adapter_dir)  # type: ignore[arg-type]
    gold = [r["meta"]["answer"] for r in rows]
    label, count = Counter(gold).most_common(1)[0]
    report: dict[str, Any] = {
        "data_dir": cfg.data_dir,
        "split": cfg.split,
        "num_questions": len(rows),
        "base_model": cfg.base_model,
        "adapter_dir": cfg.adapter_dir,
        "scoring": "constrained log-prob of yes/no/maybe after a forced '<ANSWER>:' (no reasoning)",
        "majority_label": label,
        "majority_accuracy": count / len(rows),
        "models": {},
    }
    for name, make in models.items():
        logger.info("evaluating %s", name)
        model = make()
        report["models"][name] = evaluate_model(model, tokenizer, rows, cfg)
        if marks is not None:
            logger.info("evaluating %s with evidence marks", name)
            report.setdefault("models_marked", {})[name] = evaluate_model(model, tokenizer, rows, cfg, marks)
            report.setdefault("marks", {"levels": cfg.marks.levels, "example": marks[0]})[name] = (
                paired_marks(
                    report["models"][name], report["models_marked"][name], cfg.marks.num_bootstrap, cfg.seed
                )
            )
    if "tuned" in report["models"]:
        report["delta_accuracy_tuned_minus_base"] = {
            s: report["models"]["tuned"]["settings"][s].get("accuracy", float("nan"))
            - report["models"]["base"]["settings"][s].get("accuracy", float("nan"))
            for s in cfg.settings
        }
    return report
