"""verl's batch reward manager, scored by judgeloop's judge server: :func:`compute_score`.

verl's ``BatchRewardManager`` (``verl/workers/reward_manager/batch.py``) calls the custom reward
function once per batch, by keyword::

    compute_score(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=..., **reward_kwargs)

and reads back one score per response (a float, or a dict with ``"score"`` and extra logged values);
``reward_kwargs`` come from ``custom_reward_function.reward_kwargs`` (``verl/trainer/ppo/reward.py``,
``get_custom_reward_fn``). verl passes no prompt, so the text the judge reads each response against
comes from the row's ``extra_info[source_key]`` (put the article there when preparing the parquet),
and the responses of one prompt (GRPO's ``rollout.n``) are grouped by that text. With
``scheme="anchor"`` each response is judged against its ``ground_truth``. All groups of the batch go to
the server's ``/v1/rewards`` in one request (one judge call there, merged with other workers').

Launch::

    judgeloop serve-judge --config configs/serve/judge.yaml judge_path=DIR
    python -m verl.trainer.main_ppo ... reward_model.reward_manager=batch \\
        custom_reward_function.path=pkg://judgeloop.integrations.verl custom_reward_function.name=compute_score \\
        +custom_reward_function.reward_kwargs.server_url=http://127.0.0.1:8000

An empty response (the policy wrote nothing) is not judged: it loses each comparison with a non-empty
response of its group (the server's ``empty_completions: lose``), so it gets the group's lowest reward
(0.0 with ``win_rate``), and its ``judge_empty`` is 1. A response with no valid comparison (a group of
one, a judgement that failed) raises, and verl stops with the server's reason, rather than being scored
as anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any


def post_json(url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 600.0) -> Any:
    """POST ``body`` as JSON and return the decoded answer.

    Raises:
        RuntimeError: the server answered an error (its one-line reason) or could not be reached.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        reason = err.read().decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):
            reason = json.loads(reason).get("error", reason)
        raise RuntimeError(f"judge server {url} answered {err.code}: {reason}") from None
    except urllib.error.URLError as err:
        raise RuntimeError(
            f"judge server {url} cannot be reached ({err.reason}); start it with judgeloop serve-judge"
        ) from None


def compute_score(
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict[str, Any] | None],
    server_url: str = "http://127.0.0.1:8000",
    source_key: str = "article",
    scheme: str | None = None,
    aggregate: str | None = None,
    api_key_env: str = "",
    timeout: float = 600.0,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """verl batch reward function: groupwise calibrated rewards from a judgeloop judge server.

    Args:
        data_sources, solution_strs, ground_truths, extra_infos: what verl's batch reward manager passes,
            one per response.
        server_url: the judge server's address.
        source_key: the ``extra_info`` key holding the text the judge reads the responses against.
        scheme, aggregate: override the server's ``rewards.*`` (None: the server's).
        api_key_env: the environment variable holding the server's bearer token (empty: none).

    Returns:
        per response ``{"score": reward, "judge_comparisons": ..., "judge_empty": 0 or 1}`` (verl logs
        the extra keys).

    Raises:
        ValueError: a row lacks ``extra_info[source_key]``, or the inputs differ in length.
        RuntimeError: the server refused the batch or gave a response no reward.
    """
    n = len(solution_strs)
    if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
        raise ValueError(
            f"compute_score got {n} solution_strs, {len(data_sources)} data_sources, {len(ground_truths)} "
            f"ground_truths and {len(extra_infos)} extra_infos; verl passes one of each per response"
        )
    sources = []
    for i, info in enumerate(extra_infos):
        if not info or source_key not in info:
            raise ValueError(
                f"extra_info of response {i} has no {source_key!r} (keys: {sorted(info or {})}); put the "
                "text the judge reads (the article) in extra_info when preparing the data, or set "
                "+custom_reward_function.reward_kwargs.source_key=KEY"
            )
        sources.append(str(info[source_key]))
    anchored = scheme == "anchor"
    index: dict[tuple[str, str | None], int] = {}
    groups: list[dict[str, Any]] = []
    where = []
    for s, text, truth in zip(sources, solution_strs, ground_truths):
        anchor = str(truth) if anchored else None
        key = (s, anchor)
        if key not in index:
            index[key] = len(groups)
            groups.append({"prompt": s, "completions": [], **({"anchor": anchor} if anchored else {})})
        where.append((index[key], len(groups[index[key]]["completions"])))
        groups[index[key]]["completions"].append(text)
    body: dict[str, Any] = {"groups": groups, "empty_completions": "lose"}
    if scheme is not None:
        body["scheme"] = scheme
    if aggregate is not None:
        body["aggregate"] = aggregate
    api_key = os.environ.get(api_key_env, "") if api_key_env else None
    answer = post_json(server_url.rstrip("/") + "/v1/rewards", body, api_key, timeout)
    out = []
    for i, (g, j) in enumerate(where):
        reward = answer["rewards"][g][j]
        if reward is None:
            raise RuntimeError(
                f"response {i} got no reward (no valid comparison: a group of one, or the judge failed on "
                "it); generate rollout.n > 1 responses per prompt, or use scheme=anchor"
            )
        out.append(
            {
                "score": float(reward),
                "judge_comparisons": answer["comparisons"][g],
                "judge_empty": int(not solution_strs[i].strip()),
            }
        )
    return out


__all__ = ["compute_score", "post_json"]
