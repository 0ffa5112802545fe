"""RAFT rows in TRL's SFTTrainer (messages and prompt/completion), the sft recipe, and eval-raft scoring."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_raft import TINY, _cfg, _synthetic  # noqa: I001  (tests/ is on sys.path under pytest)

from judgeloop.intervals import wilson_interval
from judgeloop.models import load_causal_lm, load_tokenizer
from judgeloop.raft.builder import build_raft, save_raft
from judgeloop.raft.evaluation import (
    EvalRaftConfig,
    _batched_last_logits,
    candidate_token_ids,
    exact_match,
    score_choices,
    setting_docs,
    token_f1,
)
from judgeloop.raft.sft import SftConfig, load_sft_dataset, to_prompt_completion


@pytest.fixture(scope="module")
def raft_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("raft_sft")
    path = _synthetic(tmp / "qa.jsonl", 40)
    cfg = _cfg(path, tmp, sources={"random": 1.0}, k=2)
    return save_raft(build_raft(cfg), tmp / "raft")


def _trl_args(tmp_path: Path, **kw):
    from trl import SFTConfig

    args = {
        "output_dir": str(tmp_path / "trainer"),
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "max_length": 256,
        "gradient_checkpointing": False,
        "bf16": False,
        "disable_tqdm": True,
    }
    return SFTConfig(**{**args, **kw})


def test_jsonl_messages_rows_train_in_sfttrainer(raft_dir, tmp_path):
    """The JSONL rows, as written, are a conversational language-modeling data set for SFTTrainer."""
    from datasets import load_dataset
    from trl import SFTTrainer

    ds = load_dataset("json", data_files=str(raft_dir / "train.jsonl"), split="train").select(range(4))
    model = load_causal_lm(TINY).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SFTTrainer(
        model=model, args=_trl_args(tmp_path), train_dataset=ds, processing_class=load_tokenizer(TINY)
    )
    out = trainer.train()
    assert math.isfinite(out.training_loss)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_prompt_completion_masks_the_prompt(raft_dir, tmp_path):
    """Converted rows train on the assistant turn only (labels -100 over system + user)."""
    from trl import SFTTrainer

    cfg = SftConfig(model=TINY, data_dir=str(raft_dir), max_train_examples=3)
    ds = load_sft_dataset(cfg)
    assert ds.column_names == ["prompt", "completion"]
    trainer = SFTTrainer(
        model=load_causal_lm(TINY),
        args=_trl_args(tmp_path, max_length=2048),
        train_dataset=ds,
        processing_class=load_tokenizer(TINY),
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    labels = batch["labels"][0]
    tok = load_tokenizer(TINY)
    kept = tok.decode([int(t) for t in labels if t != -100])
    assert "<ANSWER>:" in kept and "Question:" not in kept and "<DOCUMENT" not in kept


def test_to_prompt_completion_rejects_rows_without_assistant_turn():
    with pytest.raises(ValueError, match="must end with the assistant turn"):
        to_prompt_completion({"messages": [{"role": "user", "content": "hi"}]})


def test_sft_missing_dataset_error(tmp_path):
    with pytest.raises(ValueError, match="has no dataset/ folder; build it first"):
        load_sft_dataset(SftConfig(data_dir=str(tmp_path)))


@pytest.mark.slow
def test_sft_recipe_inline_saves_adapter_and_report(raft_dir, tmp_path):
    from judgeloop.commands.sft import run

    cfg = SftConfig(
        model=TINY,
        data_dir=str(raft_dir),
        output_dir=str(tmp_path / "sft"),
        max_train_examples=4,
        max_length=2048,
        launch="inline",
    )
    cfg.train.max_steps = 2
    cfg.train.batch_size = 2
    cfg.train.grad_accum_steps = 1
    report = run(cfg)
    assert report["num_steps"] == 2 and math.isfinite(report["train_loss"])
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "sft" / "train_report.json").read_text())["num_train_examples"] == 4


# ------------------------------------------------------------------------------------------------ eval


def test_left_padded_batch_matches_single_forward():
    model, tok = load_causal_lm(TINY), load_tokenizer(TINY)
    texts = ["a short prompt", "a much longer prompt with several more words in it <ANSWER>:"]
    batched = _batched_last_logits(model, tok, texts, batch_size=2)  # (2, V)
    for i, t in enumerate(texts):
        single = _batched_last_logits(model, tok, [t], batch_size=1)[0]
        assert torch.allclose(batched[i], single, atol=1e-4)


def test_score_choices_equals_full_sequence_log_probs():
    """Constrained scores = sum of log p(candidate tokens | prompt + <ANSWER>:), computed by hand."""
    model, tok = load_causal_lm(TINY), load_tokenizer(TINY)
    prompts = ["<|im_start|>user\nIs it so?<|im_end|>\n<|im_start|>assistant\n"]
    cands = ["yes", "no", "maybe"]
    got = score_choices(model, tok, prompts, cands, batch_size=2)  # (1, 3)
    for j, c in enumerate(cands):
        base = tok(prompts[0] + "<ANSWER>:", add_special_tokens=False)["input_ids"]
        full = tok(prompts[0] + "<ANSWER>: " + c, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0], dim=-1)
        want = sum(float(lp[k - 1, full[k]]) for k in range(len(base), len(full)))
        assert float(got[0, j]) == pytest.approx(want, abs=1e-4)


def test_candidate_tokens_error_names_the_answer():
    tok = load_tokenizer(TINY)
    with pytest.raises(ValueError, match="is not a single token"):
        candidate_token_ids(tok, "<ANSWER>:", ["supercalifragilistic"])


def test_squad_metrics_and_wilson_by_hand():
    assert exact_match("The  France!", "france") == 1.0
    assert token_f1("in northern France", "France") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("Paris", "France") == 0.0
    lo, hi = wilson_interval(8, 10)
    # Wilson 95%: centre (0.8 + z^2/20) / (1 + z^2/10), z = Phi^-1(0.975); half-width by the formula.
    z = 1.959963984540054
    centre = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (lo, hi) == pytest.approx((centre - half, centre + half))


def test_settings_show_the_right_documents():
    meta = {
        "question_id": "q",
        "oracle_chunk_id": "o#0",
        "oracle_text": "ORACLE",
        "distractor_ids": ["a#0", "b#1"],
        "distractor_texts": ["A", "B"],
    }
    assert setting_docs(meta, "oracle_only") == [("o#0", "ORACLE")]
    assert setting_docs(meta, "distractors_only") == [("a#0", "A"), ("b#1", "B")]
    both = setting_docs(meta, "oracle_distractors")
    assert sorted(both) == sorted([("o#0", "ORACLE"), ("a#0", "A"), ("b#1", "B")])
    assert both == setting_docs(meta, "oracle_distractors")  # seeded, stable


def test_eval_config_errors():
    with pytest.raises(ValueError, match=r"settings=\[.oracle_plus.\]: .oracle_plus. is not one of"):
        EvalRaftConfig(settings=["oracle_plus"])
    from judgeloop.raft.evaluation import load_tuned

    with pytest.raises(ValueError, match="adapter_dir=/nonexistent does not exist"):
        load_tuned(TINY, "/nonexistent")


@pytest.mark.slow
def test_eval_raft_end_to_end_tiny(raft_dir, tmp_path):
    from judgeloop.commands.eval_raft import run

    cfg = EvalRaftConfig(
        data_dir=str(raft_dir),
        base_model=TINY,
        adapter_dir=None,
        max_questions=3,
        settings=["oracle_distractors", "oracle_only"],
        num_generations=1,
        max_new_tokens=8,
        output_dir=str(tmp_path / "ev"),
    )
    report = run(cfg)
    s = report["models"]["base"]["settings"]
    assert set(s) == {"oracle_distractors", "oracle_only"} and 0.0 <= s["oracle_only"]["accuracy"] <= 1.0
    assert report["models"]["base"]["quotes"]["num_generations"] == 1
    assert "| base | oracle_only |" in (tmp_path / "ev" / "eval_report.md").read_text()
