"""Data: summarization examples and loaders, the PubMedQA reader, deterministic splits, the embedded corpus."""

from judgeloop.data.pubmedqa import PubMedQAItem, read_pubmedqa
from judgeloop.data.splits import LeakageError, assign_split, check_disjoint, hash_unit, split_examples
from judgeloop.data.summarization import (
    Candidate,
    DataConfig,
    SplitConfig,
    SummExample,
    lead,
    load_examples,
    split_sentences,
)

__all__ = [
    "Candidate",
    "DataConfig",
    "LeakageError",
    "PubMedQAItem",
    "SplitConfig",
    "SummExample",
    "assign_split",
    "check_disjoint",
    "hash_unit",
    "lead",
    "load_examples",
    "read_pubmedqa",
    "split_examples",
    "split_sentences",
]
