"""Policies of the retrieval agent (:mod:`judgeloop.retrieval.agent`): the fixed ones, the confidence-triggered
one, and a controller learned from a judge's reward.

* ``one_shot``: dense retrieval, then answer;
* ``always_escalate``: dense, then every escalation in order while the budget allows, then answer;
* ``gate_once``: dense; if the weak-retrieval gate fires, one escalation; then answer;
* ``confidence_triggered``: dense; answer as soon as the calibrated answer confidence reaches the threshold
  chosen on the calibration split (risk-coverage), else the next escalation; refuse when the budget is spent
  below it;
* ``learned``: :class:`ActionValueController`, a per-action ridge regression of the reward
  (:func:`action_reward`: the judged quality of the final answer minus the cost of each action taken, or
  the refusal's value) on the state's features, trained on the calibration questions' explored actions;
  it takes the action of highest predicted reward among those offered (a one-step greedy controller, the
  direct method of contextual bandits).

The oracle is a :class:`~judgeloop.retrieval.agent.ScriptedPolicy` of the actions that, in hindsight, gave
the best true quality minus cost (the study computes it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from judgeloop.retrieval.agent import EVIDENCE_ACTIONS, AgentState, ScriptedPolicy

__all__ = [
    "FEATURES",
    "ActionValueController",
    "ConfidenceTriggered",
    "GateOnce",
    "LearnedPolicy",
    "action_reward",
    "always_escalate",
    "feature_vector",
    "one_shot",
]

# the state features a learned controller reads (the study's observer computes them on the window)
FEATURES = (
    "top1",
    "top_gap",
    "score_std",
    "bm25_overlap",
    "term_coverage",
    "gate_weak",
    "num_in_set",
    "judge_raw",
    "answer_logprob",
    "rounds",
)


def action_reward(
    quality: float, actions: Sequence[str], costs: Mapping[str, float], refused: bool, refuse_reward: float
) -> float:
    """The reward of an episode: the judged quality of its answer (``refuse_reward`` when it refused)
    minus the cost of every action it took (``costs[action]``, 0 for an action not listed)."""
    gain = refuse_reward if refused else quality
    return float(gain - sum(costs.get(a, 0.0) for a in actions))


def feature_vector(signals: Mapping[str, float]) -> np.ndarray:
    """``(F,)`` the :data:`FEATURES` of ``signals`` (a missing or non-finite one is 0)."""
    out = np.zeros(len(FEATURES))
    for j, name in enumerate(FEATURES):
        v = signals.get(name, 0.0)
        out[j] = v if v is not None and math.isfinite(v) else 0.0
    return out


def one_shot() -> ScriptedPolicy:
    return ScriptedPolicy(["dense", "answer"], "one_shot")


def always_escalate(order: Sequence[str]) -> ScriptedPolicy:
    return ScriptedPolicy(["dense", *order], "always_escalate")


class GateOnce:
    """Dense; one ``escalation`` when the gate's ``gate_weak`` signal is set after it; then answer."""

    def __init__(self, escalation: str) -> None:
        self.escalation = escalation
        self.name = "gate_once"

    def choose(self, state: AgentState, signals: Mapping[str, float], offered: Sequence[str]) -> str:
        if not state.steps:
            return "dense" if "dense" in offered else "refuse"
        if len(state.steps) == 1 and signals.get("gate_weak", 0.0) > 0.5 and self.escalation in offered:
            return self.escalation
        return "answer" if "answer" in offered else "refuse"


class ConfidenceTriggered:
    """Dense; answer when ``signals["confidence"] >= threshold``; else the next escalation of ``order``
    still offered; with none left, refuse (the confidence is under the threshold)."""

    def __init__(self, threshold: float, order: Sequence[str]) -> None:
        self.threshold = threshold
        self.order = list(order)
        self.name = "confidence_triggered"

    def choose(self, state: AgentState, signals: Mapping[str, float], offered: Sequence[str]) -> str:
        if not state.steps:
            return "dense" if "dense" in offered else "refuse"
        conf = signals.get("confidence", math.nan)
        if math.isfinite(conf) and conf >= self.threshold and "answer" in offered:
            return "answer"
        for a in self.order:
            if a in offered:
                return a
        return "refuse"


class ActionValueController:
    """Predicted reward-to-go of each action from the state's features: one ridge regression per action
    on standardized features, ``r_a(x) = w_a . z(x) + b_a`` (closed form, ``l2`` on the weights only).

    Learned attributes: ``mean_``, ``scale_`` (standardization), ``weights_`` (action -> (F,)), ``bias_``
    (action -> float), ``n_fit_`` (action -> rows).
    """

    def __init__(self, l2: float = 1.0, min_rows: int = 3) -> None:
        if l2 < 0:
            raise ValueError(f"controller l2={l2} must be >= 0")
        self.l2 = l2
        self.min_rows = min_rows

    def fit(self, x: np.ndarray, actions: Sequence[str], rewards: Sequence[float]) -> ActionValueController:
        """Fit on rows ``x`` ``(N, F)``, the action each row took and the reward it got."""
        X = np.asarray(x, dtype=np.float64)
        r = np.asarray(rewards, dtype=np.float64)
        if X.ndim != 2 or X.shape[0] != len(actions) or r.shape != (len(actions),):
            raise ValueError(
                f"controller: {X.shape} features for {len(actions)} actions and {r.shape} rewards"
            )
        self.mean_ = X.mean(axis=0)
        sd = X.std(axis=0)
        self.scale_ = np.where(sd > 1e-12, sd, 1.0)
        Z = (X - self.mean_) / self.scale_
        self.weights_, self.bias_, self.n_fit_ = {}, {}, {}
        for a in sorted(set(actions)):
            rows = np.asarray([x == a for x in actions])
            if rows.sum() < self.min_rows:
                continue
            Za, ra = Z[rows], r[rows]
            zc, rc = Za - Za.mean(axis=0), ra - ra.mean()
            w = np.linalg.solve(zc.T @ zc + self.l2 * np.eye(Z.shape[1]), zc.T @ rc)
            self.weights_[a] = w
            self.bias_[a] = float(ra.mean() - Za.mean(axis=0) @ w)
            self.n_fit_[a] = int(rows.sum())
        return self

    def predict(self, x: np.ndarray) -> dict[str, float]:
        """Action -> predicted reward for one feature row ``(F,)`` (the actions fitted only)."""
        if not hasattr(self, "weights_"):
            raise RuntimeError("ActionValueController is not fitted; call fit(...) on the calibration rows")
        z = (np.asarray(x, dtype=np.float64) - self.mean_) / self.scale_
        return {a: float(w @ z + self.bias_[a]) for a, w in self.weights_.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "l2": self.l2,
            "features": list(FEATURES),
            "mean_": self.mean_.tolist(),
            "scale_": self.scale_.tolist(),
            "weights_": {a: w.tolist() for a, w in self.weights_.items()},
            "bias_": self.bias_,
            "n_fit_": self.n_fit_,
        }


class LearnedPolicy:
    """Dense first (the features need a window); then the offered action of highest predicted reward-to-go
    (``refuse`` is worth ``refuse_reward``; an action the controller never saw is not taken)."""

    def __init__(self, controller: ActionValueController, refuse_reward: float, name: str) -> None:
        self.controller = controller
        self.refuse_reward = refuse_reward
        self.name = name

    def values(self, signals: Mapping[str, float], offered: Sequence[str]) -> dict[str, float]:
        pred = self.controller.predict(feature_vector(signals))
        out = {a: pred[a] for a in offered if a in pred and a in (*EVIDENCE_ACTIONS, "answer")}
        if "refuse" in offered:
            out["refuse"] = self.refuse_reward
        return out

    def choose(self, state: AgentState, signals: Mapping[str, float], offered: Sequence[str]) -> str:
        if not state.steps:
            return "dense" if "dense" in offered else "refuse"
        values = self.values(signals, offered)
        return max(values, key=lambda a: (values[a], -list(offered).index(a)))
