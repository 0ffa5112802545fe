"""Groupwise rewards from pairwise judgements: one reward per completion of a prompt's group.

Group-relative RL (GRPO, RLOO) samples k completions per prompt and needs a reward for each. A pairwise
judge says which of two is better, so a group's rewards come from comparisons inside it:

* ``scheme`` (which comparisons): ``round_robin`` (default: each completion against the next ``m``, in a
  canonical order, about k*m comparisons, so cost grows with k, not k^2; with ``m = 2`` and k <= 5 these
  are every pair, in the same order), ``all_pairs`` (every pair, k(k-1)/2), ``anchor`` (each completion
  against one reference text: the dataset's reference, the greedy sample);
* ``aggregate`` (comparisons -> rewards): ``win_rate`` (mean calibrated p of beating the others, in
  [0, 1]) or ``bradley_terry`` (the maximum a posteriori Bradley-Terry strengths of the soft outcomes
  under a Gaussian prior of precision ``prior``, so a completion that wins everything stays finite;
  strengths sum to 0 over the group, or are relative to the anchor).

These settings are one :class:`RewardConfig`, the ``rewards:`` section of every config that has one
(``judgeloop train``, ``recipes/grpo_trl.py``, ``judgeloop serve-judge``), passed whole.

Every comparison of every group in a batch goes to the judge in one call (:func:`score_groups`).
Completions are de-duplicated first: identical completions get identical rewards, and the comparison
design is built on the distinct completions sorted by content, so the rewards do not depend on the
order of completions within the group. With :class:`EmptyLoses` around the judge, an empty completion
is not judged: it loses to every non-empty text (p = 0) and ties another empty one, so it gets the
lowest reward of its group under either aggregate. A pairwise judge that does not debias positions is asked both
orders of each comparison (the two calibrated p are averaged); a failed comparison is dropped from the
aggregate and counted, and a completion with no valid comparison gets ``None`` (which TRL reads as "not
applicable").
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
from scipy.special import expit

from judgeloop.config import bounded, check_fields
from judgeloop.deprecation import warn_renamed
from judgeloop.judges.calibrated import Comparison

Scheme = Literal["all_pairs", "round_robin", "anchor"]
Aggregate = Literal["win_rate", "bradley_terry"]
Probability = Literal["calibrated", "raw"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
AGGREGATES: tuple[str, ...] = get_args(Aggregate)
PROBABILITIES: tuple[str, ...] = get_args(Probability)
ANCHOR = -1  # the anchor's index in a group's comparisons
# below it the prior is numerically zero beside the comparisons' weights in Newton's Hessian, which is then
# singular (the fit failed at 1e-15 on groups of 2-64 with decided outcomes; 1e-9 keeps a margin)
MIN_PRIOR = 1e-9


@dataclass
class Group:
    """One prompt's completions: ``source`` is the text the judge reads them against (the article),
    ``anchor`` the reference completion of the ``anchor`` scheme, ``references`` what a reference-based
    judge compares to."""

    source: str
    completions: list[str]
    anchor: str | None = None
    references: tuple[str, ...] = ()


@dataclass
class GroupScores:
    """Rewards of a batch of groups, and what it took to get them.

    Attributes:
        rewards: per group, one reward per completion (``None``: no valid comparison).
        comparisons: distinct comparisons judged (after de-duplication), per group.
        failed: comparisons whose judgement failed (dropped from the aggregates), per group.
        judge_calls: calls to the judge for the whole batch (1, or 0 when nothing needed judging).
        mean_p: mean calibrated p of the valid comparisons (as the first-listed completion).
        position_bias: mean s(a,b) + s(b,a) of the judged comparisons, when both orders were scored.
        mean_margin: mean |p - 0.5| of the comparisons the judge answered (the judge's signal: 0 when
            it cannot tell the completions apart, whatever the rewards' scale).
        order_agreement: share of the comparisons judged in both orders whose two orders name the same
            winner (NaN when none was judged in both orders).
    """

    rewards: list[list[float | None]]
    comparisons: list[int]
    failed: list[int]
    judge_calls: int = 0
    mean_p: float = float("nan")
    position_bias: float = float("nan")
    mean_margin: float = float("nan")
    order_agreement: float = float("nan")
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """How pairwise judgements become one reward per completion (see the module docstring): the
    ``rewards:`` section of ``judgeloop train`` (read under ``loss.type: grpo``), of
    ``recipes/grpo_trl.py`` and of ``judgeloop serve-judge`` (a request may name its own).
    ``probability: raw`` aggregates sigmoid(raw logit) instead of the calibrated p.

    Every value is checked when the config is built, in Python as from a config file (the same one-line
    messages, :func:`judgeloop.config.check_fields`): ``RewardConfig(prior=float("inf"))`` would give NaN
    rewards and a prior below ``1e-9`` a singular Bradley-Terry fit (Newton's Hessian is then the
    comparisons' alone, which has the all-equal strengths in its null space), so both are refused.

    Raises:
        ValueError: a scheme, aggregate or probability that is not one, an ``m`` or prior of the wrong
            type, not finite or out of range (one line naming the value and the fix).
    """

    scheme: Scheme = "round_robin"
    aggregate: Aggregate = "win_rate"
    m: int = bounded(2, ge=1, hint=" (round_robin compares each completion with the next m; e.g. 2)")
    prior: float = bounded(0.1, ge=MIN_PRIOR, hint=" (the Bradley-Terry prior precision; e.g. 0.1)")
    probability: Probability = "calibrated"

    def __post_init__(self) -> None:
        check_fields("rewards", self)
        check_fields("rewards", self)


# the keyword spelling of the settings before 0.2.0 (JudgeReward, score_groups, group_rewards), whose
# scheme defaulted to all_pairs; accepted until 0.3.0 with a DeprecationWarning naming RewardConfig
OLD_KEYWORDS = ("scheme", "aggregate", "m", "prior", "probability")


def checked_reward_config(
    rewards: RewardConfig | None, old: dict[str, Any], call: str, stacklevel: int = 3
) -> RewardConfig:
    """The settings of a call of ``call`` (e.g. ``"JudgeReward(judge, ...)"``): ``rewards``, its defaults
    when None, or a :class:`RewardConfig` built from the keywords spelled before 0.2.0 (``scheme=...,
    aggregate=...``, with that spelling's default ``scheme='all_pairs'``) and a ``DeprecationWarning`` that
    names the new spelling with the same values. ``stacklevel``: where the warning points, counted from the
    caller of this function (3: the line that called the public function that called it).

    Raises:
        TypeError: a keyword that is neither, the settings given both ways, or ``rewards`` not a
            :class:`RewardConfig` (each naming the new spelling).
    """
    name = call.split("(")[0]
    unknown = [k for k in old if k not in OLD_KEYWORDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OLD_KEYWORDS, n=1)
        hint = f"; did you mean RewardConfig({close[0]}=...)?" if close else ""
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    if old:
        if rewards is not None:
            raise TypeError(
                f"{name}: rewards={rewards!r} and {sorted(old)}; give the settings once, as rewards=RewardConfig(...)"
            )
        values = {"scheme": "all_pairs", **old}
        config = RewardConfig(**values)
        new = ", ".join(f"{k}={values[k]!r}" for k in OLD_KEYWORDS if k in values)
        given = ", ".join(f"{k}=..." for k in old)
        warn_renamed(
            call.replace("...", given), call.replace("...", f"RewardConfig({new})"), stacklevel=stacklevel
        )
        return config
    if rewards is None:
        return RewardConfig()
    if not isinstance(rewards, RewardConfig):
        raise TypeError(
            f"{name}: rewards={rewards!r}; pass a judgeloop.rewards.RewardConfig, e.g. "
            "RewardConfig(scheme='all_pairs')"
        )
    return rewards


def check_scheme(scheme: str, aggregate: str, m: int, prior: float) -> None:
    """Deprecated since 0.2.0 (goes in 0.3.0): ``RewardConfig(scheme=..., aggregate=..., m=..., prior=...)``
    checks the settings when it is built."""
    warn_renamed(
        "judgeloop.rewards.check_scheme(scheme, aggregate, m, prior)",
        "RewardConfig(scheme=scheme, aggregate=aggregate, m=m, prior=prior) (it checks them when built)",
    )
    RewardConfig(scheme=scheme, aggregate=aggregate, m=m, prior=prior)  # type: ignore[arg-type]


def _canonical(texts: Sequence[str]) -> list[str]:
    """The distinct texts in an order that depends only on their content."""
    return sorted(set(texts), key=lambda t: (hashlib.sha256(t.encode()).hexdigest(), t))


def design(n: int, scheme: str, m: int = 2) -> list[tuple[int, int]]:
    """The comparisons ``(i, j)`` of ``n`` distinct completions (``j == ANCHOR`` for the anchor)."""
    if scheme == "anchor":
        return [(i, ANCHOR) for i in range(n)]
    if scheme == "all_pairs":
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    pairs: set[tuple[int, int]] = set()  # round robin: each against the next m, around the circle
    for i in range(n):
        for step in range(1, min(m, n - 1) + 1):
            j = (i + step) % n
            pairs.add((min(i, j), max(i, j)))
    return sorted(pairs)


def bradley_terry(
    n: int, comparisons: Sequence[tuple[int, int]], p: Sequence[float], prior: float = 0.1
) -> np.ndarray:
    """MAP Bradley-Terry strengths of ``n`` items from soft outcomes: ``p[c]`` is the probability that
    item ``i`` beats item ``j`` in comparison ``c = (i, j)``. Maximizes
    ``sum_c p log sigmoid(t_i - t_j) + (1 - p) log sigmoid(t_j - t_i) - prior / 2 * |t|^2`` by Newton's
    method (strictly concave: one optimum). The likelihood is shift-invariant, so at the optimum the
    strengths sum to 0."""
    theta = np.zeros(n)
    if not comparisons:
        return theta
    idx_i = np.array([c[0] for c in comparisons])
    idx_j = np.array([c[1] for c in comparisons])
    target = np.asarray(p, dtype=float)
    for _ in range(100):
        q = expit(theta[idx_i] - theta[idx_j])
        r = target - q  # d loglik / d (t_i - t_j)
        grad = -prior * theta
        np.add.at(grad, idx_i, r)
        np.add.at(grad, idx_j, -r)
        w = q * (1 - q)
        hess = -prior * np.eye(n)
        np.add.at(hess, (idx_i, idx_i), -w)
        np.add.at(hess, (idx_j, idx_j), -w)
        np.add.at(hess, (idx_i, idx_j), w)
        np.add.at(hess, (idx_j, idx_i), w)
        step = np.linalg.solve(hess, grad)
        theta = theta - step
        if np.max(np.abs(step)) < 1e-12:
            break
    return theta


def _aggregate(
    n: int, pairs: list[tuple[int, int]], p: list[float], aggregate: str, prior: float, anchored: bool
) -> list[float | None]:
    """Rewards of ``n`` distinct completions from their valid comparisons (``p``: i beats j)."""
    seen = np.zeros(n, dtype=bool)
    for i, j in pairs:
        seen[i] = True
        if j != ANCHOR:
            seen[j] = True
    if aggregate == "win_rate":
        wins: list[list[float]] = [[] for _ in range(n)]
        for (i, j), pij in zip(pairs, p):
            wins[i].append(pij)
            if j != ANCHOR:
                wins[j].append(1.0 - pij)
        return [float(np.mean(w)) if w else None for w in wins]
    size = n + 1 if anchored else n  # the anchor is item n
    items = [(i, n if j == ANCHOR else j) for i, j in pairs]
    theta = bradley_terry(size, items, p, prior)
    if anchored:
        theta = theta[:n] - theta[n]
    return [float(theta[i]) if seen[i] else None for i in range(n)]


def is_empty(text: str) -> bool:
    """Whether a completion has no text to judge (nothing but whitespace)."""
    return not text.strip()


class EmptyLoses:
    """A judge whose comparisons with an empty side are answered without it: an empty text loses to a
    non-empty one (p = 0, raw logit -inf), two empty ones tie (p = 0.5); the rest go to ``judge`` in one
    call. ``pairwise`` and ``debiases`` are the judge's; ``empty`` counts the comparisons answered here."""

    def __init__(self, judge: Any):
        self.judge = judge
        self.pairwise, self.debiases = judge.pairwise, judge.debiases
        self.empty = 0

    def compare(self, prompts: Any, a: Any, b: Any, references: Any = None) -> Comparison:
        empty = [is_empty(x) or is_empty(y) for x, y in zip(a, b)]
        if not any(empty):
            return self.judge.compare(prompts, a, b, references)
        n = len(a)
        p, logit = np.full(n, np.nan), np.full(n, np.nan)
        status = ["ok"] * n  # an empty side decides the comparison: a valid outcome, not a judgement
        for i in (i for i in range(n) if empty[i]):
            ea, eb = is_empty(a[i]), is_empty(b[i])
            p[i] = 0.5 if ea == eb else (0.0 if ea else 1.0)
            logit[i] = 0.0 if ea == eb else (-np.inf if ea else np.inf)
        self.empty += sum(empty)
        keep = [i for i in range(n) if not empty[i]]
        if keep:
            refs = [references[i] for i in keep] if references is not None else None
            out = self.judge.compare(
                [prompts[i] for i in keep], [a[i] for i in keep], [b[i] for i in keep], refs
            )
            p[keep], logit[keep] = out.p, out.logit
            for i, st in zip(keep, out.status):
                status[i] = st
        return Comparison(p=p, logit=logit, status=status, forward=logit.copy())


def score_groups(
    judge: Any, groups: Sequence[Group], rewards: RewardConfig | None = None, **deprecated: Any
) -> GroupScores:
    """Rewards for every completion of every group, from one batched call of ``judge``'s
    :meth:`~judgeloop.judges.calibrated.CalibratedJudge.compare` (see the module docstring).

    Args:
        judge: what compares (``pairwise``, ``debiases``, ``compare``), e.g. a calibrated judge.
        groups: the prompts' groups of completions.
        rewards: the scheme, aggregate, ``m``, prior and probability (None: :class:`RewardConfig`'s
            defaults). ``probability="raw"`` aggregates sigmoid(raw logit) instead of the calibrated p: the
            rewards then differ from the calibrated ones only through the calibrator.
        deprecated: the settings as keywords (``scheme=..., aggregate=...``), the spelling before 0.2.0:
            accepted with a ``DeprecationWarning`` until 0.3.0 (:func:`checked_reward_config`).

    Returns:
        The rewards and what it took to get them (:class:`GroupScores`).

    Raises:
        ValueError: an ``anchor`` scheme and a group without an anchor.
        TypeError: ``rewards`` is not a :class:`RewardConfig`.
    """
    rewards = checked_reward_config(rewards, deprecated, "score_groups(judge, groups, ...)")
    scheme, aggregate, m, prior = rewards.scheme, rewards.aggregate, rewards.m, rewards.prior
    probability = rewards.probability
    plans = []  # per group: distinct texts, their comparisons, the batch rows of each
    sources: list[str] = []
    a: list[str] = []
    b: list[str] = []
    refs: list[tuple[str, ...]] = []
    both = judge.pairwise and not judge.debiases  # ask both orders ourselves
    for g in groups:
        if scheme == "anchor" and not g.anchor:
            raise ValueError(
                "scheme=anchor needs an anchor completion for every group (e.g. the dataset's reference "
                "summary); one group has none"
            )
        texts = _canonical(g.completions)
        plan: list[tuple[int, int, list[int] | None]] = []
        for i, j in design(len(texts), scheme, m):
            x, y = texts[i], g.anchor if j == ANCHOR else texts[j]
            assert y is not None
            if x == y:  # an identical text ties exactly, with no judge call
                plan.append((i, j, None))
                continue
            rows = []
            for first, second in [(x, y), (y, x)] if both else [(x, y)]:
                rows.append(len(a))
                sources.append(g.source)
                a.append(first)
                b.append(second)
                refs.append(g.references)
            plan.append((i, j, rows))
        plans.append((texts, plan))
    calls = 0
    if a:
        out = judge.compare(sources, a, b, refs)
        calls = 1
        prob = out.p if probability == "calibrated" else expit(out.logit)
        valid = out.valid & np.isfinite(prob)
    result = GroupScores(rewards=[], comparisons=[], failed=[], judge_calls=calls)
    all_p: list[float] = []
    margins: list[float] = []
    agree: list[bool] = []
    for g, (texts, plan) in zip(groups, plans):
        pairs, ps, failed = [], [], 0
        for i, j, judged in plan:
            if judged is None:
                pairs.append((i, j))
                ps.append(0.5)
                continue
            if not all(valid[r] for r in judged):
                failed += 1
                continue
            p_first = float(prob[judged[0]])
            pij = p_first if len(judged) == 1 else 0.5 * (p_first + 1.0 - float(prob[judged[1]]))
            if all(np.isfinite(out.logit[r]) for r in judged):  # answered by the judge, not an empty side
                margins.append(abs(pij - 0.5))
                if len(judged) == 2:
                    agree.append((p_first > 0.5) == (float(prob[judged[1]]) < 0.5))
            pairs.append((i, j))
            ps.append(pij)
        all_p += ps
        by_text = dict(zip(texts, _aggregate(len(texts), pairs, ps, aggregate, prior, scheme == "anchor")))
        if len(texts) == 1 < len(g.completions) and scheme != "anchor":  # all identical: an exact tie
            by_text[texts[0]] = 0.5 if aggregate == "win_rate" else 0.0
        result.rewards.append([by_text[c] for c in g.completions])
        result.comparisons.append(len(plan))
        result.failed.append(failed)
    if a:
        result.statuses = {s: out.status.count(s) for s in sorted(set(out.status))}
        result.position_bias = _position_bias(out, both)
    result.mean_p = float(np.mean(all_p)) if all_p else float("nan")
    result.mean_margin = float(np.mean(margins)) if margins else float("nan")
    if a and not both and out.reverse is not None:  # the judge scored both orders itself
        ok = out.valid & np.isfinite(out.forward) & np.isfinite(out.reverse)
        agree = list((out.forward[ok] > 0) == (out.reverse[ok] < 0))
    result.order_agreement = float(np.mean(agree)) if agree else float("nan")
    return result


def _position_bias(out: Any, both: bool) -> float:
    """s(a,b) + s(b,a), averaged: from the judge's own two orders, or from the two rows we asked."""
    if not both:
        return out.position_bias()
    ok = out.valid
    fwd, rev = out.logit[0::2], out.logit[1::2]
    keep = ok[0::2] & ok[1::2] & np.isfinite(fwd) & np.isfinite(rev)  # not an empty side's +-inf
    return float(np.mean(fwd[keep] + rev[keep])) if keep.any() else float("nan")


def group_rewards(
    judge: Any,
    prompt: str,
    completions: Sequence[str],
    rewards: RewardConfig | None = None,
    anchor: str | None = None,
    references: Sequence[str] = (),
    **deprecated: Any,
) -> list[float | None]:
    """One reward per completion of one prompt's group (``prompt``: the source text the judge reads;
    ``rewards``: the settings, None for the defaults; the keywords ``scheme=..., aggregate=...`` are the
    deprecated spelling before 0.2.0, see :func:`checked_reward_config`); see the module docstring. Several groups
    at once: :func:`score_groups`."""
    rewards = checked_reward_config(rewards, deprecated, "group_rewards(judge, prompt, completions, ...)")
    group = Group(prompt, list(completions), anchor, tuple(references))
    return score_groups(judge, [group], rewards).rewards[0]


__all__ = [
    "AGGREGATES",
    "EmptyLoses",
    "SCHEMES",
    "Group",
    "GroupScores",
    "PROBABILITIES",
    "RewardConfig",
    "bradley_terry",
    "checked_reward_config",
    "design",
    "group_rewards",
    "is_empty",
    "score_groups",
]
