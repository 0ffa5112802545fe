"""Model loading: hub ids, local paths, packaged offline sources, and tiny models built from config."""

from judgeloop.models.loading import (
    OFFLINE_SOURCES,
    cache_dir,
    check_model,
    load_causal_lm,
    load_encoder,
    load_sequence_classifier,
    load_tokenizer,
    resolve_model_path,
)
from judgeloop.models.tiny import TINY_PREFIX, build_tiny_tokenizer, is_tiny

__all__ = [
    "OFFLINE_SOURCES",
    "TINY_PREFIX",
    "build_tiny_tokenizer",
    "cache_dir",
    "check_model",
    "is_tiny",
    "load_causal_lm",
    "load_encoder",
    "load_sequence_classifier",
    "load_tokenizer",
    "resolve_model_path",
]
