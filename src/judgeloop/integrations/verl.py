"""verl's custom reward function, scored by judgeloop's judge server: :func:`compute_score`.

Supported: verl 0.7.1 to 0.9.x (:data:`SUPPORTED_VERL`; tested with 0.9.1). These run rewards in the
reward loop (``verl/experimental/reward_loop``): ``RewardLoopManager`` splits the batch across
``reward.num_workers`` Ray actors, and each actor's reward manager (``naive``, registered in
``reward_loop/reward_manager/naive.py``) awaits the custom function once per response, by keyword::

    await compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)

reading back a float, or a dict with ``"score"`` whose other keys verl logs. ``reward_kwargs`` come
from ``reward.custom_reward_function.reward_kwargs`` (``verl/trainer/ppo/reward.py``,
``get_custom_reward_fn``). The legacy top-level ``custom_reward_function.*`` and
``reward_model.reward_manager`` keys are not read by verl 0.9's ``main_ppo`` (nothing migrates them),
and its reward loop has no ``batch`` manager: use the ``reward.*`` keys of the launch line below.

A groupwise reward needs every response of a prompt, and one call sees one response; so each call
posts its response to the server's ``POST /verl/reward`` (:mod:`judgeloop.serving.verl_route`),
which gathers the ``group_size`` responses of one prompt (set it to ``actor_rollout_ref.rollout.n``),
from every reward worker, scores them as one group and answers each call with its own reward; a group
still short after ``group_wait_s`` is scored as it is. verl passes no prompt, so the text the judge
reads the responses against comes from ``extra_info[source_key]`` (put the article there when preparing
the parquet). With the server's ``rewards.scheme=anchor`` each response is judged against its
``ground_truth``.

Validation: verl validates before training by default (``trainer.val_before_train=True``), with
``actor_rollout_ref.rollout.val_kwargs.n`` responses per prompt (default 1), through the same function,
and tells it nothing of the phase (``_validate`` in ``verl/trainer/ppo/ray_trainer.py``; the
``validate`` flag stays in the agent loop). What tells a validation row apart is the row itself:
verl's example preparers (``examples/data_preprocess/gsm8k.py``) write ``extra_info["split"]``, "train"
in the training parquet and "test" in the validation one. So every row needs ``extra_info[split_key]``:
a "train" row is grouped by ``group_size``, any other by ``val_group_size`` (set it to ``val_kwargs.n``;
default 1, verl's default). A group of one has no other response to compare with, so it is judged
against its ``ground_truth`` (the reference summary; the server scores it with the ``anchor`` scheme):
its score is the calibrated probability that it beats the reference (with ``win_rate``). A group of
one without a ``ground_truth`` raises before anything is posted, naming the fix.

Launch::

    judgeloop serve-judge --config configs/serve/judge.yaml judge_path=DIR
    python -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.n=8 \\
        reward.custom_reward_function.path=pkg://judgeloop.integrations.verl \\
        reward.custom_reward_function.name=compute_score \\
        +reward.custom_reward_function.reward_kwargs.server_url=http://127.0.0.1:8000 \\
        +reward.custom_reward_function.reward_kwargs.group_size=8

(``val_group_size`` defaults to 1, verl's ``val_kwargs.n``; add
``+reward.custom_reward_function.reward_kwargs.val_group_size=N`` with ``val_kwargs.n=N``.)

An empty response (the policy wrote nothing) is not judged: it loses each comparison with a non-empty
response of its group, so it gets the group's lowest reward (0.0 with ``win_rate``), and its
``judge_empty`` is 1. A response with no valid comparison (a group of one, a judgement that failed)
raises with the server's reason, rather than being scored as anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from typing import Any

SUPPORTED_VERL = ("0.7.1", "0.10")  # from (inclusive) to (exclusive)


def check_verl_version(version: str | None = None) -> str:
    """The installed verl's version, if :func:`compute_score` speaks its reward API.

    Raises:
        RuntimeError: verl is older than 0.7.1 (its batch reward manager calls the function once per batch
            with lists) or 0.10 or newer (not tested), naming the version and the fix.
    """
    from packaging.version import Version

    if version is None:
        import verl

        version = str(verl.__version__)
    low, high = SUPPORTED_VERL
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"verl {version} is not supported by judgeloop.integrations.verl (supported: verl>={low},<{high}, "
            f"whose reward loop awaits compute_score once per response); install verl==0.9.1"
        )
    return version


def post_json(url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 600.0) -> Any:
    """POST ``body`` as JSON and return the decoded answer (blocking; for scripts and tests).

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
        raise RuntimeError(_server_error(url, err.code, err.read().decode(errors="replace"))) from None
    except urllib.error.URLError as err:
        raise RuntimeError(
            f"judge server {url} cannot be reached ({err.reason}); start it with judgeloop serve-judge"
        ) from None


def _server_error(url: str, status: int, text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        text = json.loads(text).get("error", text)
    return f"judge server {url} answered {status}: {text}"


async def post_json_async(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> Any:
    """POST ``body`` as JSON with aiohttp (what verl's reward loop itself uses) and decode the answer.

    Raises:
        RuntimeError: as :func:`post_json`.
    """
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(url, json=body, headers=headers) as response,
        ):
            text = await response.text()
            if response.status >= 400:
                raise RuntimeError(_server_error(url, response.status, text))
            return json.loads(text)
    except aiohttp.ClientConnectionError as err:
        raise RuntimeError(
            f"judge server {url} cannot be reached ({err}); start it with judgeloop serve-judge"
        ) from None


def row_group_size(
    extra_info: dict[str, Any] | None, split_key: str, group_size: int, val_group_size: int
) -> int:
    """The responses per prompt of this row's phase: ``group_size`` for a training row
    (``extra_info[split_key] == "train"``), ``val_group_size`` for any other (a validation row).

    Raises:
        ValueError: a size below 1, or ``extra_info`` lacks ``split_key``.
    """
    for name, size, setting in (
        ("group_size", group_size, "actor_rollout_ref.rollout.n"),
        ("val_group_size", val_group_size, "actor_rollout_ref.rollout.val_kwargs.n"),
    ):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"reward_kwargs.{name}={size!r}; set +reward.custom_reward_function.reward_kwargs.{name} to "
                f"{setting} (the responses per prompt)"
            )
    if not extra_info or split_key not in extra_info:
        raise ValueError(
            f"extra_info has no {split_key!r} (keys: {sorted(extra_info or {})}); verl validates through the "
            f"same reward function, so write extra_info[{split_key!r}] when preparing the data, as verl's "
            "examples do ('train' in the training parquet, 'test' in the validation one), or set "
            "+reward.custom_reward_function.reward_kwargs.split_key=KEY"
        )
    return group_size if extra_info[split_key] == "train" else val_group_size


def reward_request(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None,
    source_key: str,
    group_size: int,
    group_wait_s: float,
) -> dict[str, Any]:
    """The body of ``POST /verl/reward`` for one response (checked before anything is sent).

    Raises:
        ValueError: ``extra_info`` lacks ``source_key``, ``group_size`` is below 1, or a group of one
            has no ``ground_truth`` to be judged against.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(
            f"reward_kwargs.group_size={group_size!r}; set +reward.custom_reward_function.reward_kwargs."
            "group_size to actor_rollout_ref.rollout.n (the responses per prompt)"
        )
    if not extra_info or source_key not in extra_info:
        raise ValueError(
            f"extra_info has no {source_key!r} (keys: {sorted(extra_info or {})}); put the text the judge reads "
            "(the article) in extra_info when preparing the data, or set "
            "+reward.custom_reward_function.reward_kwargs.source_key=KEY"
        )
    if group_size == 1 and ground_truth is None:
        raise ValueError(
            "a group of one response (validation with actor_rollout_ref.rollout.val_kwargs.n=1) is judged "
            "against its reward_model.ground_truth, and this row has none; put the reference in "
            "reward_model.ground_truth, or validate with val_kwargs.n=N > 1 and "
            "+reward.custom_reward_function.reward_kwargs.val_group_size=N, or trainer.val_before_train=False"
        )
    anchor = None if ground_truth is None else str(ground_truth)
    return {
        "prompt": str(extra_info[source_key]),
        "completion": solution_str,
        "anchor": anchor,
        "group_size": group_size,
        "group_wait_s": group_wait_s,
    }


async def compute_score(
    data_source: Any = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: dict[str, Any] | None = None,
    server_url: str = "http://127.0.0.1:8000",
    group_size: int = 0,
    val_group_size: int = 1,
    group_wait_s: float = 30.0,
    source_key: str = "article",
    split_key: str = "split",
    api_key_env: str = "",
    timeout: float = 600.0,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl reward function (reward loop, one response per call): the response's groupwise calibrated
    reward among the ``group_size`` responses of its prompt, from a judgeloop judge server.

    Args:
        data_source, solution_str, ground_truth, extra_info: what verl's reward manager passes.
        server_url: the judge server's address.
        group_size: the responses per prompt in training (``actor_rollout_ref.rollout.n``).
        val_group_size: the responses per prompt in validation (``rollout.val_kwargs.n``); a group of
            one is judged against its ``ground_truth``.
        group_wait_s: how long the server waits for a group's missing responses, from the first.
        source_key: the ``extra_info`` key holding the text the judge reads the response against.
        split_key: the ``extra_info`` key holding the row's split ("train" for a training row).
        api_key_env: the environment variable holding the server's bearer token (empty: none).
        kwargs: what else verl passes (``reward_router_address`` with a reward model), ignored.

    Returns:
        ``{"score": reward, "judge_empty": 0 or 1, "judge_group_size": n}`` (verl logs the extra keys).

    Raises:
        RuntimeError: an unsupported verl; the server refused the response or gave it no reward.
        ValueError: ``extra_info`` lacks ``source_key`` or ``split_key``, ``group_size`` is unset, or a
            group of one has no ``ground_truth``.
    """
    check_verl_version()
    size = row_group_size(extra_info, split_key, group_size, val_group_size)
    body = reward_request(solution_str, ground_truth, extra_info, source_key, size, group_wait_s)
    api_key = os.environ.get(api_key_env, "") if api_key_env else None
    answer = await post_json_async(server_url.rstrip("/") + "/verl/reward", body, api_key, timeout)
    return {
        "score": float(answer["reward"]),
        "judge_empty": int(answer["empty"]),
        "judge_group_size": int(answer["group_size"]),
    }


__all__ = [
    "SUPPORTED_VERL",
    "check_verl_version",
    "compute_score",
    "post_json",
    "reward_request",
    "row_group_size",
]
