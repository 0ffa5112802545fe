"""The spellings renamed in 0.2.0 still work for one release: each gives what its new spelling gives and
warns (DeprecationWarning) with the new spelling; CHANGELOG.md names each one."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

from judgeloop.calibration import PlattCalibrator
from judgeloop.deprecation import REMOVED_IN
from judgeloop.integrations.trl import JudgeReward
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge
from judgeloop.rewards import Group, RewardConfig, check_scheme, group_rewards, score_groups

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
ARTICLE = "the council met on monday and voted to expand the city park by ten acres next spring"
COMPLETIONS = ["park grows", "the park grows soon", "the council votes the park grows", "the park"]


@pytest.fixture(scope="module")
def judge() -> CalibratedJudge:
    cal = PlattCalibrator().load_state_dict(
        {
            "method": "platt",
            "symmetric": True,
            "min_points": 10,
            "n_fit_": 100,
            "params": {"a_": 0.7, "b_": 0.0, "fit_intercept": False, "target_smoothing": False},
        }
    )
    return CalibratedJudge(JudgeConfig(type="objective", signal="length", scale=0.5), cal)


def _one_warning(record: list[warnings.WarningMessage]) -> str:
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in record]
    assert deprecations[0].filename == __file__, "the warning points at the caller's line"
    return str(deprecations[0].message)


def test_judge_reward_with_the_old_keywords_is_the_new_spelling_and_warns_with_it(judge):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = JudgeReward(judge, scheme="all_pairs", aggregate="bradley_terry", prior=0.5, num_generations=4)
    message = _one_warning(record)
    new = JudgeReward(
        judge, RewardConfig(scheme="all_pairs", aggregate="bradley_terry", prior=0.5), num_generations=4
    )
    assert old.rewards == new.rewards
    assert (
        "JudgeReward(judge, RewardConfig(scheme='all_pairs', aggregate='bradley_terry', prior=0.5))"
        in message
    )
    assert "JudgeReward(judge, scheme=..., aggregate=..., prior=...)" in message and REMOVED_IN in message
    batch = {"article": [ARTICLE] * 4}
    prompts = ["p"] * 4
    assert old(prompts, COMPLETIONS, **batch) == new(prompts, COMPLETIONS, **batch)


def test_the_old_keywords_keep_their_default_scheme_all_pairs(judge):
    """Before 0.2.0 the scheme defaulted to all_pairs (now round_robin): an old call that did not name it
    keeps all_pairs, and the warning's new spelling says so."""
    with pytest.warns(DeprecationWarning, match=r"RewardConfig\(scheme='all_pairs', aggregate='win_rate'\)"):
        old = JudgeReward(judge, aggregate="win_rate")
    assert old.rewards == RewardConfig(scheme="all_pairs", aggregate="win_rate")


@pytest.mark.parametrize(
    "settings",
    [
        {"scheme": "round_robin", "m": 2, "aggregate": "bradley_terry"},  # the pre-0.2.0 docs' example
        {"scheme": "all_pairs", "probability": "raw"},
        {"scheme": "anchor", "aggregate": "bradley_terry"},
    ],
)
def test_group_rewards_and_score_groups_with_the_old_keywords_equal_the_new_spelling(judge, settings):
    anchor = "the park" if settings["scheme"] == "anchor" else None
    new = group_rewards(judge, ARTICLE, COMPLETIONS, RewardConfig(**settings), anchor=anchor)
    with pytest.warns(DeprecationWarning, match=r"group_rewards\(judge, prompt, completions, RewardConfig\("):
        old = group_rewards(judge, ARTICLE, COMPLETIONS, anchor=anchor, **settings)
    assert old == new
    groups = [Group(ARTICLE, COMPLETIONS, anchor)]
    with pytest.warns(DeprecationWarning, match=r"score_groups\(judge, groups, RewardConfig\("):
        scores = score_groups(judge, groups, **settings)
    assert scores.rewards == score_groups(judge, groups, RewardConfig(**settings)).rewards == [new]


def test_the_old_and_the_new_spelling_at_once_or_a_misspelled_keyword_is_a_type_error(judge):
    with pytest.raises(TypeError, match=r"give the settings once, as rewards=RewardConfig"):
        JudgeReward(judge, RewardConfig(), scheme="all_pairs")
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'schem'; did you mean RewardConfig\(scheme"
    ):
        group_rewards(judge, ARTICLE, COMPLETIONS, schem="all_pairs")
    with pytest.raises(
        TypeError, match=r"score_groups: rewards='all_pairs'; pass a judgeloop.rewards.RewardConfig"
    ):
        score_groups(judge, [Group(ARTICLE, COMPLETIONS)], "all_pairs")  # type: ignore[arg-type]


def test_check_scheme_checks_as_reward_config_does_and_warns():
    with pytest.warns(DeprecationWarning, match=r"write RewardConfig\(scheme=scheme"):
        check_scheme("all_pairs", "win_rate", 2, 0.1)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match="'rewards.aggregate' must be one of .*got 'elo'"),
    ):
        check_scheme("all_pairs", "elo", 2, 0.1)


MOVED_MODULES = [
    ("judgeloop.label_pairs", "judgeloop.preference_labels", "label"),
    ("judgeloop.integrations.openrlhf", "judgeloop.serving.openrlhf", "openrlhf_router"),
    ("judgeloop.integrations.verl_route", "judgeloop.serving.verl_route", "verl_router"),
    ("judgeloop.serving.openai_compat", "judgeloop.testing.openai_compat", "make_server"),
    ("judgeloop.serving.llamacpp", "judgeloop.testing.llamacpp", "start_server"),
]


@pytest.mark.parametrize("old, new, name", MOVED_MODULES)
def test_a_moved_module_is_the_new_module_under_its_old_name_and_the_import_warns(old, new, name):
    sys.modules.pop(old, None)  # a fresh import runs the alias (an earlier one left the new module there)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", __file__, "exec"), {})  # an import statement, as a user writes it
    message = _one_warning(record)
    module = sys.modules[old]
    assert module is importlib.import_module(new) and getattr(module, name) is getattr(sys.modules[new], name)
    assert f"the module {old} is deprecated" in message and f"write import {new}" in message
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        exec(f"from {old} import {name}", {})


@pytest.mark.slow
def test_python_m_the_old_test_server_module_serves_and_warns_with_the_new_command():
    """``python -m judgeloop.serving.openai_compat MODEL --port N`` (the docs' and scripts' line before the
    server moved to judgeloop.testing) still serves, and says on stderr what to write now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "judgeloop.serving.openai_compat",
        "judgeloop-tiny/causal-lm",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        models = None
        for _ in range(600):  # until it answers (a model load on busy cores), or it exits
            if proc.poll() is not None:
                break
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert models is not None, proc.communicate(timeout=10)[1][-2000:]
        assert models["data"][0]["id"] == "judgeloop-tiny/causal-lm"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "DeprecationWarning: python -m judgeloop.serving.openai_compat is deprecated" in err, err[-2000:]
    assert "write python -m judgeloop.testing.openai_compat" in err and REMOVED_IN in err


def test_the_changelog_names_every_deprecated_spelling():
    text = CHANGELOG.read_text()
    for spelling in (
        "JudgeReward(judge, scheme=",
        "group_rewards(",
        "score_groups(",
        "check_scheme",
        *(old for old, _, _ in MOVED_MODULES),
    ):
        assert spelling in text, f"CHANGELOG.md does not name the deprecated {spelling}"
