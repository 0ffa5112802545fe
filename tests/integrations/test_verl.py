"""verl as verl runs it: the launch line of docs/integrations.md composed into verl's own hydra config
(``ppo_trainer``), checked by verl's ``validate_config``, the reward function loaded by verl's loader,
and verl's ``RewardLoopManager`` on Ray scoring a real ``DataProto`` (2 prompts x ``rollout.n``
responses, split across 2 reward workers) through a real ``judgeloop serve-judge`` on a loopback port,
then verl's validation batch (``val_kwargs.n=1``: each response alone, judged against its ground truth,
with no wait). Also the rows the loaded function refuses before posting, and the unsupported-version
error.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import verl  # noqa: F401  (Makefile: verl --no-deps; its reward path imports in the dev extras)

from judgeloop.calibration import PlattCalibrator  # noqa: E402
from judgeloop.judges import JudgeConfig  # noqa: E402
from judgeloop.judges.calibrated import CalibratedJudge  # noqa: E402
from judgeloop.rewards import EmptyLoses, Group, RewardConfig, score_groups  # noqa: E402
from launch_lines import launch_lines  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from test_serve import serve  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
ARTICLES = [
    "the city council voted on tuesday to expand the bus network to the northern suburbs.",
    "a new study finds that regular walking lowers blood pressure in adults over sixty.",
]
RESPONSES = [
    "the council expanded buses.",
    "council votes to extend bus lines to northern suburbs because demand rises.",
    "buses.",
    "the council voted on buses on tuesday.",
    "walking lowers blood pressure.",
    "a study about walking.",
    "",  # the policy wrote nothing
    "older adults who walk have lower blood pressure, a study finds.",
]
REFERENCES = [  # the validation rows' reward_model.ground_truth
    "the council voted to extend buses to the northern suburbs.",
    "walking lowers blood pressure in adults over sixty, a study finds.",
]
# settings a real run sets anyway (batch sizes, one device); not part of the reward path
RUN_ONLY = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "trainer.n_gpus_per_node=1",
    "reward.num_workers=2",
]


@pytest.fixture(scope="module")
def length_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A calibrated judge without a model (shorter wins), so the test's time goes to verl's own path."""
    path = tmp_path_factory.mktemp("verl_judge") / "judge"
    platt = PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": 0.7, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )
    CalibratedJudge(JudgeConfig(type="objective", signal="length", scale=0.5), platt).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(length_judge: Path) -> Iterator[str]:
    with serve(length_judge) as (url, _):
        yield url


VERL_COMMAND = "python -m verl.trainer.main_ppo"


def test_the_verl_launch_line_is_the_same_on_both_pages() -> None:
    """docs/integrations.md and docs/serving.md both give it; the reward-path test runs the first."""
    assert launch_lines("integrations.md", VERL_COMMAND) == launch_lines("serving.md", VERL_COMMAND)


def documented_overrides(url: str) -> list[str]:
    """The verl launch line of docs/integrations.md, its server address pointed at the test server."""
    (line,) = launch_lines("integrations.md", VERL_COMMAND)
    return [a.replace("http://127.0.0.1:8000", url) for a in line]


def verl_config(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config composed with ``overrides``, as ``main_ppo``'s hydra does."""
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def rollout_batch(
    tokenizer: Any, texts: list[str], split: str, references: list[str | None] | None = None
) -> tuple[Any, list[str]]:
    """A ``DataProto`` as verl's rollout leaves it: prompts, right-padded responses, the attention mask,
    and the parquet's columns (``data_source``, ``reward_model.ground_truth``, ``extra_info`` with the
    article and the ``split`` verl's example preparers write), the ``len(texts) // len(ARTICLES)``
    responses of each prompt side by side; and the responses as verl decodes them."""
    import torch
    from verl import DataProto

    prompt_len, response_len = 4, 24
    rows = len(texts)
    n = rows // len(ARTICLES)
    prompts = torch.full((rows, prompt_len), tokenizer.pad_token_id, dtype=torch.long)
    responses = torch.full((rows, response_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, prompt_len + response_len, dtype=torch.long)
    mask[:, :prompt_len] = 1
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:response_len]
        ids = ids or [tokenizer.pad_token_id]  # an empty response is one pad token, decoded to ""
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, prompt_len : prompt_len + len(ids)] = 1
    article = [ARTICLES[i // n] for i in range(rows)]
    truth = [None if references is None else references[i // n] for i in range(rows)]
    decoded = [
        tokenizer.decode(r[m[prompt_len:].bool()], skip_special_tokens=True) for r, m in zip(responses, mask)
    ]
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
        },
        non_tensors={
            "data_source": np.array(["summeval"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in truth], dtype=object),
            "extra_info": np.array(
                [{"article": a, "index": i, "split": split} for i, a in enumerate(article)], dtype=object
            ),
        },
    ), decoded


def test_verl_runs_the_documented_reward_path(server: str, length_judge: Path) -> None:
    import ray
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.config import validate_config

    from judgeloop.integrations import verl as adapter
    from judgeloop.models.loading import _minilm_from_wheel

    tokenizer_dir = str(_minilm_from_wheel())  # any local tokenizer: the reward path only decodes with it
    config = verl_config(
        documented_overrides(server) + RUN_ONLY + [f"actor_rollout_ref.model.path={tokenizer_dir}"]
    )
    validate_config(
        config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    loaded = get_custom_reward_fn(config)  # verl's loader, from reward.custom_reward_function.*
    assert loaded.args[0] is adapter.compute_score
    n = int(config.actor_rollout_ref.rollout.n)
    assert loaded.args[1]["group_size"] == n  # the documented line keeps the two equal
    # validation (trainer.val_before_train, on by default) goes through the same function, val_kwargs.n
    # responses per prompt: the documented line leaves val_group_size at its default, verl's default n
    val_n = int(config.actor_rollout_ref.rollout.val_kwargs.n)
    assert config.trainer.val_before_train and val_n == 1
    default_val = inspect.signature(adapter.compute_score).parameters["val_group_size"].default
    assert loaded.args[1].get("val_group_size", default_val) == val_n

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    # the first prompt's responses all have text, the second's include the empty one
    texts = [RESPONSES[j % len(RESPONSES)] or "the council met." for j in range(n)]
    texts += [RESPONSES[j % len(RESPONSES)] for j in range(n)]
    batch, decoded = rollout_batch(tokenizer, texts, "train")
    # verl's validation batch: one response per prompt (the second empty), the reference as ground_truth
    val_batch, val_decoded = rollout_batch(tokenizer, [RESPONSES[1], ""], "test", REFERENCES)
    env = {"PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        manager = RewardLoopManager(config)
        out = manager.compute_rm_score(batch)
        start = time.monotonic()
        val_out = manager.compute_rm_score(val_batch)
        val_seconds = time.monotonic() - start
    finally:
        ray.shutdown()

    rm_scores = out.batch["rm_scores"]  # (rows, response_len): the reward on each last valid token
    got = rm_scores.sum(1).tolist()
    groups = [{"prompt": a, "completions": decoded[g * n : (g + 1) * n]} for g, a in enumerate(ARTICLES)]
    # the same groups in one /v1/rewards request (equal to the in-process judge: tests/serving)
    want = httpx.post(
        server + "/v1/rewards", json={"groups": groups, "empty_completions": "lose"}, timeout=60
    ).json()["rewards"]
    assert got == pytest.approx(want[0] + want[1], abs=1e-6)
    settings = httpx.get(server + "/v1/info", timeout=10).json()["rewards"]
    judge = CalibratedJudge.from_pretrained(length_judge)
    alone = score_groups(judge, [Group(ARTICLES[0], decoded[:n])], RewardConfig(**settings)).rewards[0]
    assert got[:n] == pytest.approx(alone, abs=1e-6)
    empty = [int(not t) for t in decoded]
    assert (
        sum(empty) == 1 and got[empty.index(1)] == min(got[n:]) == 0.0
    )  # win rate: it lost every comparison
    assert list(out.non_tensor_batch["judge_empty"]) == empty
    assert "judge_empty" in out.meta_info["reward_extra_keys"]
    stats = httpx.get(server + "/v1/info", timeout=10).json()["stats"]
    assert (
        stats["verl_posts"] == len(got) + 2
        and stats["verl_groups"] == 4
        and stats["verl_partial_groups"] == 0
    )

    # validation: each response alone, judged against its reference at once (no group_wait_s), the
    # empty one 0.0 unjudged
    val_got = val_out.batch["rm_scores"].sum(1).tolist()
    anchored = RewardConfig(**{**settings, "scheme": "anchor"})
    want_val = [
        score_groups(EmptyLoses(judge), [Group(a, [t], r)], anchored).rewards[0][0]
        for a, t, r in zip(ARTICLES, val_decoded, REFERENCES)
    ]
    assert val_got == pytest.approx(want_val, abs=1e-6) and val_got[1] == 0.0 < val_got[0] < 1.0
    assert list(val_out.non_tensor_batch["judge_group_size"]) == [1, 1]
    assert val_seconds < float(inspect.signature(adapter.compute_score).parameters["group_wait_s"].default)


def loaded_reward_fn(url: str) -> Any:
    """The reward function as verl's loader hands it to the reward manager (the documented line)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    return get_custom_reward_fn(verl_config(documented_overrides(url)))


@pytest.mark.parametrize(
    ("extra_info", "ground_truth", "message"),
    [
        ({"article": ARTICLES[0]}, None, "extra_info has no 'split' (keys: ['article']); verl validates"),
        ({"article": ARTICLES[0], "split": "test"}, None, "a group of one response (validation with"),
    ],
    ids=["no_split", "val_group_of_one_without_ground_truth"],
)
def test_a_row_the_reward_cannot_score_is_refused_before_posting(
    extra_info: dict[str, Any], ground_truth: Any, message: str
) -> None:
    import asyncio

    unreachable = "http://127.0.0.1:9"  # nothing is posted: the row is refused first
    fn = loaded_reward_fn(unreachable)
    with pytest.raises(ValueError, match="^" + re.escape(message)) as err:
        asyncio.run(
            fn(data_source="summeval", solution_str="s", ground_truth=ground_truth, extra_info=extra_info)
        )
    assert "\n" not in str(err.value) and "reward_kwargs" in str(err.value)


@pytest.mark.parametrize("version", ["0.6.1", "0.10.0"])
def test_an_unsupported_verl_is_refused_naming_the_version_and_the_fix(version: str) -> None:
    from judgeloop.integrations.verl import SUPPORTED_VERL, check_verl_version

    with pytest.raises(RuntimeError) as err:
        check_verl_version(version)
    low, high = SUPPORTED_VERL
    assert str(err.value) == (
        f"verl {version} is not supported by judgeloop.integrations.verl (supported: verl>={low},<{high}, "
        "whose reward loop awaits compute_score once per response); install verl==0.9.1"
    )
    assert check_verl_version() == verl.__version__  # the installed one is supported
