from __future__ import annotations

from pathlib import Path

import pytest
import torch

from judgeloop.models import (
    build_tiny_tokenizer,
    cache_dir,
    load_causal_lm,
    load_encoder,
    load_sequence_classifier,
    load_tokenizer,
    resolve_model_path,
)


def test_tiny_models_are_deterministic_and_usable():
    tok = build_tiny_tokenizer()
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    ids = tok("The council voted to build a footbridge.", return_tensors="pt")
    m1, m2 = load_causal_lm("judgeloop-tiny/causal-lm"), load_causal_lm("judgeloop-tiny/causal-lm")
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    logits = m1(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tok))
    enc = load_encoder("judgeloop-tiny/encoder")
    assert enc(**ids).last_hidden_state.shape[-1] == 64
    rm = load_sequence_classifier("judgeloop-tiny/reward-model")
    assert rm(**ids).logits.shape == (1, 1)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    # the tokenizer round-trips text
    assert tok.decode(ids["input_ids"][0]) == "The council voted to build a footbridge."


def test_unknown_tiny_and_empty_names():
    with pytest.raises(ValueError, match="unknown tiny model"):
        load_causal_lm("judgeloop-tiny/gpt9")
    with pytest.raises(ValueError, match="model name is empty"):
        resolve_model_path("")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("JUDGELOOP_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path


def test_local_dir_resolves_to_itself(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_minilm_resolves_offline():
    path = Path(resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"))
    assert (path / "model.safetensors").is_file()
    tok = load_tokenizer("sentence-transformers/all-MiniLM-L6-v2")
    enc = load_encoder("sentence-transformers/all-MiniLM-L6-v2")
    out = enc(**tok(["hello world"], return_tensors="pt")).last_hidden_state
    assert out.shape[-1] == 384


@pytest.mark.slow
def test_smollm2_resolves_offline_from_gguf():
    path = Path(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert not list(path.glob("*.bin"))  # safetensors only
    tok = load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    model = load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])
