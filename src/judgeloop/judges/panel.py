"""A panel of judges: several judges (and objective signals), each calibrated on its own, voting as one.

A policy trained against one judge learns that judge's blind spots; a panel whose members fail in
different ways is harder to please by accident. Each member ``m`` gives its raw logit ``s_m``; its own
calibrator (Platt by default, fitted on labeled pairs with :meth:`PanelJudge.fit_labels`) maps it to
``p_m``; the panel's logit is one of:

* ``mean_prob``: ``logit(sum_m w_m p_m / sum_m w_m)``;
* ``mean_logit``: ``sum_m w_m logit(p_m) / sum_m w_m`` (with objective signals as members, the
  weights are the mixing weights of judge and signals);
* ``stacked``: ``sum_m beta_m logit(p_m)``, ``beta`` a logistic regression without intercept fitted on
  both orientations of the labeled pairs, so the panel stays antisymmetric like every calibrator.

Before any fit a member's ``p_m`` is ``sigmoid(s_m)`` (the raw panel). Every output carries the
members' calibrated ``p_m`` (:attr:`JudgeOutput.members`) and their spread, the disagreement a training
loop can down-weight. A pair fails (``nan``) when any member fails on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from scipy.special import expit, logit

from judgeloop.calibration.calibrators import Calibrator, calibrator_from_state, fit_logistic, make_calibrator
from judgeloop.calibration.features import pair_feature_matrix
from judgeloop.judges.base import VALID_STATUSES, Judge, JudgeOutput, Pair, merge_status

COMBINE_RULES = ("mean_prob", "mean_logit", "stacked")
Combine = Literal["mean_prob", "mean_logit", "stacked"]
_EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    return logit(np.clip(p, _EPS, 1.0 - _EPS))


class PanelJudge(Judge):
    """Members ``[(name, judge), ...]`` combined by ``combine`` (see the module docstring).

    Args:
        members: at least two named judges; names must differ.
        combine: ``mean_prob``, ``mean_logit`` or ``stacked``.
        weights: one non-negative weight per member for ``mean_prob`` / ``mean_logit`` (default equal).
        member_calibration: the calibrator each member gets (``platt``, ``isotonic``, ``temperature``,
            ``feature_platt``).
        min_points: the fewest labeled pairs a member's calibrator is fitted on.
        calibrate: per member, whether its calibrator is fitted (default: all); an unfitted member's
            ``p`` stays ``sigmoid(s)`` (an objective penalty keeps its direction).
    """

    def __init__(
        self,
        members: Sequence[tuple[str, Judge]],
        combine: Combine = "mean_logit",
        weights: Sequence[float] | None = None,
        member_calibration: str = "platt",
        min_points: int = 10,
        calibrate: Sequence[bool] | None = None,
    ):
        names = [n for n, _ in members]
        if len(members) < 2:
            raise ValueError(
                f"a judge panel needs at least two members, got {len(members)}; add judge.panel.members"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"judge panel member names {names} repeat; give each member its own judge.name")
        if combine not in COMBINE_RULES:
            raise ValueError(f"judge.panel.combine={combine!r}; use one of {list(COMBINE_RULES)}")
        w = np.ones(len(members)) if not weights else np.asarray(weights, dtype=float)
        if w.shape != (len(members),) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(
                f"judge.panel.weights={list(weights or [])} must be {len(members)} non-negative numbers "
                "(one per member), not all zero"
            )
        styles = {getattr(j, "reference_style", "neutral") for _, j in members} - {"none"}
        if len(styles) > 1:
            raise ValueError(
                f"judge panel members read different references ({sorted(styles)}); a panel passes one kind: "
                "give every embedding member the same embedding_target"
            )
        super().__init__(
            name=f"panel({', '.join(names)}; {combine})",
            batch_size=max(j.batch_size for _, j in members),
            cache_size=0,  # the members cache; the panel's map changes at every fit
        )
        self.members = list(members)
        self.combine = combine
        self.weights = w / w.sum()
        self.member_calibration = member_calibration
        self.min_points = min_points
        self.reference_style = styles.pop() if styles else "none"
        self.device = getattr(self.members[0][1], "device", "cpu")
        self.calibrate = list(calibrate) if calibrate is not None else [True] * len(members)
        if len(self.calibrate) != len(members):
            raise ValueError(f"panel: {len(self.calibrate)} calibrate flags for {len(members)} members")
        self.calibrators_: dict[str, Calibrator] | None = None
        self.stack_: np.ndarray = self.weights.copy()

    # --- the Judge interface ---------------------------------------------------------------------
    @property
    def learns_from_labels(self) -> bool:
        return True

    @property
    def can_prepare(self) -> bool:
        return any(j.can_prepare for _, j in self.members)

    def prepare(self, articles: Sequence[str], references: Sequence[Sequence[str]] | None = None) -> None:
        for _, judge in self.members:
            if judge.can_prepare:
                judge.prepare(articles, references)

    def score(self, pairs: Sequence[Pair]) -> JudgeOutput:
        pairs = list(pairs)
        with self._lock:
            outs = self._member_outputs(pairs)
            status = list(outs[self.members[0][0]].status)
            for out in list(outs.values())[1:]:
                status = [merge_status(a, b) for a, b in zip(status, out.status)]
            probs = self.member_probs(pairs, outs)
            z = self._combine(probs)
            z[[s not in VALID_STATUSES for s in status]] = np.nan
            self.stats.status.update(status)
            return JudgeOutput(scores=z, status=status, forward=z.copy(), members=probs)

    def fit_labels(self, pairs: Sequence[Pair], labels: Sequence[int]) -> None:
        """Fit every member's calibrator on the pairs it judged validly, then (``stacked``) the combination.

        Raises:
            CalibrationError: a member has too few valid pairs, or one label class only.
        """
        pairs, y = list(pairs), np.asarray(labels, dtype=float)
        if len(pairs) != y.size:
            raise ValueError(f"fit_labels got {len(pairs)} pairs and {y.size} labels; lengths must match")
        with self._lock:
            outs = self._member_outputs(pairs)
            calibrators: dict[str, Calibrator] = {}
            for (name, _), fit in zip(self.members, self.calibrate):
                if not fit:
                    calibrators[name] = make_calibrator("raw")
                    continue
                out, cal = outs[name], make_calibrator(self.member_calibration, min_points=self.min_points)
                ok = out.valid
                feats = pair_feature_matrix(pairs, valid=ok)[ok] if cal.uses_features else None
                calibrators[name] = cal.fit(out.scores[ok], y[ok], feats)
            self.calibrators_ = calibrators
            if self.combine == "stacked":
                probs = self.member_probs(pairs, outs)
                Z = np.stack([_logit(probs[n]) for n, _ in self.members], axis=1)
                ok = np.isfinite(Z).all(axis=1)
                X = np.concatenate([Z[ok], -Z[ok]])  # both orientations: the map stays antisymmetric
                t = np.concatenate([y[ok], 1.0 - y[ok]])
                self.stack_ = fit_logistic(X, t, l2=1e-3)

    # --- pieces ----------------------------------------------------------------------------------
    def _member_outputs(self, pairs: list[Pair]) -> dict[str, JudgeOutput]:
        return {name: judge.score(pairs) for name, judge in self.members}

    def member_probs(self, pairs: list[Pair], outs: dict[str, JudgeOutput]) -> dict[str, np.ndarray]:
        """Each member's calibrated P(a better than b) (``sigmoid`` of its raw logit before any fit)."""
        probs = {}
        for name, _ in self.members:
            s = outs[name].scores
            if self.calibrators_ is None:
                probs[name] = expit(s)
                continue
            cal = self.calibrators_[name]
            feats = pair_feature_matrix(pairs) if cal.uses_features else None
            probs[name] = cal.predict_proba(s, feats) if len(pairs) else np.zeros(0)
        return probs

    def _combine(self, probs: dict[str, np.ndarray]) -> np.ndarray:
        P = np.stack([probs[n] for n, _ in self.members], axis=1)  # (N, M)
        if self.combine == "mean_prob":
            return _logit(P @ self.weights)
        w = self.stack_ if self.combine == "stacked" else self.weights
        return _logit(P) @ w

    # --- persistence (the loop checkpoints a fitted panel with its calibrator) -----------------------
    def state_dict(self) -> dict[str, Any]:
        """The fitted state: each member's calibrator and the stacking weights (JSON-serializable)."""
        return {
            "members": [n for n, _ in self.members],
            "calibrators": None
            if self.calibrators_ is None
            else {n: c.state_dict() for n, c in self.calibrators_.items()},
            "stack": self.stack_.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> PanelJudge:
        """Restore what :meth:`state_dict` saved (the members must be the same, by name)."""
        names = [n for n, _ in self.members]
        if state["members"] != names:
            raise ValueError(f"panel state is for members {state['members']}, this panel has {names}")
        cals = state["calibrators"]
        self.calibrators_ = None if cals is None else {n: calibrator_from_state(cals[n]) for n in names}
        self.stack_ = np.asarray(state["stack"], dtype=float)
        return self
