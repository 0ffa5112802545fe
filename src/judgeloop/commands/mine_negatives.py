"""``judgeloop mine-negatives``: encode a corpus and queries with a bi-encoder and write hard negatives
(``{"query_id", "negatives": [{"doc_id", "score"}]}`` JSONL) for training or RAFT data building."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from judgeloop.config import bounded, check_fields
from judgeloop.io import atomic_write_json
from judgeloop.logging import get_logger
from judgeloop.retrieval.encoder import BiEncoder
from judgeloop.retrieval.mining import MiningConfig, save_negatives
from judgeloop.retrieval.trainer import mine_negatives
from judgeloop.retrieval.trainer_config import NegativesConfig as _Negatives
from judgeloop.retrieval.trainer_config import RetrievalDataPaths, RetrieverModelConfig
from judgeloop.rundir import output_file

logger = get_logger(__name__)


@dataclass
class MineNegativesConfig:
    """Schema of ``judgeloop mine-negatives``: data, encoder, mining settings, output file."""

    output_path: str = "outputs/negatives.jsonl"
    model: RetrieverModelConfig = field(default_factory=RetrieverModelConfig)
    data: RetrievalDataPaths = field(default_factory=RetrievalDataPaths)
    mining: MiningConfig = field(default_factory=MiningConfig)
    num_bm25: int = bounded(0, ge=0)
    batch_size: int = bounded(64, ge=1, message="{key}={value} must be >= 1")
    embedding_cache_dir: str | None = None
    precision: Literal["no", "bf16"] = (
        "no"  # "bf16": encode on a bfloat16 copy of the weights (faster with AMX: docs/benchmarks.md)
    )

    def __post_init__(self) -> None:
        check_fields("", self)
        if self.precision not in ("no", "bf16"):
            raise ValueError(f"precision={self.precision!r}; use 'no' (float32) or 'bf16'")
        if not self.output_path:
            raise ValueError("output_path is empty; set output_path=outputs/negatives.jsonl")


def run(cfg: MineNegativesConfig) -> dict[str, Any]:
    """Mine and save negatives; returns (and writes next to the output) a small summary, which names the
    command and config digest of the run that wrote them. The output is locked while the run writes it."""
    with output_file(cfg.output_path, "mine-negatives", cfg) as run_id:
        return _mine(cfg, run_id)


def _mine(cfg: MineNegativesConfig, run_id: dict[str, str]) -> dict[str, Any]:
    data = cfg.data.load()
    encoder = BiEncoder.from_pretrained(
        cfg.model.name,
        cfg.model.pooling,
        cfg.model.normalize,
        cfg.model.max_length,
        cfg.model.query_max_length,
    )
    encoder.encode_precision = cfg.precision
    negatives = mine_negatives(
        encoder,
        data,
        _Negatives(num_bm25=cfg.num_bm25, mining=cfg.mining),
        cfg.batch_size,
        cache_dir=cfg.embedding_cache_dir,
    )
    save_negatives(cfg.output_path, negatives)
    counts = [len(v) for v in negatives.values()]
    summary = {
        **run_id,
        "output_path": cfg.output_path,
        "num_queries": len(negatives),
        "mean_negatives": sum(counts) / len(counts) if counts else 0.0,
        "queries_short": sum(c < cfg.mining.num_negatives for c in counts),
    }
    atomic_write_json(Path(cfg.output_path).with_suffix(".summary.json"), summary)
    logger.info("wrote negatives for %d queries to %s", len(negatives), cfg.output_path)
    return summary
