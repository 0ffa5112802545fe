"""OpenRLHF's remote reward model, served by judgeloop's judge server: ``POST /openrlhf/get_reward``.

The protocol, as OpenRLHF's own client sends it (``openrlhf/utils/agent.py``,
``SingleTurnAgentExecutor._fetch_rewards_via_http``, OpenRLHF 0.11; the same keys as the batched
``remote_rm_fn`` of ``openrlhf/utils/remote_rm_utils.py`` in earlier releases)::

    POST <--reward.remote_url>   {"query": [str], "prompts": [str], "labels": [str | null]}
    200                          {"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}

``query`` is the decoded prompt + response (``skip_special_tokens=False``), ``prompts`` the prompt as
given to the model and ``labels`` the dataset's ``--data.label_key`` column; the answer has one reward per
query, in order (what OpenRLHF's ``serve_rm.py`` returns). Every ``extra_logs`` value becomes a tensor
in the sample's info (``samples_generator.py``), so they are numbers, under the same keys in every answer.

The client calls ``raise_for_status()``: on any 4xx/5xx it logs only the status code, retries four more
times a second apart, then leaves the sample without a reward, and a batch with such a sample stops the
training run (``experience_maker.py``: no reward to concatenate). So this route answers 200 for a
policy's own bad output: an **empty completion** (nothing left after the prompt and the end-of-turn
tokens) is not sent to the judge; it loses each comparison with a non-empty completion (p = 0) and ties
another empty one, so it gets the group's lowest reward (0.0 with ``win_rate``; the lowest
Bradley-Terry strength), ``extra_logs.judge_empty`` is 1.0 for it (0.0 otherwise), and the server counts
it (``/v1/info``: ``stats.openrlhf_empty_completions``). What stays a 4xx is a request the trainer's
configuration or data makes unanswerable (an empty prompt or label, lists of different lengths, a
group of one): the server logs its one-line reason, since OpenRLHF's log shows only the code.

The completion is the query after its prompt, with trailing end-of-turn tokens removed
(``openrlhf.strip_suffixes``). OpenRLHF's executor posts each sample alone, so the completions of one
prompt are gathered across requests (``openrlhf.n_samples_per_prompt``, :class:`~judgeloop.serving.groups.
PromptGroups`) and scored as one group with the server's scheme (``rewards.*``); with the ``anchor``
scheme each completion is judged against its label. ``scores`` (OpenRLHF's dynamic-filtering value, in
[0, 1]) is the win rate for ``win_rate``, the reward passed through a sigmoid for ``bradley_terry``.
A sample whose group has no valid comparison (a group of one, a failed judgement) is answered 422 with
the reason, never a made-up reward.

Launch::

    judgeloop serve-judge --config configs/serve/judge.yaml judge_path=DIR openrlhf.n_samples_per_prompt=8
    python -m openrlhf.cli.train_ppo_ray ... --rollout.n_samples_per_prompt 8 \\
        --reward.remote_url http://127.0.0.1:8000/openrlhf/get_reward
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from judgeloop.rewards import Group, is_empty
from judgeloop.serving.checks import ApiError, check_texts
from judgeloop.serving.config import ServeConfig
from judgeloop.serving.groups import PromptGroups, served_group_scores

ROUTE = "/openrlhf/get_reward"


class OpenRLHFRequest(BaseModel):
    """The body OpenRLHF posts (other keys a later OpenRLHF adds are ignored)."""

    model_config = ConfigDict(extra="ignore")
    query: list[str]
    prompts: list[str]
    labels: list[str | None] | None = None


def completion_of(query: str, prompt: str, strip_suffixes: list[str]) -> str:
    """The response part of OpenRLHF's ``query`` (decoded prompt + response): the text after ``prompt``
    (or after the longest prefix they share, when the tokenizer's round trip changed the prompt), with
    trailing ``strip_suffixes`` removed."""
    start = len(prompt) if query.startswith(prompt) else len(os.path.commonprefix([query, prompt]))
    text = query[start:]
    stripped = True
    while stripped:
        stripped = False
        for suffix in strip_suffixes:
            if suffix and text.rstrip().endswith(suffix):
                text = text.rstrip()[: -len(suffix)]
                stripped = True
    return text


async def request_groups(
    prompt_groups: PromptGroups, sources: list[str], completions: list[str], anchors: list[str | None]
) -> list[float | None]:
    """Rewards of one request's queries, grouped by (source, anchor) and scored in one judge call (an
    empty completion loses, as in the module docstring)."""
    index: dict[tuple[str, str | None], int] = {}
    groups: list[Group] = []
    where: list[tuple[int, int]] = []
    for s, c, a in zip(sources, completions, anchors):
        if (s, a) not in index:
            index[(s, a)] = len(groups)
            groups.append(Group(s, [], a))
        g = index[(s, a)]
        where.append((g, len(groups[g].completions)))
        groups[g].completions.append(c)
    scores = await served_group_scores(prompt_groups.batcher, groups, prompt_groups.settings, True)
    return [scores.rewards[g][j] for g, j in where]


def _score(reward: float, aggregate: str) -> float:
    return reward if aggregate == "win_rate" else 1.0 / (1.0 + math.exp(-reward))


def openrlhf_router(cfg: ServeConfig, prompt_groups: PromptGroups) -> APIRouter:
    """The FastAPI router of ``POST /openrlhf/get_reward`` (see the module docstring)."""
    router = APIRouter()
    options = cfg.openrlhf
    anchored = cfg.rewards.scheme == "anchor"

    @router.post(ROUTE)
    async def get_reward(body: OpenRLHFRequest) -> dict[str, Any]:
        n = len(body.query)
        labels = body.labels if body.labels is not None else [None] * n
        if not (len(body.prompts) == n == len(labels)):
            raise ApiError(
                422,
                f"query has {n} entries, prompts {len(body.prompts)}, labels {len(labels)}; they must match",
            )
        completions = [completion_of(q, p, options.strip_suffixes) for q, p in zip(body.query, body.prompts)]
        completions = ["" if is_empty(c) else c for c in completions]  # empties tie with each other exactly
        sources = list(body.prompts) if options.source == "prompt" else [lab or "" for lab in labels]
        check_texts(cfg, n, [(f"query[{i}] (its completion)", c) for i, c in enumerate(completions)], True)
        texts = [
            (f"{'prompts' if options.source == 'prompt' else 'labels'}[{i}]", s)
            for i, s in enumerate(sources)
        ]
        if anchored:
            texts += [(f"labels[{i}] (the anchor)", lab or "") for i, lab in enumerate(labels)]
        check_texts(cfg, n, texts)
        # the limits cover every text sent, a label the judge does not read too
        check_texts(cfg, n, [(f"labels[{i}]", lab) for i, lab in enumerate(labels) if lab is not None], True)
        empty = [float(c == "") for c in completions]
        prompt_groups.empty_completions += int(sum(empty))
        anchors: list[str | None] = list(labels) if anchored else [None] * n
        if options.n_samples_per_prompt == 0:  # the request's own queries, grouped by prompt
            rewards = await request_groups(prompt_groups, sources, completions, anchors)
        else:
            rewards = await asyncio.gather(
                *(prompt_groups.reward(s, c, a) for s, c, a in zip(sources, completions, anchors))
            )
        missing = [i for i, r in enumerate(rewards) if r is None]
        if missing:
            raise ApiError(
                422,
                f"query[{missing[0]}] has no valid comparison (a group of one completion, or the judge failed on "
                "it); set openrlhf.n_samples_per_prompt to the trainer's --rollout.n_samples_per_prompt, or "
                "rewards.scheme=anchor with the label as the anchor",
            )
        values = [float(r) for r in rewards if r is not None]
        scores = [_score(r, cfg.rewards.aggregate) for r in values]
        return {
            "rewards": values,
            "scores": scores,
            "extra_logs": {"judge_reward": values, "judge_empty": empty},
        }

    return router


__all__ = ["ROUTE", "OpenRLHFRequest", "completion_of", "openrlhf_router"]
