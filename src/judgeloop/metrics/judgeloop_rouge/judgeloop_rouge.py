"""judgeloop's ROUGE as a Hugging Face ``evaluate`` metric module, loaded offline from this path
(:func:`judgeloop.metrics.text.rouge_metric`): ROUGE-1/2/L F1 against the best-matching reference,
averaged over the predictions, the same numbers as :func:`judgeloop.metrics.text.rouge_max`."""

import datasets
import evaluate

from judgeloop.metrics.text import rouge_max


class JudgeloopRouge(evaluate.Metric):
    """ROUGE-1/2/L F1 (rouge-score, stemmed), max over references, mean over predictions."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="ROUGE-1/2/L F1 (rouge-score, Porter stemming) against the best-matching reference",
            citation="Lin, C.-Y. (2004). ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description="predictions: list of str; references: list of lists of str",
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, float]:
        scores = [rouge_max(p, refs) for p, refs in zip(predictions, references, strict=True)]
        n = max(len(scores), 1)
        return {k: sum(s[k] for s in scores) / n for k in ("rouge1", "rouge2", "rougeL")}
