"""The retrieval agent's loop: per question a state, a menu of actions, hard limits, and a replayable trace.

An episode starts from the question alone and asks its policy for one action at a time until the policy
answers or refuses:

* evidence actions: ``dense``, ``bm25`` (the question as it is), ``fuse`` (both retrievers: the window is
  their reciprocal rank fusion, :func:`judgeloop.retrieval.escalation.rrf_fuse`), ``rewrite`` (the LM's
  search terms appended to the question, :func:`~judgeloop.retrieval.escalation.expand_query`),
  ``hyde`` (the LM writes a hypothetical answer passage, retrieved with densely: Gao et al. 2022,
  "Precise Zero-Shot Dense Retrieval without Relevance Labels"), ``decompose`` (the LM splits the question
  into at most two sub-questions, the open sub-goals, each retrieved densely);
* terminal actions: ``answer`` (the reader with the window: the top ``answer_k`` of the fusion of every
  ranking gathered so far) and ``refuse``.

Every evidence action is a list of probes ``(retriever, query)``; a probe whose query has the content terms
of an earlier probe on the same retriever (:func:`query_key`) is a *repeated query*: it is caught and not
run, and an action whose probes are all repeats adds nothing (its step says so). The limits
(:class:`Budget`) are checked before each action against its exact upper bound (the prompt's tokens plus
``max_new_tokens`` for an LM call), so the token and round limits are never exceeded; the wall-time limit
is checked before each action (an action started under it finishes). An action the budget forbids is not
offered to the policy; with no evidence action left it must answer or refuse, and an answer that no longer
fits the token budget is not offered either.

The trace (:meth:`AgentState.trace`) holds per step the action, its probes, the candidates with scores,
the signals the policy saw, the decision and its reason, and the budget used; :func:`replay` runs the same
actions again and must reach the same answer (the LM outputs are cached, the retrievers exact).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from judgeloop.retrieval.escalation import expand_query, rrf_fuse
from judgeloop.retrieval.gate import content_terms

__all__ = [
    "ACTIONS",
    "EVIDENCE_ACTIONS",
    "LM_ACTIONS",
    "AgentState",
    "Budget",
    "LMOutput",
    "Policy",
    "ScriptedPolicy",
    "Toolbox",
    "query_key",
    "replay",
    "run_episode",
]

EVIDENCE_ACTIONS = ("dense", "bm25", "fuse", "rewrite", "hyde", "decompose")
LM_ACTIONS = ("rewrite", "hyde", "decompose")
ACTIONS = (*EVIDENCE_ACTIONS, "answer", "refuse")


@dataclass
class LMOutput:
    """One language-model call: the text, its tokens (prompt + generated), its measured seconds and the
    mean log-probability of the answer tokens (NaN when none)."""

    text: str
    tokens: int
    seconds: float
    logprob_mean: float = float("nan")


class Toolbox(Protocol):
    """What the loop acts with: the retrievers, the language model and the reader."""

    def retrieve(self, retriever: str, query: str, depth: int) -> tuple[list[int], list[float]]:
        """Corpus indices and scores, best first (``retriever``: ``dense`` or ``bm25``)."""
        ...

    def generate(self, action: str, question: str) -> LMOutput:
        """The LM's output for ``rewrite`` / ``hyde`` / ``decompose`` of ``question``."""
        ...

    def lm_bound(self, action: str, question: str, passages: Sequence[int] = ()) -> int:
        """The most tokens ``action`` (an LM action or ``answer`` with ``passages``) can cost."""
        ...

    def answer(self, question: str, passages: Sequence[int]) -> LMOutput:
        """The reader's answer to ``question`` with the corpus passages ``passages``."""
        ...

    def doc_id(self, index: int) -> str:
        """The id of corpus document ``index``."""
        ...


@dataclass
class Budget:
    """Hard limits per question: evidence rounds, LM tokens (prompt + generated), wall seconds (None: none)."""

    max_rounds: int = 3
    max_tokens: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds={self.max_rounds} must be >= 1 (the first retrieval is a round)")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 0 or null (no limit)")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds={self.max_seconds} must be > 0 or null (no limit)")

    def fits(self, state: AgentState, tokens: int) -> bool:
        """Whether ``tokens`` more fit the token limit."""
        return self.max_tokens is None or state.tokens + tokens <= self.max_tokens


_SPACE = re.compile(r"\s+")


def query_key(retriever: str, query: str) -> tuple[str, frozenset[str] | str]:
    """What makes two probes the same: the retriever and the query's content terms (the lower-cased text
    when it has none). A rewrite that only reorders or repeats the question's words is a repeat."""
    terms = content_terms(query)
    return retriever, (frozenset(terms) if terms else _SPACE.sub(" ", query.lower()).strip())


@dataclass
class Evidence:
    """A retrieved document with its provenance: the query that found it, the action, the round, its rank."""

    doc: int
    doc_id: str
    retriever: str
    query: str
    action: str
    round: int
    rank: int
    score: float


@dataclass
class Step:
    """One decision of the loop (a row of the trace)."""

    round: int
    action: str
    signals: dict[str, float] = field(default_factory=dict)
    offered: list[str] = field(default_factory=list)
    lm_text: str | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)  # retriever, query, repeated, candidates
    decision: str = "continue"  # continue | stop
    reason: str = ""
    budget: dict[str, float] = field(default_factory=dict)


@dataclass
class AgentState:
    """Everything an episode knows: the question, the evidence with provenance, the sub-goals, the actions
    taken, the rankings gathered, the budget used and the outcome."""

    question: str
    answer_k: int = 2
    depth: int = 10
    evidence: list[Evidence] = field(default_factory=list)
    rankings: list[list[int]] = field(default_factory=list)
    subgoals: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    seen: set[tuple[str, Any]] = field(default_factory=set)
    drafts: dict[tuple[int, ...], LMOutput] = field(default_factory=dict)
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    retrievals: int = 0
    lm_calls: int = 0
    repeats: int = 0
    answer: str | None = None
    answer_logprob: float = float("nan")
    refused: bool = False
    stop_reason: str = ""

    @property
    def actions(self) -> list[str]:
        return [s.action for s in self.steps]

    def window(self, k: int | None = None) -> list[int]:
        """The top ``k`` (default ``answer_k``) of the reciprocal rank fusion of every ranking so far."""
        if not self.rankings:
            return []
        return rrf_fuse(self.rankings, depth=self.answer_k if k is None else k)

    def used(self) -> dict[str, float]:
        return {
            "rounds": self.rounds,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "retrievals": self.retrievals,
            "lm_calls": self.lm_calls,
        }

    def charge(self, out: LMOutput) -> None:
        self.tokens += out.tokens
        self.seconds += out.seconds
        self.lm_calls += int(out.tokens > 0)  # an evidence-only answer (BEIR) calls no model

    def trace(self) -> dict[str, Any]:
        """The replayable record of the episode (JSON-ready); each probe's candidates carry the evidence's
        provenance (retriever, query, action, round, rank, score)."""
        return {
            "question": self.question,
            "actions": self.actions,
            "steps": [asdict(s) for s in self.steps],
            "subgoals": self.subgoals,
            "window": self.window(),
            "answer": self.answer,
            "refused": self.refused,
            "stop_reason": self.stop_reason,
            "used": self.used(),
            "repeats": self.repeats,
        }


class Policy(Protocol):
    """Chooses the next action among those offered, from the state and the signals observed on it."""

    name: str

    def choose(self, state: AgentState, signals: Mapping[str, float], offered: Sequence[str]) -> str: ...


Observer = Callable[[AgentState, "Toolbox", Budget], dict[str, float]]


def draft_answer(state: AgentState, toolbox: Toolbox, budget: Budget) -> LMOutput | None:
    """The reader's answer at the current window, charged once per window (the final answer reuses it);
    None when it does not fit the token budget."""
    win = tuple(state.window())
    if win in state.drafts:
        return state.drafts[win]
    if not budget.fits(state, toolbox.lm_bound("answer", state.question, win)):
        return None
    out = toolbox.answer(state.question, win)
    state.charge(out)
    state.drafts[win] = out
    return out


def _offered(state: AgentState, toolbox: Toolbox, budget: Budget, menu: Sequence[str]) -> list[str]:
    """The actions the budget allows now; evidence actions not taken before."""
    out: list[str] = []
    time_left = budget.max_seconds is None or state.seconds < budget.max_seconds
    taken = set(state.actions)
    if state.rounds < budget.max_rounds and time_left:
        for a in menu:
            if a in EVIDENCE_ACTIONS and a not in taken:
                if a in LM_ACTIONS and not budget.fits(state, toolbox.lm_bound(a, state.question)):
                    continue
                out.append(a)
    win = tuple(state.window())
    if win in state.drafts or budget.fits(state, toolbox.lm_bound("answer", state.question, win)):
        out.append("answer")
    out.append("refuse")
    return out


def _probes(action: str, state: AgentState, toolbox: Toolbox, step: Step) -> list[tuple[str, str]]:
    """The (retriever, query) probes of an evidence action; LM actions call the model (charged)."""
    q = state.question
    if action in ("dense", "bm25"):
        return [(action, q)]
    if action == "fuse":
        return [("dense", q), ("bm25", q)]
    out = toolbox.generate(action, q)
    state.charge(out)
    step.lm_text = out.text
    if action == "rewrite":
        return [("dense", expand_query(q, out.text))]
    if action == "hyde":
        text = out.text.strip()
        return [("dense", text if text else q)]
    subs = [s.strip(" -*0123456789.)\t") for s in out.text.split("\n")]
    subs = [s for s in subs if s][:2]
    state.subgoals.extend(subs)
    return [("dense", s) for s in subs] or [("dense", q)]


def _gather(action: str, state: AgentState, toolbox: Toolbox, step: Step) -> None:
    """Run an evidence action's new probes and record what they found (with provenance)."""
    state.rounds += 1
    for retriever, query in _probes(action, state, toolbox, step):
        key = query_key(retriever, query)
        entry: dict[str, Any] = {"retriever": retriever, "query": query, "repeated": key in state.seen}
        if key in state.seen:
            state.repeats += 1
            step.probes.append(entry)
            continue
        state.seen.add(key)
        idx, scores = toolbox.retrieve(retriever, query, state.depth)
        state.retrievals += 1
        state.rankings.append([int(i) for i in idx])
        entry["candidates"] = [[toolbox.doc_id(i), round(float(s), 4)] for i, s in zip(idx, scores)]
        step.probes.append(entry)
        for r, (i, s) in enumerate(zip(idx, scores)):
            state.evidence.append(
                Evidence(int(i), toolbox.doc_id(i), retriever, query, action, state.rounds, r, float(s))
            )
    if step.probes and all(p["repeated"] for p in step.probes):
        step.reason = "repeated query: every probe was run before; nothing new retrieved"


def run_episode(
    question: str,
    toolbox: Toolbox,
    policy: Policy,
    budget: Budget,
    observe: Observer | None = None,
    menu: Sequence[str] = EVIDENCE_ACTIONS,
    answer_k: int = 2,
    depth: int = 10,
) -> AgentState:
    """Run one question through the loop until the policy answers or refuses.

    Args:
        question: the question (or claim).
        toolbox: retrievers, LM and reader (:class:`Toolbox`).
        policy: chooses each action among those offered.
        budget: the hard limits (:class:`Budget`).
        observe: ``observe(state, toolbox, budget) -> signals`` before each decision (may draft an answer
            through :func:`draft_answer`, charged to the budget); None: no signals.
        menu: the evidence actions this run may offer.
        answer_k: passages the reader gets (the window).
        depth: candidates each probe keeps.

    Returns:
        The final :class:`AgentState` (``trace()`` is its record).
    """
    unknown = [a for a in menu if a not in EVIDENCE_ACTIONS]
    if unknown:
        raise ValueError(f"unknown agent action(s) {unknown}; choose from {list(EVIDENCE_ACTIONS)}")
    state = AgentState(question, answer_k=answer_k, depth=depth)
    while True:
        signals = observe(state, toolbox, budget) if observe is not None else {}
        offered = _offered(state, toolbox, budget, menu)
        action = policy.choose(state, signals, offered)
        if action not in offered:
            raise ValueError(f"policy {policy.name!r} chose {action!r}, which is not offered ({offered})")
        step = Step(state.rounds, action, dict(signals), list(offered))
        state.steps.append(step)
        if action == "answer":
            out = draft_answer(state, toolbox, budget)
            assert out is not None  # offered only when it fits
            state.answer, state.answer_logprob = out.text, out.logprob_mean
            step.decision, step.reason = "stop", step.reason or "policy answered"
        elif action == "refuse":
            state.refused = True
            step.decision = "stop"
            step.reason = "policy refused" + ("" if len(offered) > 2 else " (budget spent)")
        else:
            _gather(action, state, toolbox, step)
        step.budget = state.used()
        if step.decision == "stop":
            state.stop_reason = step.reason
            return state


class ScriptedPolicy:
    """Takes the given actions in order (skipping any not offered), then answers (or refuses when
    answering is not offered): the fixed policies' backbone and :func:`replay`."""

    def __init__(self, actions: Sequence[str], name: str = "scripted") -> None:
        self.actions = list(actions)
        self.name = name

    def choose(self, state: AgentState, signals: Mapping[str, float], offered: Sequence[str]) -> str:
        done = len(state.steps)
        for a in self.actions[done:]:
            if a in offered:
                return a
            if a in ("answer", "refuse"):
                break
        return "answer" if "answer" in offered else "refuse"


def replay(trace: Mapping[str, Any], toolbox: Toolbox, budget: Budget, **kwargs: Any) -> AgentState:
    """Run a trace's actions again (same toolbox, same budget): the same evidence and the same answer."""
    return run_episode(
        trace["question"], toolbox, ScriptedPolicy(trace["actions"], "replay"), budget, **kwargs
    )
