"""Tiny models and a tokenizer built from config, for tests and benchmarks (no download, seconds on CPU).

Names: ``judgeloop-tiny/causal-lm`` (Llama architecture), ``judgeloop-tiny/causal-lm-h32`` (the same
with 2 attention heads of 32 instead of 4 of 16: vLLM's CPU attention takes head sizes from 32 up, so
the ``generation.backend: vllm`` tests run on it), ``judgeloop-tiny/encoder`` (BERT),
``judgeloop-tiny/reward-model`` (Llama with a scalar sequence-classification head),
``judgeloop-tiny/nli`` (BERT with a 3-class head: contradiction, neutral, entailment). The tokenizer
is a byte-level BPE that this project trains on its own embedded corpus, deterministically.
Weights are random but seeded, so every build of a tiny model is identical.
"""

from __future__ import annotations

import functools
from typing import Any

TINY_PREFIX = "judgeloop-tiny/"
TINY_KINDS = ("causal-lm", "causal-lm-h32", "encoder", "reward-model", "nli")

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|unk|>",
    "<|im_start|>",
    "<|im_end|>",
    "[CLS]",
    "[SEP]",
    "[MASK]",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def is_tiny(name: str) -> bool:
    """Whether ``name`` is one of the tiny test models built from config."""
    return name.startswith(TINY_PREFIX)


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from judgeloop.data.embedded import embedded_texts

    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(embedded_texts(), trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """The project's own byte-level BPE tokenizer (trained on the embedded corpus), as a HF fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(name: str, seed: int = 0) -> Any:
    """Build the tiny model called ``name`` with seeded random weights."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    kind = name[len(TINY_PREFIX) :]
    if kind not in TINY_KINDS:
        raise ValueError(
            f"unknown tiny model {name!r}; choose one of {[TINY_PREFIX + k for k in TINY_KINDS]}"
        )
    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # the shape every tiny model shares: 2 layers of width 64, 4 heads
        dims = dict(
            vocab_size=len(tok),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            pad_token_id=tok.pad_token_id,
        )
        if kind == "encoder":
            return BertModel(BertConfig(**dims, max_position_embeddings=512)).eval()
        if kind == "nli":
            labels = {0: "contradiction", 1: "neutral", 2: "entailment"}
            bert = BertConfig(**dims, max_position_embeddings=512, id2label=labels)
            return BertForSequenceClassification(bert).eval()
        heads = {"num_attention_heads": 2, "num_key_value_heads": 1} if kind == "causal-lm-h32" else {}
        llama = LlamaConfig(
            **{**dims, "num_key_value_heads": 2, **heads},
            max_position_embeddings=2048,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
        )
        if kind in ("causal-lm", "causal-lm-h32"):
            return LlamaForCausalLM(llama).eval()
        llama.num_labels = 1
        return LlamaForSequenceClassification(llama).eval()
