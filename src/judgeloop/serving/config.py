"""Schema of ``judgeloop serve-judge``: the judge folder, the server's address and limits, the default
groupwise-reward settings and the OpenRLHF route's grouping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from judgeloop.config import (
    WAIT_MS,
    WAIT_S,
    Bound,
    ConfigError,
    bounded,
    check_fields,
    check_range,
)
from judgeloop.judges import JudgeNeeds
from judgeloop.judges.calibrated import check_judge_path
from judgeloop.rewards import RewardConfig


@dataclass
class ServerConfig:
    """Address, access and limits (``server.*``).

    ``host`` is loopback unless set otherwise (``0.0.0.0`` exposes the judge to the network: set
    ``api_key_env`` then). ``api_key_env`` names an environment variable holding a bearer token; empty:
    no token. ``max_batch_size`` / ``max_wait_ms``: concurrent requests are merged into one judge call of
    up to ``max_batch_size`` comparisons, waiting at most ``max_wait_ms`` after the first for others
    (1 / 0: every request is its own judge call). ``drain_timeout_s``: on SIGTERM, how long in-flight
    requests may take to finish. ``read_timeout_s``: a request's whole body must arrive within this many
    seconds of its headers, else it is answered 408 and its connection closed (a client that sends half
    a body and stops holds no connection open). ``num_threads``: torch's intra-op threads for the judge (0: torch's
    default, one per physical core); on a machine whose cores other jobs share, set 1: with more
    threads than free cores every parallel op waits for a descheduled thread (measured in
    ``docs/serving.md``, "Batching and threads")."""

    host: str = "127.0.0.1"
    port: int = bounded(
        8000, Bound(0, 65535, "[]", " (0: any free port)"), ge=0, hint=" (0: any free port)", shape="section"
    )
    api_key_env: str = ""
    max_batch_size: int = bounded(256, ge=1, shape="section")
    max_wait_ms: float = bounded(5.0, WAIT_MS, ge=0, shape="section")
    max_items_per_request: int = bounded(4096, ge=1, shape="section")
    max_chars_per_text: int = bounded(50_000, ge=1, shape="section")
    max_body_bytes: int = bounded(32 * 1024 * 1024, ge=1024, shape="section")
    drain_timeout_s: float = bounded(30.0, WAIT_S, ge=0, shape="section")
    read_timeout_s: float = bounded(60.0, WAIT_S, gt=0, shape="section")
    num_threads: int = bounded(0, ge=0, hint=" (0: torch's default)", shape="section")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def __post_init__(self) -> None:
        check_fields("server", self)


@dataclass
class OpenRLHFConfig:
    """How the OpenRLHF route (``POST /openrlhf/get_reward``) forms groups.

    OpenRLHF's executor posts each sample alone (one query per request), so ``n_samples_per_prompt``
    (set it to the trainer's ``--rollout.n_samples_per_prompt``) collects the completions of one prompt
    across requests; a group still short ``group_idle_s`` after its latest completion (no other came:
    an eval run with fewer samples per prompt, a dropped sample), or ``group_wait_s`` after its first,
    is scored as it is. ``group_idle_s`` must exceed the longest gap between two completions of one
    prompt (they are generated together and finish as their lengths differ): a completion that arrives
    after its group closed starts a group of its own. 0 groups the queries
    of each request by prompt (clients that post a whole batch). ``source``: what the judge reads the
    completions against: the prompt, or the dataset label (``--data.label_key`` naming the article).
    With the ``anchor`` scheme the label is the anchor. ``strip_suffixes``: end-of-turn tokens the
    client leaves in the decoded query, removed from the completion's end."""

    n_samples_per_prompt: int = bounded(0, ge=0, hint=" (0: group each request's queries)", shape="section")
    group_wait_s: float = bounded(60.0, WAIT_S, gt=0, shape="section")
    # bounded by group_wait_s (itself at most a week) in __post_init__: a bound set by another key
    group_idle_s: float = 10.0
    source: Literal["prompt", "label"] = "prompt"
    strip_suffixes: list[str] = field(
        default_factory=lambda: ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>"]
    )

    def __post_init__(self) -> None:
        check_fields("openrlhf", self)
        check_range(
            "openrlhf",
            self,
            "group_idle_s",
            0,
            self.group_wait_s,
            "(]",
            f" (at most openrlhf.group_wait_s={self.group_wait_s:g}, which bounds a group's wait from its first "
            "completion anyway; lower group_idle_s or raise group_wait_s)",
        )


@dataclass
class RoutesConfig:
    """Which trainer routes the server enables (``routes.*``); ``/health``, ``/v1/info``, ``/v1/compare``
    and ``/v1/rewards`` are always on. The OpenRLHF and verl protocols carry no references, so a judge
    that reads them is served with both off (``serve-judge`` refuses to start otherwise)."""

    openrlhf: bool = True
    verl: bool = True


@dataclass
class ServeConfig:
    """Schema of ``judgeloop serve-judge``."""

    judge_path: str = ""
    judge_overrides: list[str] = field(default_factory=list)
    server: ServerConfig = field(default_factory=ServerConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)  # a /v1/rewards request may name its own
    openrlhf: OpenRLHFConfig = field(default_factory=OpenRLHFConfig)
    routes: RoutesConfig = field(default_factory=RoutesConfig)

    def __post_init__(self) -> None:
        check_judge_path(self.judge_path, on_disk=False)
        if self.rewards.scheme == "anchor" and self.openrlhf.source == "label":
            raise ValueError(
                "rewards.scheme=anchor uses the OpenRLHF label as the anchor, so openrlhf.source=label cannot "
                "also make it the source text; set openrlhf.source=prompt or another scheme"
            )


def check_routes(cfg: ServeConfig, needs: JudgeNeeds) -> None:
    """Refuse to enable a route that cannot carry what the judge reads per call (one line naming the
    route, the judge's setting and both fixes); cheap, so ``serve-judge`` calls it before loading weights.

    Raises:
        ConfigError: the judge reads references and ``routes.openrlhf`` or ``routes.verl`` is on.
    """
    if not needs.reads_references:
        return
    on = [
        (k, r)
        for k, r in (("openrlhf", "/openrlhf/get_reward"), ("verl", "/verl/reward"))
        if getattr(cfg.routes, k)
    ]
    if not on:
        return
    routes = " and ".join(f"routes.{k}=true ({r})" for k, r in on)
    off = " ".join(f"routes.{k}=false" for k, _ in on)
    raise ConfigError(
        f"judge_path={cfg.judge_path} reads references ({needs.setting}), which {routes} cannot carry (the "
        f"protocol has no field for them); set {off} to serve /v1/compare and /v1/rewards only, or serve a "
        f"judge that reads none (calibrate with {needs.alternative})"
    )


__all__ = ["OpenRLHFConfig", "RoutesConfig", "ServeConfig", "ServerConfig", "check_routes"]
