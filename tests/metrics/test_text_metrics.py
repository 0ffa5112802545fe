"""The summary text metrics against hand-checked values, and the ``evaluate`` form of the ROUGE."""

from __future__ import annotations

import pytest

from judgeloop.metrics.text import copy_rate, novel_ngram_rate, rouge_max


def test_rouge_max_takes_the_best_reference_per_metric():
    got = rouge_max("the cat sat", ["the cat sat on the mat", "a dog"])
    # unigram F1 vs the first reference: P = 3/3, R = 3/6 -> 2/3
    assert got["rouge1"] == pytest.approx(2 / 3)
    assert rouge_max("a dog", ["the cat sat on the mat", "a dog"])["rougeL"] == 1.0
    with pytest.raises(ValueError, match="at least one reference"):
        rouge_max("x", [])


def test_copy_and_novel_rates_by_hand():
    article = "the council met on tuesday and voted to close the bridge"
    assert copy_rate("the council met on tuesday", article) == 1.0
    assert novel_ngram_rate("the council met on friday", article, n=2) == pytest.approx(1 / 4)


def test_the_evaluate_metric_loads_offline_and_equals_rouge_max(monkeypatch):
    from judgeloop.metrics.text import rouge_metric

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    preds = ["the cat sat", "a dog barked loudly", "nothing in common"]
    refs = [["the cat sat on the mat", "a dog"], ["the dog barked"], ["entirely different words"]]
    got = rouge_metric().compute(predictions=preds, references=refs)
    for k in ("rouge1", "rouge2", "rougeL"):
        assert got[k] == pytest.approx(sum(rouge_max(p, r)[k] for p, r in zip(preds, refs)) / len(preds))
