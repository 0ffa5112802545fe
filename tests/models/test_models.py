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


def test_grouped_attention_equals_sdpa_with_repeated_heads():
    """models.attention: on CPU, grouped key/value heads go to scaled_dot_product_attention as they are
    (enable_gqa) instead of repeated per query head; with left padding, logits and gradients are those of
    transformers' sdpa (to float rounding), in one pass and in a pass over a cache, and fewer bytes are
    saved for the backward pass."""
    import torch

    from judgeloop.models import load_causal_lm
    from judgeloop.models.lean import NAME, use_grouped_attention

    model = load_causal_lm("judgeloop-tiny/causal-lm").train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 900, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run():
        model.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            pre = model(
                input_ids=ids[:, :8], attention_mask=mask[:, :8], position_ids=pos[:, :8], use_cache=True
            )
            out = model(
                input_ids=ids[:, 8:],
                attention_mask=mask,
                position_ids=pos[:, 8:],
                past_key_values=pre.past_key_values,
            )
        logits = torch.cat([pre.logits, out.logits], dim=1)
        (logits.logsumexp(-1) * mask).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()], sum(saved)

    base = run()
    with torch.no_grad():  # the second pass really attends to the cache: one pass over all 12 positions
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(base[0][mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)
    assert use_grouped_attention(model) and model.config._attn_implementation == NAME
    grouped = run()
    real = mask.bool()
    torch.testing.assert_close(grouped[0][real], base[0][real], atol=1e-5, rtol=1e-5)
    for a, b in zip(grouped[1], base[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grouped[2] < base[2]  # the repeated keys and values are not saved
    assert not use_grouped_attention(
        load_causal_lm("judgeloop-tiny/encoder")
    )  # not a grouped-head sdpa model


def test_lean_swiglu_saves_less_and_computes_the_same():
    """models.lean: a SiLU-gated MLP keeps gate(x) and up(x) for backward, not silu(gate(x)) as well; the
    logits are bit-identical and the gradients agree to float rounding, with LoRA on the MLP too."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from judgeloop.models import load_causal_lm
    from judgeloop.models.lean import lean_cpu_forward, use_lean_swiglu

    base = load_causal_lm("judgeloop-tiny/causal-lm")
    lora = LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"], init_lora_weights=False)
    plain = get_peft_model(copy.deepcopy(base), lora).train()
    lean = copy.deepcopy(plain)
    assert use_lean_swiglu(lean)
    ids = torch.randint(10, 900, (2, 10), generator=torch.Generator().manual_seed(1))

    def run(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logits = model(input_ids=ids).logits
        logits.logsumexp(-1).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads, sum(saved)

    (l0, g0, s0), (l1, g1, s1) = run(plain), run(lean)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and any("gate_proj" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-5, msg=n)
    assert s1 < s0
    assert lean_cpu_forward(copy.deepcopy(base)) == ["grouped_attention", "lean_swiglu"]
    assert lean_cpu_forward(load_causal_lm("judgeloop-tiny/encoder")) == []
