"""The judge server's verl route, ``POST /verl/reward``: one response in, its groupwise reward out.

verl's reward loop awaits :func:`judgeloop.integrations.verl.compute_score` once per response, from
several Ray workers at once; each call posts::

    POST /verl/reward   {"prompt": str, "completion": str, "anchor": str | null,
                         "group_size": int, "group_wait_s": float}
    200                 {"reward": float, "empty": bool, "group_size": int}

The route gathers the posts of one prompt (and anchor, with the ``anchor`` scheme) until ``group_size``
of them arrived, or ``group_wait_s`` passed since the first (a short group, e.g. an eval run with
another ``n``, is scored as it is instead of stalling), scores them as one group with the server's
``rewards.*`` (one judge call, merged with other requests') and answers each post with its own
response's reward. The group size travels with each request, so a training run and an eval run with
different ``n`` share one server. An empty completion loses to every non-empty one, unjudged
(:mod:`judgeloop.serving.groups`). A group of one (verl's validation with ``val_kwargs.n=1``) has no
other response to compare with, so it is judged against its anchor (the ``anchor`` scheme, whatever
``rewards.scheme`` is), and answered at once; without an anchor it is a 422 before any wait. A response
with no valid comparison (alone in a group closed short, a failed judgement) is a 422 with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from judgeloop.rewards import RewardConfig, is_empty
from judgeloop.serving.checks import ApiError, check_texts
from judgeloop.serving.config import ServeConfig
from judgeloop.serving.groups import PromptGroups

ROUTE = "/verl/reward"


class VerlRequest(BaseModel):
    """The body :func:`judgeloop.integrations.verl.compute_score` posts."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    completion: str
    anchor: str | None = None
    group_size: int
    group_wait_s: float = 30.0


class VerlGroups:
    """One :class:`PromptGroups` per (group size, wait), created on first use, sharing the batcher."""

    def __init__(self, batcher: Any, settings: RewardConfig):
        self.batcher, self.settings = batcher, settings
        self.by_shape: dict[tuple[int, float], PromptGroups] = {}
        self.posts = 0
        self.empty_completions = 0

    def groups_for(self, group_size: int, wait_s: float) -> PromptGroups:
        """A group of one is scored with the ``anchor`` scheme (its only comparison is the anchor)."""
        key = (group_size, wait_s)
        if key not in self.by_shape:
            settings = (
                dataclasses.replace(self.settings, scheme="anchor") if group_size == 1 else self.settings
            )
            self.by_shape[key] = PromptGroups(self.batcher, settings, group_size, wait_s, empty_loses=True)
        return self.by_shape[key]

    def stats(self) -> dict[str, int]:
        """What ``/v1/info`` reports under ``stats``."""
        shapes = self.by_shape.values()
        return {
            "verl_posts": self.posts,
            "verl_groups": sum(g.groups for g in shapes),
            "verl_partial_groups": sum(g.partial_groups for g in shapes),
            "verl_open_groups": sum(g.open_groups for g in shapes),
            "verl_empty_completions": self.empty_completions,
        }

    def drain(self) -> None:
        """Score every open group now (the server is stopping)."""
        for g in self.by_shape.values():
            g.drain()


def check_request(body: VerlRequest, anchored: bool) -> None:
    """422 for a group size below 1, a wait that is not positive, or a missing anchor (with the
    ``anchor`` scheme, or in a group of one)."""
    if body.group_size < 1:
        raise ApiError(
            422,
            f"group_size={body.group_size}; set reward_kwargs.group_size to actor_rollout_ref.rollout.n",
        )
    if not body.group_wait_s > 0:
        raise ApiError(422, f"group_wait_s={body.group_wait_s}; give a positive number of seconds")
    if body.group_size == 1 and body.anchor is None:
        raise ApiError(
            422,
            "group_size=1 (validation with val_kwargs.n=1): a response alone is judged against its anchor, "
            "and it has none; put the reference in the row's reward_model.ground_truth, or set "
            "reward_kwargs.val_group_size to val_kwargs.n > 1",
        )
    if anchored and body.anchor is None:
        raise ApiError(
            422,
            "rewards.scheme=anchor and the response has no anchor; put it in the row's "
            "reward_model.ground_truth",
        )


def verl_router(cfg: ServeConfig, verl_groups: VerlGroups) -> APIRouter:
    """The FastAPI router of ``POST /verl/reward`` (see the module docstring)."""
    router = APIRouter()
    anchored = cfg.rewards.scheme == "anchor"

    @router.post(ROUTE)
    async def reward(body: VerlRequest) -> dict[str, Any]:
        check_request(body, anchored)
        by_anchor = anchored or body.group_size == 1
        completion = "" if is_empty(body.completion) else body.completion  # empties tie exactly
        check_texts(
            cfg, 1, [("completion", completion)] + ([("anchor", body.anchor)] if body.anchor else []), True
        )
        check_texts(
            cfg, 1, [("prompt", body.prompt)] + ([("anchor", body.anchor or "")] if by_anchor else [])
        )
        verl_groups.posts += 1
        verl_groups.empty_completions += int(completion == "")
        groups = verl_groups.groups_for(body.group_size, body.group_wait_s)
        value = await groups.reward(body.prompt, completion, body.anchor if by_anchor else None)
        if value is None:
            raise ApiError(
                422,
                "the response has no valid comparison (its group closed with it alone after group_wait_s, or "
                "the judge failed on it); set reward_kwargs.group_size to actor_rollout_ref.rollout.n",
            )
        return {"reward": float(value), "empty": completion == "", "group_size": body.group_size}

    return router


__all__ = ["ROUTE", "VerlGroups", "VerlRequest", "verl_router"]
