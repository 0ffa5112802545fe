"""Confidence routing for QA: answer closed-book, and retrieve only when the model's confidence is low.

``readers`` loads QA sets (SQuAD 2.0 sample, PubMedQA) with their passage pools; ``metrics`` scores
answers (SQuAD exact match and token F1); ``llm`` runs the probe (provisional answer + confidence) and the
retrieval-augmented answer; ``router`` picks the threshold on a held-out split and compares it with
never / always / random-matched / oracle routing.
"""

from judgeloop.routing.metrics import exact_match, normalize_answer, token_f1
from judgeloop.routing.readers import QAExample, passage_pool, read_pubmedqa, read_squad2
from judgeloop.routing.router import ConfidenceRouter, RoutingOutcomes, routing_table

__all__ = [
    "ConfidenceRouter",
    "QAExample",
    "RoutingOutcomes",
    "exact_match",
    "normalize_answer",
    "passage_pool",
    "read_pubmedqa",
    "read_squad2",
    "routing_table",
    "token_f1",
]
