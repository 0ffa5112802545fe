"""Dense retrieval: BEIR data, a bi-encoder, InfoNCE with mined hard negatives, GradCache, IR metrics."""

from judgeloop.retrieval.beir import (
    BeirData,
    check_query_split,
    doc_text,
    load_beir,
    load_pairs,
    split_queries,
)
from judgeloop.retrieval.encoder import DEFAULT_RETRIEVER, BiEncoder
from judgeloop.retrieval.losses import gather_with_grad, info_nce_loss
from judgeloop.retrieval.metrics import DEFAULT_METRICS, evaluate_run, retrieve
from judgeloop.retrieval.mining import (
    MiningConfig,
    exact_topk,
    load_negatives,
    mine_hard_negatives,
    save_negatives,
)

__all__ = [
    "DEFAULT_METRICS",
    "DEFAULT_RETRIEVER",
    "BeirData",
    "BiEncoder",
    "MiningConfig",
    "check_query_split",
    "doc_text",
    "evaluate_run",
    "exact_topk",
    "gather_with_grad",
    "info_nce_loss",
    "load_beir",
    "load_negatives",
    "load_pairs",
    "mine_hard_negatives",
    "retrieve",
    "save_negatives",
    "split_queries",
]
