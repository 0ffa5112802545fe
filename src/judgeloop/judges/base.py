"""The judge interface: a batch of (article, summary_a, summary_b) -> raw preference logits.

``s > 0`` means the judge prefers ``a``. Every item carries a status (``ok``, ``truncated``,
``empty_summary``, ``nonfinite``, ``too_long``; the served judge adds its own, judges/served.py); only
items of a valid status (``VALID_STATUSES``) have a finite score. A failure is never turned into data:
an empty summary, a NaN/inf logit or an input that cannot fit is reported as such with ``score = nan``,
never scored as "b wins".

Two kinds of judge build on :class:`Judge`:

* pairwise judges (``choice``) see both summaries at once and implement :meth:`Judge._score_ordered`;
  they can have a position bias, which :func:`combine_orders` cancels;
* pointwise judges (``likelihood``, ``reward_model``, ``embedding``) give each summary a value
  ``v(article, summary)`` and score ``s = v(a) - v(b)`` (:class:`PointwiseJudge`). Values are cached
  per summary, so ``s(a, b) = -s(b, a)`` holds exactly, not just up to padding noise.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from judgeloop.hashing import texts_digest

# scored statuses, weakest last; the served judge's ``low_label_mass`` (a verdict the model gave little of its
# probability), ``outside_topk`` (a bound) and ``text_only`` (a hard label) are scored too, so calibration sees
# and counts them (judges/served.py)
VALID_STATUSES = ("ok", "truncated", "low_label_mass", "outside_topk", "text_only")


@dataclass
class Pair:
    """One judging item. ``references`` are only read by judges that compare to references."""

    article: str
    a: str
    b: str
    references: tuple[str, ...] = ()

    def swapped(self) -> Pair:
        return Pair(self.article, self.b, self.a, self.references)


@dataclass
class JudgeOutput:
    """Raw preference logits for a batch, with per-item status.

    Attributes:
        scores: (N,) float array, ``nan`` where the status is not valid.
        status: N status strings.
        forward: (N,) scores of the (a, b) order alone (before debiasing); equals ``scores`` when
            position debiasing is off.
        reverse: (N,) scores of the (b, a) order, or ``None`` when not computed.
        members: a panel's members: name -> (N,) calibrated P(a better than b) of that member (empty for
            a single judge).
    """

    scores: np.ndarray
    status: list[str]
    forward: np.ndarray
    reverse: np.ndarray | None = None
    members: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def valid(self) -> np.ndarray:
        return np.array([s in VALID_STATUSES for s in self.status], dtype=bool)

    def status_counts(self) -> dict[str, int]:
        return dict(Counter(self.status))

    def position_bias(self) -> float:
        """Mean of s(a,b) + s(b,a) over valid items (0 for an order-invariant judge).

        Positive means the judge favours whichever summary is shown first; ``nan`` when the
        reverse order was not scored (position debiasing off) or no item is valid.
        """
        if self.reverse is None:
            return float("nan")
        ok = self.valid & np.isfinite(self.forward) & np.isfinite(self.reverse)
        return float(np.mean(self.forward[ok] + self.reverse[ok])) if ok.any() else float("nan")

    @property
    def spread(self) -> np.ndarray:
        """(N,) disagreement of a panel's members: the standard deviation of their calibrated p per pair
        (0 when they agree exactly; ``nan`` for a single judge or where a member failed)."""
        if not self.members:
            return np.full(len(self.status), np.nan)
        return np.std(np.stack(list(self.members.values())), axis=0)


@dataclass
class JudgeStats:
    """Running counts a judge reports: statuses, cache hits, truncations.

    ``cache_hits`` / ``cache_misses`` count the in-memory cache of judged pairs; ``stored_hits`` /
    ``stored_misses`` the judgements read from (or not found in) a cache kept across runs, where the judge
    has one (the served judge's ``judge.server.cache_path``: one per prompt sent, both orders counted);
    ``label_mass`` the served judge's label mass of each reply that gives it (``served_client.label_mass``)."""

    status: Counter = field(default_factory=Counter)
    cache_hits: int = 0
    cache_misses: int = 0
    stored_hits: int = 0
    stored_misses: int = 0
    label_mass: list[float] = field(
        default_factory=list
    )  # served judges: each reply's label mass, where read

    def label_mass_summary(self) -> dict[str, float]:
        """The label masses' count, min, quartiles and mean (what a report shows of them)."""
        m = np.asarray(self.label_mass, dtype=float)
        q = np.quantile(m, [0.25, 0.5, 0.75])
        return {
            "n": int(m.size),
            "min": float(m.min()),
            "q25": float(q[0]),
            "median": float(q[1]),
            "q75": float(q[2]),
            "mean": float(m.mean()),
        }


def combine_orders(forward: np.ndarray, reverse: np.ndarray) -> np.ndarray:
    """Position debiasing: s = (s(a,b) - s(b,a)) / 2 cancels any additive order bias.

    If the judge adds ``c`` to whichever summary is shown first, ``s(a,b) = t + c`` and
    ``s(b,a) = -t + c``, so the combination returns ``t`` and ``s(a,b) + s(b,a) = 2c``.
    """
    return (forward - reverse) / 2.0


def merge_status(first: str, second: str) -> str:
    """Status of an item built from two parts: the first failure wins, else the weaker of two scored
    statuses (``text_only`` over ``outside_topk`` over ``truncated`` over ``ok``)."""
    if first not in VALID_STATUSES:
        return first
    if second not in VALID_STATUSES:
        return second
    return max(first, second, key=VALID_STATUSES.index)


class Judge:
    """Base class. Subclasses implement :meth:`_score_ordered` for one order of a batch.

    Args:
        name: identifies the judge in cache keys and reports.
        position_debias: score both orders and combine with :func:`combine_orders`.
        batch_size: items per model call.
        cache_size: in-memory cache entries keyed by (judge name, article, a, b, references);
            0 disables it.
    """

    def __init__(
        self, name: str, position_debias: bool = False, batch_size: int = 8, cache_size: int = 100_000
    ):
        if batch_size < 1:
            raise ValueError(f"judge batch_size={batch_size}; it must be at least 1")
        if cache_size < 0:
            raise ValueError(f"judge cache_size={cache_size}; use 0 to disable the cache or a positive size")
        self.name = name
        self.position_debias = position_debias
        self.batch_size = batch_size
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.stats = JudgeStats()
        # one caller at a time: the training loop may run :meth:`prepare` on a background thread
        self._lock = threading.RLock()

    # --- to implement -------------------------------------------------------------------------
    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        """Raw logit per pair for the order given (positive = ``a``), and a status per pair."""
        raise NotImplementedError

    def _prepare(self, articles: Sequence[str], references: Sequence[tuple[str, ...]]) -> None:
        """Precompute (and cache) the summary-independent work for these articles. Default: nothing."""

    @property
    def can_prepare(self) -> bool:
        """True when :meth:`prepare` does real work (a subclass overrides :meth:`_prepare`)."""
        return type(self)._prepare is not Judge._prepare

    def prepare(self, articles: Sequence[str], references: Sequence[Sequence[str]] | None = None) -> None:
        """Do ahead of time what a later :meth:`score` on these articles would do whatever the summaries:
        an embedding judge embeds the articles (or references). Scores are unchanged; only the work
        moves, so a training loop can run it on a background thread while the policy updates.
        Thread-safe against :meth:`score`.
        """
        refs = [tuple(r) for r in references] if references is not None else [()] * len(articles)
        if len(refs) != len(articles):
            raise ValueError(f"prepare got {len(refs)} reference lists for {len(articles)} articles")
        with self._lock:
            self._prepare(articles, refs)

    # --- judges that learn from labeled pairs ---------------------------------------------------
    @property
    def learns_from_labels(self) -> bool:
        """True for a judge that must see labeled pairs before it scores well (a panel fits its members'
        calibrators and its combination rule); callers fit it with :meth:`fit_labels` on a calibration
        split, never on the pairs it will then be evaluated on."""
        return False

    def fit_labels(self, pairs: Sequence[Pair], labels: Sequence[int]) -> None:
        """Fit what the judge learns from labeled pairs (label 1: ``a`` is the better summary).
        Default: nothing to learn."""

    def state_dict(self) -> dict[str, Any]:
        """What :meth:`fit_labels` learned, JSON-serializable (a checkpoint keeps it). Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> Judge:
        """Restore what :meth:`state_dict` returned. Default: nothing to restore."""
        return self

    # --- shared machinery ---------------------------------------------------------------------
    def _key(self, p: Pair) -> str:
        return texts_digest((self.name, p.article, p.a, p.b, *p.references))

    def _score_with_cache(self, pairs: Sequence[Pair]) -> tuple[np.ndarray, list[str]]:
        scores = np.full(len(pairs), np.nan)
        status: list[str] = [""] * len(pairs)
        todo: list[int] = []
        for i, p in enumerate(pairs):
            if not p.a.strip() or not p.b.strip():
                status[i] = "empty_summary"
                continue
            hit = self._cache.get(self._key(p)) if self.cache_size else None
            if hit is not None:
                scores[i], status[i] = hit
                self.stats.cache_hits += 1
            else:
                todo.append(i)
        for start in range(0, len(todo), self.batch_size):
            idx = todo[start : start + self.batch_size]
            batch = [pairs[i] for i in idx]
            vals, stats = self._score_ordered(batch)
            if len(vals) != len(batch) or len(stats) != len(batch):
                raise RuntimeError(
                    f"{type(self).__name__}._score_ordered returned {len(vals)} scores for {len(batch)} pairs"
                )
            for i, v, st in zip(idx, vals, stats):
                v = float(v)
                if st in VALID_STATUSES and not math.isfinite(v):
                    st = "nonfinite"
                if st not in VALID_STATUSES:
                    v = float("nan")
                scores[i], status[i] = v, st
                self.stats.cache_misses += 1
                if self.cache_size:
                    self._cache[self._key(pairs[i])] = (v, st)
                    if len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        return scores, status

    def score(self, pairs: Sequence[Pair]) -> JudgeOutput:
        """Score a batch of pairs (both orders when ``position_debias``).

        Args:
            pairs: items to judge; ``references`` only matter to reference-based judges.

        Returns:
            :class:`JudgeOutput` with ``scores`` (positive = ``a`` preferred), per-item ``status``,
            and the per-order scores ``forward`` / ``reverse``.
        """
        with self._lock:
            return self._score(list(pairs))

    def _score(self, pairs: list[Pair]) -> JudgeOutput:
        if not self.position_debias:
            forward, st_f = self._score_with_cache(pairs)
            out = JudgeOutput(scores=forward.copy(), status=st_f, forward=forward)
        else:
            # both orders of a chunk back to back, so judges that reuse per-article work (the choice
            # judge's prompt-prefix cache) find it still warm
            forward, reverse = np.full(len(pairs), np.nan), np.full(len(pairs), np.nan)
            st_f, st_r = [""] * len(pairs), [""] * len(pairs)
            for start in range(0, len(pairs), self.batch_size):
                chunk = pairs[start : start + self.batch_size]
                end = start + len(chunk)
                forward[start:end], st_f[start:end] = self._score_with_cache(chunk)
                reverse[start:end], st_r[start:end] = self._score_with_cache([p.swapped() for p in chunk])
            status = [merge_status(a, b) for a, b in zip(st_f, st_r)]
            scores = combine_orders(forward, reverse)
            scores[[s not in VALID_STATUSES for s in status]] = np.nan
            out = JudgeOutput(scores=scores, status=status, forward=forward, reverse=reverse)
        self.stats.status.update(out.status)
        return out

    def __call__(
        self,
        articles: Sequence[str],
        a: Sequence[str],
        b: Sequence[str],
        references: Sequence[Sequence[str]] | None = None,
    ) -> JudgeOutput:
        if not (len(articles) == len(a) == len(b)):
            raise ValueError(
                f"judge got {len(articles)} articles, {len(a)} a-summaries, {len(b)} b-summaries; lengths must match"
            )
        if references is None:
            references = [()] * len(articles)
        elif len(references) != len(articles):
            raise ValueError(
                f"judge got {len(references)} reference lists for {len(articles)} articles; lengths must match"
            )
        return self.score([Pair(x, y, z, tuple(r)) for x, y, z, r in zip(articles, a, b, references)])


class PointwiseJudge(Judge):
    """A judge that values each summary on its own: ``s(a, b) = v(a) - v(b)``.

    Subclasses implement :meth:`_value_points`. Values are cached per (article, summary,
    references), so a summary met in several pairs is scored once and antisymmetry is exact.
    Position debiasing is pointless here (the judge never sees an order) and off by default.
    """

    def __init__(
        self, name: str, position_debias: bool = False, batch_size: int = 8, cache_size: int = 100_000
    ):
        super().__init__(name, position_debias=position_debias, batch_size=batch_size, cache_size=cache_size)
        self._values: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def _value_points(
        self, points: Sequence[tuple[str, str, tuple[str, ...]]]
    ) -> tuple[list[float], list[str]]:
        """Value and status of each (article, summary, references) point."""
        raise NotImplementedError

    def _values_for(self, points: list[tuple[str, str, tuple[str, ...]]]) -> list[tuple[float, str]]:
        keys = [texts_digest((self.name, art, summ, *refs)) for art, summ, refs in points]
        todo: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        for key, point in zip(keys, points):
            if key not in self._values and key not in todo:
                todo[key] = point
        todo_keys = list(todo)
        for start in range(0, len(todo_keys), self.batch_size):
            chunk = todo_keys[start : start + self.batch_size]
            vals, stats = self._value_points([todo[k] for k in chunk])
            for key, v, st in zip(chunk, vals, stats):
                v = float(v)
                if st in VALID_STATUSES and not math.isfinite(v):
                    st = "nonfinite"
                self._values[key] = (v, st)
        result = [self._values[k] for k in keys]
        # bounded memory: keep the newest entries (never evict what this call just used)
        while self.cache_size and len(self._values) > max(self.cache_size, len(keys)):
            self._values.popitem(last=False)
        if not self.cache_size:
            self._values.clear()
        return result

    def _score_ordered(self, pairs: Sequence[Pair]) -> tuple[list[float], list[str]]:
        points = [(p.article, s, p.references) for p in pairs for s in (p.a, p.b)]
        values = self._values_for(points)
        scores, statuses = [], []
        for i in range(len(pairs)):
            (va, sa), (vb, sb) = values[2 * i], values[2 * i + 1]
            status = merge_status(sa, sb)
            scores.append(va - vb if status in VALID_STATUSES else float("nan"))
            statuses.append(status)
        return scores, statuses
