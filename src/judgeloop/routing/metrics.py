"""SQuAD answer scoring for routing; the implementation lives in :mod:`judgeloop.metrics.qa`."""

from judgeloop.metrics.qa import exact_match, normalize_answer, token_f1

__all__ = ["exact_match", "normalize_answer", "token_f1"]
