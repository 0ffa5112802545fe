"""Bi-encoder: one HF encoder shared by queries and documents, pooled and (optionally) L2-normalized.

Saved in the sentence-transformers layout (``modules.json``, ``1_Pooling/``, ``2_Normalize/``), so
``SentenceTransformer(path)`` loads a trained retriever directly and gives the same embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from judgeloop.io import atomic_dir
from judgeloop.logging import get_logger

logger = get_logger(__name__)

Pooling = Literal["mean", "cls"]
DEFAULT_RETRIEVER = "sentence-transformers/all-MiniLM-L6-v2"
_EXTRA_CONFIG = "judgeloop_retriever.json"


def _read_st_layout(path: Path) -> dict[str, Any]:
    """Pooling / normalize / max length recorded in a sentence-transformers folder (empty if none)."""
    out: dict[str, Any] = {}
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return out
    modules = json.loads(modules_file.read_text())
    out["normalize"] = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            cfg_file = path / m["path"] / "config.json"
            if cfg_file.is_file():
                pcfg = json.loads(cfg_file.read_text())
                if pcfg.get("pooling_mode_cls_token"):
                    out["pooling"] = "cls"
                elif pcfg.get("pooling_mode_mean_tokens"):
                    out["pooling"] = "mean"
                else:
                    raise ValueError(
                        f"{cfg_file}: only mean or CLS pooling is supported, got {pcfg}; "
                        "re-save the model with pooling_mode_mean_tokens or pooling_mode_cls_token"
                    )
    sbert = path / "sentence_bert_config.json"
    if sbert.is_file():
        out["max_length"] = json.loads(sbert.read_text()).get("max_seq_length")
    extra = path / _EXTRA_CONFIG
    if extra.is_file():
        out.update({k: v for k, v in json.loads(extra.read_text()).items() if k == "query_max_length"})
    return out


class BiEncoder(nn.Module):
    """Shared-weight query/document encoder.

    Args:
        model: a HF ``AutoModel`` (BERT-like; returns ``last_hidden_state``).
        tokenizer: its tokenizer.
        pooling: ``"mean"`` over non-padding tokens (sentence-transformers default) or ``"cls"`` (first token).
        normalize: L2-normalize embeddings, so dot product = cosine similarity.
        max_length: truncation length for documents (and queries unless ``query_max_length`` is set).
        query_max_length: truncation length for queries (queries are short; a smaller value is faster).
        encode_precision: ``"bf16"`` runs :meth:`encode` (evaluation, mining) on a bfloat16 copy of the weights,
            faster on a CPU with AMX (docs/benchmarks.md); embeddings are returned in float32 either way.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        pooling: Pooling = "mean",
        normalize: bool = True,
        max_length: int = 256,
        query_max_length: int | None = None,
        encode_precision: Literal["no", "bf16"] = "no",
    ) -> None:
        super().__init__()
        if encode_precision not in ("no", "bf16"):
            raise ValueError(f"encode_precision={encode_precision!r}; use 'no' (float32) or 'bf16'")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling={pooling!r} is not supported; use 'mean' or 'cls'")
        if max_length < 1 or (query_max_length is not None and query_max_length < 1):
            raise ValueError(f"max_length={max_length}, query_max_length={query_max_length} must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.max_length = max_length
        self.query_max_length = query_max_length
        self.encode_precision = encode_precision
        pooler = getattr(model, "pooler", None)
        if isinstance(pooler, nn.Module):
            # the embedding pools the last hidden states; BERT's pooler head never reaches the loss, and a
            # trainable parameter without a gradient stops DDP at its second step ("did not receive grad")
            pooler.requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        pooling: Pooling | None = None,
        normalize: bool | None = None,
        max_length: int | None = None,
        query_max_length: int | None = None,
        dtype: str | None = "float32",
    ) -> BiEncoder:
        """Load a HF encoder (hub id, local dir, a sentence-transformers folder, or ``judgeloop-tiny/encoder``).

        Unset ``pooling`` / ``normalize`` / ``max_length`` come from the folder's sentence-transformers
        files when present, else mean pooling, normalized, 256 tokens.
        """
        from judgeloop.models import load_encoder, load_tokenizer, resolve_model_path
        from judgeloop.models.tiny import is_tiny

        saved: dict[str, Any] = {}
        if not is_tiny(name_or_path):
            path = Path(resolve_model_path(name_or_path))
            if path.is_dir():
                saved = _read_st_layout(path)
        model = load_encoder(name_or_path, dtype=dtype)
        tokenizer = load_tokenizer(name_or_path)
        return cls(
            model,
            tokenizer,
            pooling=pooling or saved.get("pooling") or "mean",
            normalize=saved.get("normalize", True) if normalize is None else normalize,
            max_length=max_length or saved.get("max_length") or 256,
            query_max_length=query_max_length or saved.get("query_max_length"),
        )

    @property
    def dim(self) -> int:
        config: Any = self.model.config
        return int(config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, texts: Sequence[str], is_query: bool = False) -> dict[str, torch.Tensor]:
        """Pad/truncate ``texts`` to a batch (queries use ``query_max_length`` when set)."""
        max_len = (self.query_max_length or self.max_length) if is_query else self.max_length
        enc = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
        )
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embed a tokenized batch: (B, T) ids and mask -> (B, D) embeddings (with gradients)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        if self.pooling == "cls":
            emb = hidden[:, 0]
        else:
            hidden = hidden.float()  # pool in float32 (bf16 under autocast)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            emb = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        emb = emb.float()
        return F.normalize(emb, p=2, dim=-1) if self.normalize else emb

    def embed(self, texts: Sequence[str], is_query: bool = False) -> torch.Tensor:
        """Tokenize and embed one batch with gradients (training path)."""
        feats = self.tokenize(texts, is_query=is_query)
        return self(**{k: v.to(self.device) for k, v in feats.items()})

    @torch.inference_mode()
    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 64,
        show_progress: bool = False,
        is_query: bool = False,
        desc: str | None = None,
    ) -> torch.Tensor:
        """Embed ``texts`` without gradients, in batches sorted by length (less padding).

        Returns:
            (N, D) float32 CPU tensor in the order of ``texts``.
        """
        from tqdm.auto import tqdm

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        was_training = self.training
        self.eval()
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        runner = self
        if self.encode_precision == "bf16" and self.model.dtype == torch.float32:
            # A bf16 copy of the weights for this call (half the fp32 size): cheaper than autocast, which
            # re-casts every weight at every batch. The training weights stay untouched in fp32.
            import copy

            with torch.inference_mode(False), torch.no_grad():
                half = copy.deepcopy(getattr(self.model, "module", self.model)).to(torch.bfloat16).eval()
            runner = BiEncoder(
                half, self.tokenizer, self.pooling, self.normalize, self.max_length, self.query_max_length
            )
        try:
            bar = tqdm(
                range(0, len(texts), batch_size),
                disable=not show_progress,
                desc=desc or ("encode queries" if is_query else "encode docs"),
                unit="batch",
            )
            for start in bar:
                idx = order[start : start + batch_size]
                emb = runner.embed([texts[i] for i in idx], is_query=is_query)
                out[idx] = emb.float().cpu()
        finally:
            self.train(was_training)
        return out

    def save(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write weights, tokenizer and sentence-transformers module files to ``path`` (atomically).
        ``state_dict``: the full weights when the model is sharded (gathered on every process first,
        :func:`judgeloop.distributed.full_state_dict`)."""
        path = Path(path)
        with atomic_dir(path) as tmp:
            model: Any = getattr(self.model, "module", self.model)
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            modules = [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
            if self.normalize:
                modules.append(
                    {
                        "idx": 2,
                        "name": "2",
                        "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize",
                    }
                )
                (tmp / "2_Normalize").mkdir()
            (tmp / "modules.json").write_text(json.dumps(modules, indent=2))
            (tmp / "sentence_bert_config.json").write_text(
                json.dumps({"max_seq_length": self.max_length, "do_lower_case": False}, indent=2)
            )
            (tmp / "1_Pooling").mkdir()
            (tmp / "1_Pooling" / "config.json").write_text(
                json.dumps(
                    {
                        "word_embedding_dimension": self.dim,
                        "pooling_mode_cls_token": self.pooling == "cls",
                        "pooling_mode_mean_tokens": self.pooling == "mean",
                        "pooling_mode_max_tokens": False,
                        "pooling_mode_mean_sqrt_len_tokens": False,
                    },
                    indent=2,
                )
            )
            (tmp / "config_sentence_transformers.json").write_text(
                json.dumps(
                    {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2
                )
            )
            (tmp / _EXTRA_CONFIG).write_text(
                json.dumps({"query_max_length": self.query_max_length, "pooling": self.pooling}, indent=2)
            )
        logger.info("saved retriever to %s (loads with sentence_transformers.SentenceTransformer)", path)
        return path
