"""The schema of ``judgeloop train-retriever`` (:class:`TrainRetrieverConfig`): data, model, loss, hard
negatives, schedule, evaluation; the trainer that runs it is :mod:`judgeloop.retrieval.trainer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from judgeloop.config import Range, check_at_least, check_range
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
    eval_fraction: float = 0.2
    split_salt: str = "judgeloop"
    max_train_queries: int | None = None
    max_eval_queries: int | None = None
    max_corpus_docs: int | None = None

    def __post_init__(self) -> None:
        check_range("data", self, "eval_fraction", 0.0, 1.0, hint="; e.g. 0.2")
        check_at_least("data", self, "max_corpus_docs", 2, " or null (full corpus)", optional=True)


@dataclass
class RetrieverModelConfig:
    """The bi-encoder to train: name, pooling, normalization, lengths."""

    name: str = DEFAULT_RETRIEVER
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    max_length: int = 256
    query_max_length: int = 64


@dataclass
class RetrieverLossConfig:
    """The InfoNCE loss: temperature and which negatives enter it."""

    tau: float = 0.05
    symmetric: bool = False
    gather_across_processes: bool = True

    def __post_init__(self) -> None:
        check_at_least("loss", self, "tau", 0, " (0.05 = sentence-transformers scale 20)", strict=True)


@dataclass
class NegativesConfig:
    """``hard=false`` trains with in-batch negatives only."""

    hard: bool = True
    remine_every_n_epochs: int = 0
    num_bm25: int = 0
    path: str | None = None
    mining: MiningConfig = field(default_factory=MiningConfig)

    def __post_init__(self) -> None:
        if self.remine_every_n_epochs < 0 or self.num_bm25 < 0:
            raise ValueError(
                f"negatives.remine_every_n_epochs={self.remine_every_n_epochs}, num_bm25={self.num_bm25} must be >= 0"
            )


@dataclass
class RetrieverTrainConfig:
    """The retriever's training schedule, precision, checkpoints and resume."""

    batch_size: int = 32
    gradcache_chunk_size: int = 0
    num_epochs: int = 1
    max_steps: int | None = None
    learning_rate: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    RENAMED: ClassVar[dict[str, str]] = {"checkpoint_every_n_steps": "save_every_n_steps"}
    save_every_n_steps: int = 0
    keep_checkpoints: int = 1
    resume: bool = True
    log_every_n_steps: int = 10
    # bf16 autocast for the training forward (weights, gradients and optimizer state stay float32);
    # faster on a CPU with AMX (docs/benchmarks.md "Figures behind config defaults"). auto: bf16 where it is
    # native (a GPU, or a CPU with avx512_bf16 / amx_bf16, detected at run time), float32 elsewhere
    mixed_precision: Literal["no", "bf16", "auto"] = "auto"

    def __post_init__(self) -> None:
        if self.batch_size < 2:
            raise ValueError(f"train.batch_size={self.batch_size}: in-batch negatives need at least 2")
        check_at_least("train", self, "num_epochs", 1)
        check_at_least("train", self, "gradcache_chunk_size", 0, " (0 = off)")
        check_at_least("train", self, "keep_checkpoints", 1)
        check_at_least("train", self, "learning_rate", 0, strict=True)


@dataclass
class RetrieverEvalConfig:
    """Retriever evaluation: metrics, depth, batch size, precision, embedding cache."""

    batch_size: int = 64
    top_k: int = 100
    RANGES: ClassVar[dict[str, Range]] = {"top_k": (1, None, "[", " (documents retrieved per query)")}
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    embedding_cache_dir: str | None = None
    # bf16 weights (a copy) when encoding for evaluation and mining (faster on a CPU with AMX:
    # docs/benchmarks.md "Figures behind config defaults"); auto: bf16 where it is native (see
    # train.mixed_precision)
    precision: Literal["no", "bf16", "auto"] = "auto"

    def __post_init__(self) -> None:
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
