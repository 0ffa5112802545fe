"""judgeloop's calibrated judge in TRL: JudgeReward in GRPOTrainer (the recipe) and online DPO, the
soft-target DPOTrainer, and ``judgeloop label-pairs`` whose output they train on. Real TRL trainers on
the tiny policy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from judgeloop.cli import main as cli
from judgeloop.config import load_config
from judgeloop.data import load_examples
from judgeloop.integrations.trl import JudgeReward
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.rewards import Group, RewardConfig, group_rewards, score_groups
from judgeloop.studies.calibration_lab import CalibrateConfig

ROOT = Path(__file__).resolve().parents[2]


def _length_judge() -> CalibratedJudge:
    from judgeloop.calibration import IdentityCalibrator

    return CalibratedJudge(JudgeConfig(type="objective", signal="length", scale=0.5), IdentityCalibrator())


def test_judge_reward_reads_trl_groups_and_judges_a_batch_in_one_call():
    judge = _length_judge()
    reward = JudgeReward(judge, num_generations=3, source_column="article")
    prompts = [[{"role": "user", "content": "p1"}]] * 3 + [[{"role": "user", "content": "p2"}]] * 3
    completions = [
        [{"role": "assistant", "content": t}] for t in ["a b", "a b c", "a", "x y z w", "x", "x y"]
    ]
    logged: dict[str, float] = {}
    out = reward(
        prompts=prompts,
        completions=completions,
        article=["art1"] * 3 + ["art2"] * 3,
        log_metric=lambda k, v: logged.__setitem__(k, v),
    )
    assert judge.calls == 1 and reward.judge_calls == 1
    assert out[:3] == group_rewards(judge, "art1", ["a b", "a b c", "a"])
    assert out[3:] == group_rewards(judge, "art2", ["x y z w", "x", "x y"])
    assert logged["judge/comparisons_per_group"] == 3 and logged["judge/failed"] == 0
    # groups inferred from runs of one prompt when num_generations is not given
    assert (
        JudgeReward(judge)(prompts=prompts, completions=completions, article=["art1"] * 3 + ["art2"] * 3)
        == out
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 4}, "6 completions do not split into groups of num_generations=4"),
        ({"num_generations": 2}, "completions 2-3 do not share one prompt"),
        ({"num_generations": 3, "source_column": "text"}, "the batch has no column 'text'"),
    ],
)
def test_a_batch_whose_groups_do_not_line_up_is_an_error(kwargs, message):
    reward = JudgeReward(_length_judge(), **kwargs)
    with pytest.raises(ValueError, match=message):
        reward(prompts=["p1"] * 3 + ["p2"] * 3, completions=["a"] * 6, article=["x"] * 6)


def _recipe():
    spec = importlib.util.spec_from_file_location("grpo_trl", ROOT / "recipes" / "grpo_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_grpo_recipe_trains_and_trl_logs_judgeloops_rewards(tiny_calibration, tmp_path):
    """Two GRPOTrainer steps on the tiny policy: the rewards TRL logged are judgeloop.rewards' on the
    same completions, recomputed with a freshly loaded judge."""
    judge_dir = tiny_calibration / "calibrated_judge" / "platt"
    out = _recipe().main(
        [
            "--config",
            str(ROOT / "configs/grpo_trl/tiny.yaml"),
            f"judge_path={judge_dir}",
            f"output_dir={tmp_path / 'grpo'}",
        ]
    )
    report, reward = out["report"], out["reward"]
    assert report["steps"] == 2 and reward.calls == reward.judge_calls == 2
    assert json.loads((tmp_path / "grpo" / "grpo_report.json").read_text())["steps"] == 2
    fresh = CalibratedJudge.from_pretrained(judge_dir)
    assert len(report["logged"]) == len(reward.history) == 2
    for row, call in zip(report["logged"], reward.history):
        groups = [Group(call["sources"][s], call["completions"][s:e]) for s, e in call["spans"]]
        again = [r for group in score_groups(fresh, groups, reward.rewards).rewards for r in group]
        assert again == call["rewards"]  # the same batch: bit for bit
        # one group at a time the judge embeds other batches: equal up to float rounding
        alone = [r for g in groups for r in group_rewards(fresh, g.source, g.completions, reward.rewards)]
        np.testing.assert_allclose(alone, again, rtol=1e-5)
        assert row["rewards/judgeloop/mean"] == pytest.approx(np.mean(again), abs=1e-6)
        assert row["rewards/judgeloop/std"] == pytest.approx(np.std(again, ddof=1), rel=1e-5)
        assert row["judge/comparisons_per_group"] == 6  # 4 completions, all pairs
    # the folder holds this run now: a run with other settings into it is refused before any model loads
    assert json.loads((tmp_path / "grpo" / "run.json").read_text())["state"] == "finished"
    with pytest.raises(Exception, match=r"holds another grpo-trl run"):
        _recipe().main(
            [
                "--config",
                str(ROOT / "configs/grpo_trl/tiny.yaml"),
                f"judge_path={judge_dir}",
                f"output_dir={tmp_path / 'grpo'}",
                "grpo.learning_rate=1e-4",
            ]
        )


def _preference_file(tiny_calibration: Path, path: Path, n: int = 24) -> Path:
    """Preference pairs from the tiny calibration's test rows (the ROUGE label as the dataset's order)."""
    cfg = load_config(CalibrateConfig, tiny_calibration / "config.yaml")
    articles = {e.id: e.article for e in load_examples(cfg.data)}
    rows = [json.loads(line) for line in (tiny_calibration / "predictions.jsonl").read_text().splitlines()]
    out = []
    for r in [r for r in rows if r["orientation"] == "ab"][:n]:
        chosen, rejected = (r["a"], r["b"]) if r["label"] == 1 else (r["b"], r["a"])
        out.append(
            {
                "prompt": articles[r["article_id"]][:200],
                "article": articles[r["article_id"]],
                "chosen": chosen,
                "rejected": rejected,
            }
        )
    path.write_text("".join(json.dumps(o) + "\n" for o in out))
    return path


@pytest.fixture(scope="module")
def labeled(tiny_calibration, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("label")
    data = _preference_file(tiny_calibration, tmp / "pairs.jsonl")
    out = tmp / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.references=null",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    return out


def test_label_pairs_writes_a_trl_ready_dataset_and_its_report(labeled):
    from datasets import load_from_disk

    report = json.loads((labeled / "report.json").read_text())
    rows = [json.loads(line) for line in (labeled / "labeled.jsonl").read_text().splitlines()]
    ds = load_from_disk(str(labeled / "dataset"))
    assert len(ds) == len(rows) == report["labeled"] == report["pairs"] == 24
    assert {
        "prompt",
        "chosen",
        "rejected",
        "p_chosen",
        "logit",
        "orders_agree",
        "status",
        "judge_agrees",
    } <= set(ds.column_names)
    assert all(r["p_chosen"] >= 0.5 for r in rows)  # ordered by the judge
    a = report["agreement_with_dataset"]
    assert a["n"] == 24 and a["k"] == sum(r["judge_agrees"] for r in rows)
    assert a["wilson95"][0] <= a["rate"] <= a["wilson95"][1]
    assert sum(report["confidence_histogram"]["counts"]) == 24 and report["pairs_per_s"] > 0
    assert (
        (labeled / "report.md")
        .read_text()
        .splitlines()[2]
        .startswith("The judge (calibration `platt`) agrees")
    )


@pytest.mark.parametrize(
    "row, override, message",
    [
        ({"prompt": "p", "chosen": "c"}, None, "missing field(s) ['rejected']"),
        ({"prompt": "p", "chosen": "c", "rejected": " "}, None, "field 'rejected' is empty"),
        ({"prompt": "p", "chosen": "c", "rejected": "r"}, "judge_path={tmp}", "is not a calibrated judge"),
    ],
)
def test_label_pairs_bad_input_is_one_line_before_any_output(
    tiny_calibration, tmp_path, capsys, row, override, message
):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    judge = f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}"
    args = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        override.format(tmp=tmp_path) if override else judge,
        f"data.path={data}",
        "data.fields.source=null",
        "data.fields.references=null",
        f"output_dir={tmp_path / 'out'}",
    ]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def _tiny_policy():
    from judgeloop.models import load_causal_lm, load_tokenizer

    return load_causal_lm("judgeloop-tiny/causal-lm"), load_tokenizer("judgeloop-tiny/causal-lm")


def _dpo_args(out: Path, **kw):
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        max_length=96,
        seed=0,
        **kw,
    )


@pytest.mark.slow
def test_soft_dpo_trainer_equals_judgeloops_loss_and_trl_at_hard_targets(labeled, tmp_path):
    """On the labeled output: the soft-target trainer's loss is soft_dpo_loss on the batch's log-probs;
    with every target 1 it equals TRL's own sigmoid loss; one training step runs."""
    import copy

    import torch
    from datasets import load_from_disk
    from trl import DPOTrainer

    from judgeloop.integrations.trl import sequence_logps, soft_dpo_trainer
    from judgeloop.loop.losses import soft_dpo_loss

    ds = load_from_disk(str(labeled / "dataset")).select(range(8))
    model, tok = _tiny_policy()
    ref = copy.deepcopy(model).eval()
    soft = soft_dpo_trainer(
        model=model, ref_model=ref, args=_dpo_args(tmp_path / "soft"), train_dataset=ds, processing_class=tok
    )
    batch = next(iter(soft.get_train_dataloader()))
    p = batch["p_chosen"].clone()
    assert torch.all((p >= 0.5) & (p <= 1))
    model.eval()
    with torch.no_grad():
        loss = soft.compute_loss(model, dict(batch))
        lp, lr = sequence_logps(model, batch, fused=True), sequence_logps(ref, batch, fused=True)
        # the fused log-probs are the plain forward's of an untouched copy of the weights
        plain = sequence_logps(_tiny_policy()[0].eval(), batch)
        torch.testing.assert_close(lp, plain, rtol=1e-5, atol=1e-4)
        (pc, pr), (rc, rr) = lp.chunk(2), lr.chunk(2)
        expected = soft_dpo_loss((pc - rc) - (pr - rr), p, soft.beta).mean()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        hard = dict(batch)
        hard["p_chosen"] = torch.ones_like(p)
        stock = DPOTrainer(
            model=model,
            ref_model=ref,
            args=_dpo_args(tmp_path / "stock"),
            train_dataset=ds,
            processing_class=tok,
        )
        trl_loss = stock.compute_loss(model, {k: v for k, v in batch.items() if k != "p_chosen"})
        assert soft.compute_loss(model, hard).item() == pytest.approx(trl_loss.item(), rel=1e-5)
    model.train()
    before = {n: t.detach().clone() for n, t in model.named_parameters()}
    soft.train()
    assert soft.state.global_step == 1
    assert any(not torch.equal(before[n], t) for n, t in model.named_parameters())


@pytest.mark.slow
def test_sharpened_and_confidence_weighted_targets_from_label_pairs_train_as_the_loop_weighs_them(
    tiny_calibration, tmp_path
):
    """label-pairs' target_temperature / pair_weighting write ``target`` = sigmoid(logit(p) / T) and
    ``weight`` = |2p - 1| beside the calibrated ``p_chosen``; the soft-target trainer reading both
    columns has the loss mean(w * soft_dpo_loss(h, target)), a hand computation on the batch."""
    import copy

    import torch
    from datasets import load_from_disk

    from judgeloop.integrations.trl import sequence_logps, soft_dpo_trainer

    data = _preference_file(tiny_calibration, tmp_path / "pairs.jsonl", n=8)
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.references=null",
            "target_temperature=0.5",
            "pair_weighting=confidence",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (out / "labeled.jsonl").read_text().splitlines()]
    for r in rows:
        p = r["p_chosen"]
        assert r["target"] == pytest.approx(1 / (1 + ((1 - p) / p) ** 2), rel=1e-9)  # T = 0.5
        assert r["weight"] == pytest.approx(2 * p - 1, abs=1e-12)
    report = json.loads((out / "report.json").read_text())
    assert report["targets"]["mean_signal"] == pytest.approx(np.mean([r["target"] - 0.5 for r in rows]))
    assert 'weight_column="weight"' in (out / "report.md").read_text()

    ds = load_from_disk(str(out / "dataset"))
    model, tok = _tiny_policy()
    ref = copy.deepcopy(model).eval()
    trainer = soft_dpo_trainer(
        model=model,
        ref_model=ref,
        args=_dpo_args(tmp_path / "w"),
        train_dataset=ds,
        processing_class=tok,
        target_column="target",
        weight_column="weight",
    )
    batch = next(iter(trainer.get_train_dataloader()))
    t, w = batch["target"].clone(), batch["weight"].clone()
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        lp, lr = sequence_logps(model, batch, fused=True), sequence_logps(ref, batch, fused=True)
        (pc, pr), (rc_, rr) = lp.chunk(2), lr.chunk(2)
        z = trainer.beta * ((pc - rc_) - (pr - rr))
        by_hand = -(t * torch.log(torch.sigmoid(z)) + (1 - t) * torch.log(torch.sigmoid(-z)))
        assert loss.item() == pytest.approx((w * by_hand).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="weight_column='target' is the target column"):
        soft_dpo_trainer(
            model=model,
            ref_model=ref,
            args=_dpo_args(tmp_path / "bad"),
            train_dataset=ds,
            processing_class=tok,
            target_column="target",
            weight_column="target",
        )


def _as_chat(row: dict, completions: bool = True) -> dict:
    """A standard preference row in TRL's conversational format (the prompt a user turn, each completion
    an assistant turn); ``completions=False`` leaves the completions as strings."""
    out = dict(row, prompt=[{"role": "user", "content": row["prompt"]}])
    if completions:
        for k in ("chosen", "rejected"):
            out[k] = [{"role": "assistant", "content": row[k]}]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["standard", "conversational", "chat_prompt_text_completions"])
def test_label_pairs_keeps_trls_format_and_its_output_trains_dpo(tiny_calibration, tmp_path, layout):
    """Standard in, standard out; conversational in, conversational out (a chat prompt with string
    completions comes out conversational too): the labeled dataset trains one step of TRL's own
    DPOTrainer, which refuses a chat prompt with string completions."""
    import copy

    import torch
    from datasets import load_from_disk
    from trl import DPOTrainer

    std = [
        json.loads(x)
        for x in _preference_file(tiny_calibration, tmp_path / "std.jsonl", n=8).read_text().splitlines()
    ]
    rows = std if layout == "standard" else [_as_chat(r, completions=layout == "conversational") for r in std]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.references=null",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    ds = load_from_disk(str(out / "dataset"))
    assert len(ds) == 8
    chat = layout != "standard"
    for r in ds:
        for k in ("prompt", "chosen", "rejected"):
            assert isinstance(r[k], list if chat else str), (k, r[k])
        if chat:
            assert [m["role"] for m in r["chosen"]] == [m["role"] for m in r["rejected"]] == ["assistant"]
            assert r["prompt"][0]["role"] == "user"
    given = {json.dumps(_as_chat(r)[k] if chat else r[k]) for r in std for k in ("chosen", "rejected")}
    assert all(json.dumps(r["chosen"]) in given and json.dumps(r["rejected"]) in given for r in ds)
    assert json.loads((out / "report.json").read_text())["format"] == (
        "conversational" if chat else "standard"
    )
    model, tok = _tiny_policy()
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model).eval(),
        args=_dpo_args(tmp_path / "dpo"),
        train_dataset=ds,
        processing_class=tok,
    )
    before = {n: t.detach().clone() for n, t in model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1
    assert any(not torch.equal(before[n], t) for n, t in model.named_parameters())


@pytest.mark.slow
def test_trl_online_dpo_accepts_the_anchor_mode_reward(tmp_path, tiny_calibration):
    import copy

    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    judge = CalibratedJudge.from_pretrained(tiny_calibration / "calibrated_judge" / "platt")
    reward = JudgeReward(judge, RewardConfig(scheme="anchor"), anchor_column="reference", keep_history=2)
    model, tok = _tiny_policy()
    ds = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"summarize: the cat sat on mat {i}"}],
                "article": f"the cat sat on mat {i}",
                "reference": "a cat sat",
            }
            for i in range(8)
        ]
    )
    args = OnlineDPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_new_tokens=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    trainer = OnlineDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
    )
    trainer.train()
    assert trainer.state.global_step == 1 and reward.calls == 1
    call = reward.history[0]
    assert len(call["completions"]) == 8 and all(e - s == 1 for s, e in call["spans"])  # each row on its own
    assert all(r is None or 0 <= r <= 1 for r in call["rewards"])


@pytest.mark.slow
def test_trl_rloo_trainer_takes_the_reward_with_its_groups(tmp_path, tiny_calibration):
    """RLOOTrainer lays out its groups as GRPOTrainer does: JudgeReward reads them, checks them against
    the prompts and judges the batch in one call."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import RLOOConfig, RLOOTrainer

    judge = CalibratedJudge.from_pretrained(tiny_calibration / "calibrated_judge" / "platt")
    settings = RewardConfig(scheme="round_robin", m=1, aggregate="bradley_terry")
    reward = JudgeReward(judge, settings, num_generations=4, keep_history=1)
    model, tok = _tiny_policy()
    ds = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"summarize: the dog ran {i} miles"}],
                "article": f"the dog ran {i} miles",
            }
            for i in range(8)
        ]
    )
    args = RLOOConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=1,
        max_completion_length=6,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        logging_steps=1,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    assert trainer.state.global_step == 1 and reward.calls == reward.judge_calls == 1
    call = reward.history[0]
    assert [e - s for s, e in call["spans"]] == [4, 4]
    for s, e in call["spans"]:  # Bradley-Terry strengths of a group's distinct completions sum to 0
        distinct = dict(zip(call["completions"][s:e], call["rewards"][s:e]))
        assert abs(sum(r for r in distinct.values() if r is not None)) < 1e-9


class _CountingJudge:
    """The length judge, recording every text it is asked about."""

    def __init__(self):
        self.inner, self.seen = _length_judge(), []
        self.pairwise, self.debiases = self.inner.pairwise, self.inner.debiases

    def compare(self, prompts, a, b, references=None):
        self.seen += list(a) + list(b)
        return self.inner.compare(prompts, a, b, references)


@pytest.mark.parametrize("aggregate", ["win_rate", "bradley_terry"])
@pytest.mark.parametrize("k", [2, 4])
def test_an_empty_completion_gets_its_groups_lowest_reward_unjudged(aggregate, k):
    judge = _CountingJudge()
    reward = JudgeReward(judge, RewardConfig(aggregate=aggregate), num_generations=k)
    texts = ["", "a b c", "a", "a b"][:k]
    logged: dict[str, float] = {}
    out = reward(
        prompts=["p"] * k,
        completions=texts,
        article=["art"] * k,
        log_metric=lambda key, v: logged.__setitem__(key, v),
    )
    assert "" not in judge.seen and all(r is not None for r in out)
    assert out[0] < min(out[1:])
    assert logged["judge/empty"] == 1 and logged["judge/reward_std"] > 0
    if k > 2:
        assert 0 < logged["judge/mean_margin"] <= 0.5
    else:  # the one comparison was the empty completion's, unjudged: nothing to average, so not logged
        assert "judge/mean_margin" not in logged
    assert all(np.isfinite(v) for v in logged.values())
    # empty="judge" keeps the old behaviour: the judge reads the empty text
    JudgeReward(judge, RewardConfig(aggregate=aggregate), num_generations=k, empty="judge")(
        prompts=["p"] * k, completions=texts, article=["art"] * k
    )
    assert "" in judge.seen


def test_judge_reward_logs_the_judges_signal_and_no_nan_position_bias():
    logged: dict[str, float] = {}
    JudgeReward(_length_judge(), num_generations=3)(
        prompts=["p"] * 3,
        completions=["a", "a b", "a b c"],
        article=["art"] * 3,
        log_metric=lambda key, v: logged.__setitem__(key, v),
    )
    assert {"judge/reward_std", "judge/mean_margin", "judge/empty"} <= set(logged)
    assert all(np.isfinite(v) for v in logged.values())  # no NaN position bias / order agreement
    with pytest.raises(ValueError, match="empty='drop'; use lose"):
        JudgeReward(_length_judge(), empty="drop")


# --- a judge that reads references (issue 39: a judge states what it reads) ----------------------------
def _rouge_judge() -> CalibratedJudge:
    """ROUGE-L against the references as the judge: it reads references (``judge.signal=rouge``)."""
    from judgeloop.calibration import IdentityCalibrator

    return CalibratedJudge(JudgeConfig(type="objective", signal="rouge", scale=5.0), IdentityCalibrator())


def test_judge_reward_for_a_judge_that_reads_references_needs_reference_column():
    judge = _rouge_judge()
    assert judge.reads_references and not _length_judge().reads_references
    with pytest.raises(
        ValueError, match=r"reads references \(judge.signal=rouge\).*pass reference_column=COLUMN"
    ):
        JudgeReward(judge, num_generations=2)
    JudgeReward(judge, num_generations=2, reference_column="references")  # what the message asks for


def _grpo(tmp_path: Path, reward: JudgeReward, rows: list[dict]):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    model, tok = _tiny_policy()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=1,
        max_completion_length=6,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )


def test_trl_prints_nothing_for_an_empty_completion(tmp_path, capfd, caplog):
    """TRL's own reward step (``GRPOTrainer._calculate_rewards``) on a group with an empty completion: a
    finite reward, the group's lowest, and nothing printed or logged (a ``None`` reward made TRL log the
    row's whole kwargs, ~5 KB with an article and its references; shown by the control below)."""
    import logging

    import torch

    rows = [
        {
            "prompt": [{"role": "user", "content": f"summarize: the dog ran {i} miles"}],
            "article": f"the dog ran {i} miles",
        }
        for i in range(8)
    ]
    trainer = _grpo(tmp_path, JudgeReward(_length_judge(), num_generations=4), rows)
    inputs = [rows[0]] * 4
    prompts = [r["prompt"] for r in inputs]
    completions = [
        [{"role": "assistant", "content": t}] for t in ["", "the dog ran", "a dog", "the dog ran far"]
    ]
    ids = [[1]] * 4
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        got = trainer._calculate_rewards(inputs, prompts, completions, ids)[:, 0]
    assert torch.isfinite(got).all() and got[0] < got[1:].min()
    printed = capfd.readouterr()
    assert (printed.out, printed.err) == ("", "") and not caplog.records

    def none_for_empty(prompts, completions, **kwargs):  # the old behaviour, through the same TRL code
        return [None if not c[0]["content"] else 1.0 for c in completions]

    trainer.reward_funcs = [none_for_empty]
    with caplog.at_level(logging.WARNING):
        trainer._calculate_rewards(inputs, prompts, completions, ids)
    assert "All reward functions returned None" in caplog.text and rows[0]["article"] in caplog.text


def test_trl_grpo_passes_the_reference_column_to_a_judge_that_reads_references(tmp_path):
    """Real GRPOTrainer: with ``reference_column`` the reference judge rewards the batch (equal to
    ``group_rewards`` with the references); a row whose references are empty stops the step with one line
    naming the column, before the judge is called."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"summarize: the dog ran {i} miles"}],
            "article": f"the dog ran {i} miles",
            "references": [f"a dog ran {i} miles"],
        }
        for i in range(8)
    ]
    judge = _rouge_judge()
    reward = JudgeReward(judge, num_generations=4, reference_column="references", keep_history=1)
    trainer = _grpo(tmp_path / "ok", reward, rows)
    trainer.train()
    assert trainer.state.global_step == 1 and reward.judge_calls == 1
    call = reward.history[0]
    for s, e in call["spans"]:
        refs = rows[[r["article"] for r in rows].index(call["sources"][s])]["references"]
        assert call["rewards"][s:e] == group_rewards(
            judge, call["sources"][s], call["completions"][s:e], references=refs
        )

    for row in rows[1:]:  # a step's two prompts: at least one of them without references
        row["references"] = []
    judge = _rouge_judge()
    reward = JudgeReward(judge, num_generations=4, reference_column="references")
    with pytest.raises(
        ValueError,
        match=r"have none \(first: row \d+\); give every row its reference summaries "
        r"in the column reference_column='references'",
    ):
        _grpo(tmp_path / "missing", reward, rows).train()
    assert judge.calls == 0


@pytest.mark.parametrize(
    "fields, refs, message",
    [
        (
            ["data.fields.references=null"],
            [["r"], ["r"]],
            "reads references (judge.signal=rouge) and data.fields.references is not set; set "
            "data.fields.references=FIELD",
        ),
        (
            [],
            [["the cat sat"], []],
            "reads references (judge.signal=rouge) but 1 of 2 have none (first: row 1 (counting from 0)); give every "
            "row its reference summaries in field 'references'",
        ),
    ],
)
def test_label_pairs_with_a_judge_that_reads_references_checks_them_first(
    tmp_path, capsys, fields, refs, message
):
    judge = tmp_path / "rouge_judge"
    _rouge_judge().save_pretrained(judge)
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": "p",
                    "article": "the cat sat on the mat",
                    "chosen": "the cat sat",
                    "rejected": "a dog",
                    "references": r,
                }
            )
            + "\n"
            for r in refs
        )
    )
    args = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        f"judge_path={judge}",
        f"data.path={data}",
        *fields,
        f"output_dir={tmp_path / 'out'}",
    ]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": "p",
                    "article": "the cat sat on the mat",
                    "chosen": "the cat sat",
                    "rejected": "a dog",
                    "references": ["the cat sat"],
                }
            )
            + "\n"
            for _ in refs
        )
    )
    assert cli([*args[:-1], "data.fields.references=references", args[-1]]) == 0  # the fix works
    assert json.loads((tmp_path / "out" / "report.json").read_text())["labeled"] == 2
