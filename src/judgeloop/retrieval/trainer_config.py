"""The schema of ``judgeloop train-retriever`` (:class:`TrainRetrieverConfig`): data, model, loss, hard
negatives, schedule, evaluation; the trainer that runs it is :mod:`judgeloop.retrieval.trainer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.devices import Device
from judgeloop.io import DataError
from judgeloop.retrieval import beir
from judgeloop.retrieval.beir import BeirData
from judgeloop.retrieval.encoder import DEFAULT_RETRIEVER
from judgeloop.retrieval.metrics import DEFAULT_METRICS
from judgeloop.retrieval.mining import MiningConfig
from judgeloop.signals import DEFAULT_STOP_SIGNALS, check_signal_names
from judgeloop.tracking import TRACKERS


@dataclass
class RetrievalDataPaths:
    """One data set: BEIR files (``corpus_path`` + ``queries_path`` + ``qrels_path``) or a pair JSONL."""

    corpus_path: str = ""
    queries_path: str = ""
    qrels_path: str = ""
    pairs_path: str = ""
    query_field: str = "query"
    positive_field: str = "positive"

    def __post_init__(self) -> None:
        paths = [self.corpus_path, self.queries_path, self.qrels_path]
        if self.pairs_path and any(paths):
            raise ValueError("give either pairs_path or corpus_path/queries_path/qrels_path, not both")
        if not self.pairs_path and not all(paths) and any(paths):
            missing = [n for n, v in zip(("corpus_path", "queries_path", "qrels_path"), paths) if not v]
            raise ValueError(f"BEIR data needs corpus_path, queries_path and qrels_path; missing {missing}")

    @property
    def is_set(self) -> bool:
        return bool(self.pairs_path or self.corpus_path)

    def load(self) -> BeirData:
        if self.pairs_path:
            return beir.load_pairs(self.pairs_path, self.query_field, self.positive_field)
        if not self.is_set:
            raise DataError(
                "no data given; set data.train.corpus_path/queries_path/qrels_path or data.train.pairs_path"
            )
        return beir.load_beir(self.corpus_path, self.queries_path, self.qrels_path)


@dataclass
class RetrieverDataConfig:
    """Training and evaluation data of the retriever, with the query split and caps."""

    train: RetrievalDataPaths = field(default_factory=RetrievalDataPaths)
    eval: RetrievalDataPaths | None = None
    eval_fraction: float = bounded(0.2, gt=0.0, lt=1.0, hint="; e.g. 0.2", shape="section")
    split_salt: str = "judgeloop"
    max_train_queries: int | None = bounded(None, ge=0)
    max_eval_queries: int | None = bounded(None, ge=0)
    max_corpus_docs: int | None = bounded(None, ge=2, hint=" or null (full corpus)", shape="section")

    def __post_init__(self) -> None:
        check_fields("data", self)


@dataclass
class RetrieverModelConfig:
    """The bi-encoder to train: name, pooling, normalization, lengths."""

    name: str = DEFAULT_RETRIEVER
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    max_length: int = bounded(256, ge=0)
    query_max_length: int = bounded(64, ge=1, hint=" (tokens)")

    def __post_init__(self) -> None:
        check_fields("model", self)


@dataclass
class RetrieverLossConfig:
    """The InfoNCE loss: temperature and which negatives enter it."""

    tau: float = bounded(0.05, gt=0, hint=" (0.05 = sentence-transformers scale 20)", shape="section")
    symmetric: bool = False
    gather_across_processes: bool = True

    def __post_init__(self) -> None:
        check_fields("loss", self)


@dataclass
class NegativesConfig:
    """``hard=false`` trains with in-batch negatives only."""

    hard: bool = True
    remine_every_n_epochs: int = bounded(0, ge=0, hint=" (0 = off)")
    num_bm25: int = bounded(0, ge=0)
    path: str | None = None
    mining: MiningConfig = field(default_factory=MiningConfig)

    def __post_init__(self) -> None:
        check_fields("negatives", self)


@dataclass
class RetrieverTrainConfig:
    """The retriever's training schedule, precision, checkpoints and resume."""

    batch_size: int = bounded(32, ge=2, message="{key}={value}: in-batch negatives need at least 2")
    gradcache_chunk_size: int = bounded(0, ge=0, hint=" (0 = off)", shape="section")
    num_epochs: int = bounded(1, ge=1, shape="section")
    max_steps: int | None = bounded(None, ge=0)
    learning_rate: float = bounded(2e-5, gt=0, shape="section")
    weight_decay: float = bounded(0.01, ge=0)
    warmup_ratio: float = bounded(0.1, ge=0, le=1)
    max_grad_norm: float = bounded(1.0, ge=0)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    RENAMED: ClassVar[dict[str, str]] = {"checkpoint_every_n_steps": "save_every_n_steps"}
    save_every_n_steps: int = bounded(0, ge=0, hint=" (0 = off)")
    keep_checkpoints: int = bounded(1, ge=1, shape="section")
    resume: bool = True
    log_every_n_steps: int = bounded(10, ge=0, hint=" (0 = off)")
    # bf16 autocast for the training forward (weights, gradients and optimizer state stay float32);
    # faster on a CPU with AMX (docs/benchmarks.md "Figures behind config defaults"). auto: bf16 where it is
    # native (a GPU, or a CPU with avx512_bf16 / amx_bf16, detected at run time), float32 elsewhere
    mixed_precision: Literal["no", "bf16", "auto"] = "auto"

    def __post_init__(self) -> None:
        check_fields("train", self)


@dataclass
class RetrieverEvalConfig:
    """Retriever evaluation: metrics, depth, batch size, precision, embedding cache."""

    batch_size: int = bounded(64, ge=0)
    top_k: int = bounded(100, ge=1, hint=" (documents retrieved per query)")
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    embedding_cache_dir: str | None = None
    # bf16 weights (a copy) when encoding for evaluation and mining (faster on a CPU with AMX:
    # docs/benchmarks.md "Figures behind config defaults"); auto: bf16 where it is native (see
    # train.mixed_precision)
    precision: Literal["no", "bf16", "auto"] = "auto"

    def __post_init__(self) -> None:
        check_fields("eval", self)
        needed = {"ndcg@10", "recall@10", "mrr@10"}
        if not needed <= set(self.metrics):
            raise ValueError(
                f"eval.metrics={self.metrics} must include {sorted(needed)} (the report needs them)"
            )


@dataclass
class TrainRetrieverConfig:
    """Schema of ``judgeloop train-retriever``. ``device``: auto (a GPU when accelerate sees one), cpu or
    cuda (an error before any work where there is none). ``log_with``: trackers (``jsonl`` writes
    ``OUTPUT_DIR/metrics.jsonl``; any accelerate tracker, :mod:`judgeloop.tracking`), the run named
    ``run_name`` (default ``retriever``) in ``project_name``. ``stop_signals``: signals that stop the run
    like a scheduler's preemption (:mod:`judgeloop.signals`): the step finishes, a checkpoint is written,
    one line names it, the exit status is 128 + signum; the same command continues (``train.resume``)."""

    output_dir: str = "outputs/retriever"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    device: Device = "auto"
    model: RetrieverModelConfig = field(default_factory=RetrieverModelConfig)
    data: RetrieverDataConfig = field(default_factory=RetrieverDataConfig)
    loss: RetrieverLossConfig = field(default_factory=RetrieverLossConfig)
    negatives: NegativesConfig = field(default_factory=NegativesConfig)
    train: RetrieverTrainConfig = field(default_factory=RetrieverTrainConfig)
    eval: RetrieverEvalConfig = field(default_factory=RetrieverEvalConfig)
    log_with: list[str] = field(default_factory=lambda: ["jsonl"])
    project_name: str = "judgeloop"
    run_name: str | None = None
    stop_signals: list[str] = field(default_factory=lambda: list(DEFAULT_STOP_SIGNALS))
    # keys a resume may change (judgeloop.rundir): they cannot change what the run computes
    RUN_FREE_KEYS: ClassVar[tuple[str, ...]] = (
        "log_with",
        "project_name",
        "run_name",
        "stop_signals",
        "train.resume",
        "train.keep_checkpoints",
    )

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("output_dir is empty; set output_dir=outputs/retriever")
        check_signal_names(self.stop_signals)
        bad = [t for t in self.log_with if t != "jsonl" and t not in TRACKERS]
        if bad:
            raise ValueError(f"log_with has unknown tracker(s) {bad}; choose from {['jsonl', *TRACKERS]}")
