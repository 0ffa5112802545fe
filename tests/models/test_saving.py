"""Model folders in transformers' layout: the tied embedding stored once under its source name, and a
peft policy's merged weights, read back with a plain safetensors reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

from judgeloop.models import load_causal_lm, load_tokenizer, resolve_model_path
from judgeloop.models.saving import merged_state_dict, save_model_folder, tied_state_dict

TINY = "judgeloop-tiny/causal-lm"


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as fh:
        return set(fh.keys())


def test_model_folder_names_tied_weights_as_save_pretrained(tmp_path):
    """The folder judgeloop writes holds the same tensor names as transformers' own save_pretrained (the
    tied head left out, the embedding kept), and a plain reader finds the embedding that is the head."""
    model, tok = load_causal_lm(TINY), load_tokenizer(TINY)
    assert model.config.tie_word_embeddings
    save_model_folder(tmp_path / "ours", model, tok)
    model.save_pretrained(tmp_path / "theirs")
    ours = _keys(tmp_path / "ours" / "model.safetensors")
    assert ours == _keys(tmp_path / "theirs" / "model.safetensors")
    assert "model.embed_tokens.weight" in ours and "lm_head.weight" not in ours
    state = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert torch.equal(state["model.embed_tokens.weight"], model.lm_head.weight)
    back = load_causal_lm(str(tmp_path / "ours"))
    ids = tok("The council voted.", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_safetensors_save_model_layout_is_the_one_fixed(tmp_path):
    """safetensors' save_model (how the SmolLM2 folder used to be written) keeps the head's name; the
    tied-state rule turns such a state into transformers' layout."""
    model = load_causal_lm(TINY)
    save_model(model, str(tmp_path / "old.safetensors"))
    old = load_file(str(tmp_path / "old.safetensors"))
    assert "lm_head.weight" in old and "model.embed_tokens.weight" not in old  # what misled vLLM
    fixed = tied_state_dict(model, old)
    assert "lm_head.weight" not in fixed
    assert torch.equal(fixed["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_repair_renames_a_head_only_file(tmp_path, monkeypatch):
    """A cached SmolLM2 folder written before the fix is repaired in place on the next resolve."""
    from judgeloop.models import loading

    model = load_causal_lm(TINY)
    weights = tmp_path / "model.safetensors"
    save_model(model, str(weights))
    loading._repair_tied_layout(weights)
    state = load_file(str(weights))
    assert "lm_head.weight" not in state
    assert torch.equal(state["model.embed_tokens.weight"], model.lm_head.weight)
    before = weights.stat().st_mtime_ns
    loading._repair_tied_layout(weights)  # already in the layout: left alone
    assert weights.stat().st_mtime_ns == before


def test_merged_lora_weights_compute_what_the_peft_model_does(tmp_path):
    """A peft policy's merged state has the base model's names only (no adapter, no base_layer) and a
    plain model loaded from it computes the adapted policy's logits."""
    from peft import LoraConfig, get_peft_model

    tok = load_tokenizer(TINY)
    torch.manual_seed(0)
    peft = get_peft_model(load_causal_lm(TINY), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    state = merged_state_dict(peft)
    plain = load_causal_lm(TINY)
    assert set(state) == set(tied_state_dict(plain))
    save_model_folder(tmp_path / "merged", peft, tok, state)
    merged = load_causal_lm(str(tmp_path / "merged"))
    ids = tok("The council voted to build a footbridge.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got, base = peft(ids).logits, merged(ids).logits, plain(ids).logits
    assert not torch.allclose(want, base, atol=1e-3)  # the adapters matter
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_smollm2_folder_stores_the_embedding_a_plain_reader_finds():
    """The dequantized SmolLM2 folder holds its tied embedding as model.embed_tokens.weight (vLLM and
    every reader following transformers load it), equal to the loaded model's head."""
    path = Path(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    keys = _keys(path / "model.safetensors")
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        embedding = fh.get_tensor("model.embed_tokens.weight")
    model = load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert torch.equal(embedding, model.lm_head.weight)
    assert torch.equal(embedding, model.model.embed_tokens.weight)
