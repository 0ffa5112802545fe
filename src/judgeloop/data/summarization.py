"""Summarization examples and their loaders, selected by ``data.format`` + ``data.path`` / ``data.name``.

A :class:`SummExample` has an id, an article, references grouped by style (``neutral``: human
abstractive; ``extractive``: lead sentences or a ROUGE oracle extract, computed when absent) and,
where the data set has them, rated candidate summaries (SummEval's system outputs with expert
ratings; XSumFaith's summary with its faithfulness label).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.io import DataError, check_kind, check_row, first_of_each_id, read_jsonl
from judgeloop.logging import get_logger

logger = get_logger(__name__)


@dataclass
class Candidate:
    """A candidate summary with optional human ratings (e.g. ``{"relevance": 4.33}``)."""

    text: str
    system: str = ""
    ratings: dict[str, float] = field(default_factory=dict)


@dataclass
class SummExample:
    """One article with its references (``neutral``, ``extractive``) and any rated candidates."""

    id: str
    article: str
    references: dict[str, list[str]]
    candidates: list[Candidate] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def neutral(self) -> list[str]:
        return self.references.get("neutral", [])

    @property
    def extractive(self) -> list[str]:
        return self.references.get("extractive", [])


@dataclass
class SplitConfig:
    """Fractions of articles per split; the rest is ``train``. Assignment hashes the article id."""

    calibration: float = bounded(0.2, ge=0, lt=1, message="{key} must be in [0, 1), got {value}")
    test: float = bounded(0.2, ge=0, lt=1, message="{key} must be in [0, 1), got {value}")
    validation: float = bounded(0.0, ge=0, lt=1, message="{key} must be in [0, 1), got {value}")
    salt: str = "judgeloop"

    def __post_init__(self) -> None:
        check_fields("split", self)
        if self.calibration + self.test + self.validation > 1.0 + 1e-9:
            raise ValueError(
                f"split fractions calibration+test+validation = "
                f"{self.calibration + self.test + self.validation:.3f} exceed 1; make them sum to at most 1 (train gets the rest)"
            )


@dataclass
class DataConfig:
    """Where the articles come from.

    ``format``: ``embedded`` (ships with judgeloop, the default), ``jsonl`` (with ``fields`` mapping),
    ``summeval``, ``debian``, ``xsumfaith`` (files in the ../shared/data layouts) or ``hf`` (a hub
    data set by ``name``, e.g. ``cnn_dailymail`` with ``hf_config: 3.0.0``).
    """

    format: Literal["embedded", "jsonl", "summeval", "debian", "xsumfaith", "hf"] = "embedded"
    path: str | None = None
    name: str | None = None
    hf_config: str | None = None
    hf_split: str = "train"
    fields: dict[str, str] = field(default_factory=dict)
    embedded_size: int = bounded(600, ge=1, message="{key} must be positive, got {value}")
    max_articles: int | None = bounded(None, ge=1, message="{key} must be positive or null, got {value}")
    lead_sentences: int = bounded(2, ge=1, message="{key} must be >= 1, got {value}")
    extractive: Literal["lead", "oracle"] = "lead"
    split: SplitConfig = field(default_factory=SplitConfig)
    # an id that comes back with another article: keep the first and warn naming it, or stop
    duplicate_ids: Literal["first", "error"] = "first"

    def __post_init__(self) -> None:
        check_fields("data", self)
        if self.format in ("jsonl", "summeval", "debian", "xsumfaith") and not self.path:
            raise ValueError(f"data.format={self.format} needs data.path=PATH to the JSONL file")
        if self.format == "hf" and not self.name:
            raise ValueError(
                "data.format=hf needs data.name (e.g. data.name=cnn_dailymail data.hf_config=3.0.0)"
            )


_SENT_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(`])")


def split_sentences(text: str) -> list[str]:
    """A light sentence splitter (punctuation followed by space and a capital/digit/quote)."""
    text = " ".join(text.split())
    if not text:
        return []
    return [s.strip() for s in _SENT_RE.split(text) if s.strip()]


def lead(text: str, k: int) -> str:
    """The first ``n`` sentences of ``text`` (the extractive reference when none is given)."""
    return " ".join(split_sentences(text)[:k])


def oracle_extract(article: str, references: list[str], max_sentences: int = 3) -> str:
    """Greedy ROUGE-2+L oracle: add article sentences while they raise F1 against the references."""
    from judgeloop.metrics.text import rouge_scorer

    sents = split_sentences(article)
    scorer = rouge_scorer()
    chosen: list[int] = []
    best = 0.0
    for _ in range(max_sentences):
        gains = []
        for i in range(len(sents)):
            if i in chosen:
                continue
            cand = " ".join(sents[j] for j in sorted([*chosen, i]))
            score = max(
                (scorer.score(r, cand)["rouge2"].fmeasure + scorer.score(r, cand)["rougeL"].fmeasure)
                for r in references
            )
            gains.append((score, i))
        if not gains:
            break
        score, i = max(gains)
        if score <= best:
            break
        best = score
        chosen.append(i)
    return " ".join(sents[j] for j in sorted(chosen)) or lead(article, 1)


def _with_extractive(ex: SummExample, cfg: DataConfig) -> SummExample:
    if not ex.references.get("extractive"):
        if cfg.extractive == "oracle" and ex.neutral:
            ex.references["extractive"] = [oracle_extract(ex.article, ex.neutral)]
        else:
            ex.references["extractive"] = [lead(ex.article, cfg.lead_sentences)]
    return ex


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _load_embedded(cfg: DataConfig) -> list[SummExample]:
    from judgeloop.data.embedded import generate_articles

    return [
        SummExample(
            id=str(r["id"]),
            article=str(r["article"]),
            references={"neutral": [str(r["neutral"])], "extractive": [str(r["extractive"])]},
            meta={"domain": r["domain"]},
        )
        for r in generate_articles(cfg.embedded_size)
    ]


def _load_jsonl(cfg: DataConfig) -> list[SummExample]:
    f = {
        "id": "id",
        "article": "article",
        "references": "references",
        "summary": "summary",
        "extractive": "extractive",
        **cfg.fields,
    }
    unknown = set(cfg.fields) - {"id", "article", "references", "summary", "extractive"}
    if unknown:
        raise DataError(
            f"data.fields has unknown entries {sorted(unknown)}; valid: id, article, references, summary, extractive"
        )
    kinds = {f["id"]: "id", f["article"]: "text", f["references"]: "texts", f["summary"]: "text"}
    rows = read_jsonl(str(cfg.path), required=[f["article"]], kinds={**kinds, f["extractive"]: "texts"})
    out = []
    for i, row in enumerate(rows):
        if f["references"] in row:
            refs = _as_list(row[f["references"]])
        elif f["summary"] in row:
            refs = [row[f["summary"]]]
        else:
            raise DataError(
                f"{cfg.path} row {i + 1}: no reference field ('{f['references']}' or '{f['summary']}'); "
                "set data.fields.references=NAME or data.fields.summary=NAME"
            )
        references = {"neutral": refs}
        if f["extractive"] in row:
            references["extractive"] = _as_list(row[f["extractive"]])
        out.append(SummExample(id=str(row.get(f["id"], i)), article=row[f["article"]], references=references))
    return out


def _fixed_fields(
    kinds: dict[str, str],
    example: Callable[[dict[str, Any], str], SummExample],
    optional: tuple[str, ...] = (),
) -> Callable[[DataConfig], list[SummExample]]:
    """The loader of a JSONL format with fixed field names: every field of ``kinds`` (field -> kind, as
    :func:`read_jsonl` checks them) is required but the ``optional`` ones, and ``example(row, path)``
    makes each row's example."""

    def load(cfg: DataConfig) -> list[SummExample]:
        path = str(cfg.path)
        rows = read_jsonl(path, required=[k for k in kinds if k not in optional], kinds=kinds)
        return [example(row, path) for row in rows]

    return load


def _summeval_example(row: dict[str, Any], path: str) -> SummExample:
    """A SummEval article with its system summaries as candidates, rated by experts and turkers."""
    cands = []
    for j, s in enumerate(row["summaries"]):
        where = f"{path}: article {row['id']}, summaries[{j}]"
        check_kind(s, "mapping", where, "summaries[]")
        kinds = {"text": "text", "system": "text", "expert": "mapping", "turker": "mapping"}
        s = check_row(s, where, ["text"], kinds)
        ratings = {
            f"{who}_{k}": float(check_kind(v, "number", where, f"{who}.{k}"))
            for who in ("expert", "turker")
            for k, v in s.get(who, {}).items()
        }
        cands.append(Candidate(text=s["text"], system=s.get("system", ""), ratings=ratings))
    references = {"neutral": _as_list(row["references"])}
    return SummExample(id=str(row["id"]), article=row["article"], references=references, candidates=cands)


def _debian_example(row: dict[str, Any], path: str) -> SummExample:
    """A Debian package description with its synopsis as the reference."""
    return SummExample(
        id=str(row["id"]),
        article=row["article"],
        references={"neutral": [row["summary"]]},
        meta={"section": row.get("section", "")},
    )


def _xsumfaith_example(row: dict[str, Any], path: str) -> SummExample:
    """An XSumFaith article with its system summary as the one candidate, rated by its faithfulness label."""
    # XSumFaith has no reference summary: the faithful system summary is the best stand-in we have, and the
    # faithfulness label rides along as a rating of that candidate.
    cand = Candidate(text=row["summary"], system="xsum", ratings={"faithful": float(row["label"])})
    references = {"neutral": [row["summary"]] if row["label"] == 1 else []}  # 1 and 1.0 alike
    return SummExample(id=str(row["id"]), article=row["article"], references=references, candidates=[cand])


_HF_DEFAULT_FIELDS = {
    "cnn_dailymail": {"id": "id", "article": "article", "summary": "highlights"},
    "abisee/cnn_dailymail": {"id": "id", "article": "article", "summary": "highlights"},
    "xsum": {"id": "id", "article": "document", "summary": "summary"},
    "EdinburghNLP/xsum": {"id": "id", "article": "document", "summary": "summary"},
}


def _load_hf(cfg: DataConfig) -> list[SummExample]:
    import datasets

    ds = datasets.load_dataset(cfg.name, cfg.hf_config, split=cfg.hf_split)
    f = {
        **_HF_DEFAULT_FIELDS.get(str(cfg.name), {"id": "id", "article": "article", "summary": "summary"}),
        **cfg.fields,
    }
    for key in ("article", "summary"):
        if f[key] not in ds.column_names:
            raise DataError(
                f"hub data set {cfg.name} has no column '{f[key]}' (columns: {ds.column_names}); "
                f"set data.fields.{key}=COLUMN"
            )
    n = len(ds) if cfg.max_articles is None else min(len(ds), cfg.max_articles)
    out = []
    kinds = {f["id"]: "id", f["article"]: "text", f["summary"]: "text"}
    for i in range(n):
        row = check_row(ds[i], f"hub data set {cfg.name} row {i}", [f["article"], f["summary"]], kinds)
        out.append(
            SummExample(
                id=str(row.get(f["id"], i)),
                article=row[f["article"]],
                references={"neutral": [row[f["summary"]]]},
            )
        )
    return out


LOADERS: dict[str, Callable[[DataConfig], list[SummExample]]] = {
    "embedded": _load_embedded,
    "jsonl": _load_jsonl,
    "summeval": _fixed_fields(
        {"id": "id", "article": "text", "references": "texts", "summaries": "list"}, _summeval_example
    ),
    "debian": _fixed_fields(
        {"id": "id", "article": "text", "summary": "text", "section": "text"}, _debian_example, ("section",)
    ),
    "xsumfaith": _fixed_fields(
        {"id": "id", "article": "text", "summary": "text", "label": "number"}, _xsumfaith_example
    ),
    "hf": _load_hf,
}


def load_examples(cfg: DataConfig) -> list[SummExample]:
    """Load, validate and de-duplicate examples; compute extractive references when absent.

    Repeated ids keep their first occurrence (the count is logged); an id repeated with another article is
    named in a warning, or raises under ``data.duplicate_ids=error``; empty articles raise.
    """
    examples = LOADERS[cfg.format](cfg)
    where = cfg.path or cfg.name or cfg.format
    unique = first_of_each_id(
        examples, lambda ex: ex.id, lambda ex: ex.article, str(where), cfg.duplicate_ids
    )
    for ex in unique:
        if not ex.article.strip():
            raise DataError(
                f"article '{ex.id}' is empty; remove it from the data or fix the article field mapping"
            )
    if cfg.max_articles is not None:
        unique = unique[: cfg.max_articles]
    return [_with_extractive(ex, cfg) for ex in unique]
