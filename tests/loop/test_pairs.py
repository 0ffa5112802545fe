"""Calibration pairs of policy samples (judgeloop.loop.pairs): leakage, fresh pairs, one gathering."""

from __future__ import annotations

import pytest

from judgeloop.config import load_config
from judgeloop.data import LeakageError, SummExample
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.pairs import CalibrationPairs, check_calibration_disjoint, gather_pairs
from loop_common import FAST, TINY


def _pairs(tag: str, n: int, ties: int, failures: int) -> CalibrationPairs:
    ids = [f"{tag}{i}" for i in range(n)]
    return CalibrationPairs(
        ids,
        [f"art {i}" for i in ids],
        [f"a {i}" for i in ids],
        [f"b {i}" for i in ids],
        [float(k) for k in range(n)],
        [k % 2 for k in range(n)],
        [[f"ref {i}"] for i in ids],
        ties,
        failures,
    )


def test_pairs_extend_in_order_and_add_up_their_counts():
    """What every process's pairs become once gathered: in process order, the dropped ones counted."""
    out = CalibrationPairs()
    for part in (_pairs("p0-", 3, 1, 0), _pairs("p1-", 0, 2, 1), _pairs("p2-", 2, 0, 4)):
        out.extend(part)
    assert out.article_ids == ["p0-0", "p0-1", "p0-2", "p2-0", "p2-1"]
    assert out.scores == [0.0, 1.0, 2.0, 0.0, 1.0] and out.references[3] == ["ref p2-0"]
    assert (out.ties_dropped, out.judge_failures) == (3, 5)


def test_gather_pairs_on_one_process_is_the_process_own_pairs():
    mine = _pairs("c", 4, 2, 1)
    got = gather_pairs(mine)
    assert got == mine and got is not mine


def test_leakage_check_raises_on_training_articles_in_calibration():
    train = [
        SummExample("t1", "Alpha beta gamma.", {"neutral": ["a"]}),
        SummExample("t2", "Delta.", {"neutral": ["d"]}),
    ]
    calib_ok = [SummExample("c1", "Epsilon zeta.", {"neutral": ["e"]})]
    check_calibration_disjoint(train, calib_ok)
    with pytest.raises(LeakageError, match="calibration articles overlap the policy's training articles"):
        check_calibration_disjoint(train, [*calib_ok, SummExample("t2", "Other text.", {"neutral": ["o"]})])
    with pytest.raises(LeakageError, match="identical article text"):
        check_calibration_disjoint(train, [SummExample("c9", "alpha  beta gamma.", {"neutral": ["x"]})])


def test_calibration_collection_draws_more_articles_when_ties_leave_too_few_pairs():
    """Ties carry no label; when fewer than min_points pairs remain to fit on, more calibration articles
    are drawn (up to extra_rounds more batches), and never when there are enough."""
    from accelerate import Accelerator

    from judgeloop.judges import build_judge
    from judgeloop.loop.pairs import collect_calibration_pairs
    from judgeloop.loop.policy import Policy, load_policy
    from judgeloop.loop.rollout import PromptBuilder
    from judgeloop.loop.state import load_splits

    def collect(*over: str):
        cfg = load_config(
            FeedbackLoopConfig,
            TINY,
            [
                *FAST,
                "policy.sft_steps=0",
                "calibration.num_articles=4",
                "calibration.pairs_per_article=1",
                *over,
            ],
        )
        splits = load_splits(cfg)
        model, tok, _ = load_policy(cfg.policy, 0)
        judge = build_judge(cfg.judge)
        policy = Policy(Accelerator(cpu=True), model, None, tok, PromptBuilder(tok, cfg.policy))
        pairs = collect_calibration_pairs(policy, judge, splits.calibration, cfg, 1)
        calib_ids = {e.id for e in splits.calibration}
        assert set(pairs.article_ids) <= calib_ids  # only calibration articles, in every round
        return pairs

    enough = collect("calibration.min_points=1")
    assert len(enough) >= 1 and len(enough) + enough.ties_dropped == 4  # one round: 4 articles x 1 pair
    capped = collect("calibration.min_points=1000", "calibration.extra_rounds=0")
    assert len(capped) + capped.ties_dropped == 4 and capped.article_ids == enough.article_ids
    more = collect("calibration.min_points=1000", "calibration.extra_rounds=2")
    assert len(more) + more.ties_dropped == 12  # two more batches of 4 articles, labeled or tied
    assert more.article_ids[: len(enough)] == enough.article_ids  # the first round is unchanged
