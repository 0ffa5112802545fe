"""The judge server's HTTP application: routes, request limits, the bearer token, error bodies.

Built on FastAPI (on Starlette) and served by uvicorn. Why these: the two trainers it serves speak
plain JSON over HTTP (OpenRLHF's own reward-model server is FastAPI + uvicorn), FastAPI validates the
request bodies from typed models and documents them at ``/docs``, uvicorn drains in-flight requests on
SIGTERM, and both are widely used and maintained. LitServe would batch requests itself, but batches
*requests* of one fixed shape; judgeloop's requests carry different numbers of comparisons, and
``/v1/rewards`` turns one request into a planned set of comparisons before judging, so the batching that
matters (comparisons from many requests in one judge call, never splitting a request) lives in
:mod:`judgeloop.serving.batcher`, a few dozen lines under judgeloop's own tests.

Every error answers ``{"error": "<one line>"}``: 400 malformed JSON or a body that is not Unicode text
(bytes that are not UTF-8, a lone surrogate escape such as ``"\\ud800"``), 401 a missing or wrong token,
404 / 405 an unknown route or method, 408 a body that did not arrive within ``server.read_timeout_s``
(the connection is closed), 413 a body, request or text (references included) over its limit, 422 a
missing field, a wrong type, an empty text or (for a judge that reads references,
:attr:`~judgeloop.judges.calibrated.CalibratedJudge.needs`) an item without references, 500 a judge
failure or any other fault (the server stays up). The server logs each one (route, status, reason) as a
warning: the access log is off, and OpenRLHF's client shows the status code only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from judgeloop.config import ConfigError, to_dict
from judgeloop.judges.calibrated import CalibratedJudge, MissingReferences, check_references
from judgeloop.logging import get_logger
from judgeloop.rewards import Group, RewardConfig, is_empty
from judgeloop.serving.batcher import ComparisonBatcher, JudgeFailure, to_json_floats
from judgeloop.serving.checks import ApiError, check_texts
from judgeloop.serving.config import ServeConfig, check_routes
from judgeloop.serving.groups import PromptGroups, served_group_scores
from judgeloop.serving.openrlhf import openrlhf_router
from judgeloop.serving.verl_route import VerlGroups, verl_router
from judgeloop.version import __version__

logger = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# --- request bodies ---------------------------------------------------------------------------
class CompareItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    a: str
    b: str
    references: list[str] = Field(default_factory=list)


class CompareRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[CompareItem]


class RewardGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    completions: list[str]
    anchor: str | None = None
    references: list[str] = Field(default_factory=list)


class RewardsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: list[RewardGroup]
    scheme: str | None = None
    aggregate: str | None = None
    m: int | None = None
    prior: float | None = None
    probability: str | None = None
    # refuse: an empty completion is a 422; lose: it loses to every non-empty text, unjudged (what a
    # trainer's reward function wants: a policy's empty output ranked last, the run going on)
    empty_completions: Literal["refuse", "lose"] = "refuse"


# --- checks -------------------------------------------------------------------------------------
def reference_texts(field: str, references: list[list[str]]) -> list[tuple[str, str]]:
    """``(field[i].references[j], text)`` of every reference, for :func:`check_texts`'s limits."""
    return [
        (f"{field}[{i}].references[{j}]", r) for i, refs in enumerate(references) for j, r in enumerate(refs)
    ]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(obj: Any, path: str = "body") -> str | None:
    """The first string (or key) of a parsed JSON body holding a lone surrogate, as ``path: where``
    (``json.loads`` joins a valid pair into one character, so any surrogate left is unpaired)."""
    if isinstance(obj, str):
        m = _SURROGATE.search(obj)
        return f"{path} holds \\u{ord(m.group(0)):04x} at character {m.start()}" if m else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _lone_surrogate(k, f"{path} (a key)") or _lone_surrogate(
                v, f"{path}.{k}".removeprefix("body.")
            )
            if found:
                return found
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


def body_problem(body: bytes) -> str | None:
    """Why a request body is no Unicode text (None when it is): bytes that are not UTF-8, or a JSON string
    escape of a lone surrogate (``"\\ud800"``: valid JSON, but no character, so no judge can read it)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return (
            f"request body is not UTF-8: byte 0x{body[err.start]:02x} at offset {err.start}; send UTF-8 JSON"
        )
    if b"\\ud" not in body and b"\\uD" not in body:  # the cheap test: no surrogate escape at all
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # malformed JSON: the route's own 400
    found = _lone_surrogate(parsed)
    return f"{found}, a lone surrogate, which is no Unicode character; send valid text" if found else None


class BodyLimit:
    """ASGI middleware reading the whole body before the app does: a body over ``max_bytes`` is answered
    413 before the app reads it (a declared Content-Length at once; a chunked body as soon as it passes
    the limit); a body that has not all arrived ``read_timeout_s`` after the request began is answered
    408 and its connection closed (a client that sends half a body and stops would hold it open for
    ever: uvicorn has no read timeout); a body that is no Unicode text (:func:`body_problem`) is a 400.
    A POST body is read as JSON whatever Content-Type it declares, as OpenRLHF's own ``serve_rm.py``
    reads it (``curl -d`` declares a form; the routes take JSON only)."""

    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float = 60.0):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope.get("method") == "POST" and headers.get(b"content-type") != b"application/json":
            kept = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        chunks, total, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                reason = (
                    f"the request body did not arrive within server.read_timeout_s={self.read_timeout_s:g} "
                    f"({total} bytes came); send the whole body at once"
                )
                await _answer(scope, send, 408, reason, close=True)
                return
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                await self._refuse(send, total)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = body_problem(body) if body else None
        if problem:
            await _answer(scope, send, 400, problem)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, size: int) -> None:
        message = f"request body of {size} bytes; the limit is server.max_body_bytes={self.max_bytes}"
        await _answer(None, send, 413, message)


async def _answer(scope: Scope | None, send: Send, status: int, message: str, close: bool = False) -> None:
    """Send ``{"error": message}`` from a middleware (logged as the app's handlers log theirs);
    ``close``: and close the connection after it (``Connection: close``)."""
    if scope is not None:
        logger.warning("%s %s -> %d: %s", scope.get("method"), scope.get("path"), status, message)
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + ([(b"connection", b"close")] if close else []),
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class PostStats:
    """The POST requests the server received (refused ones included) and those not answered yet: the
    posts as clients sent them. OpenRLHF posts each sample alone, and its route judges a prompt's group
    of posts as one batcher job (``stats.judge_jobs``)."""

    requests: int = 0
    in_flight: int = 0


class RequestCounter:
    """ASGI middleware counting POST requests into ``stats`` (``/v1/info``: ``stats.requests``,
    ``stats.in_flight_requests``)."""

    def __init__(self, app: Any, stats: PostStats):
        self.app, self.stats = app, stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        self.stats.requests += 1
        self.stats.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.stats.in_flight -= 1


def api_key(cfg: ServeConfig) -> str | None:
    """The bearer token the server requires (from ``server.api_key_env``), or None.

    Raises:
        ConfigError: ``server.api_key_env`` names an unset or empty variable.
    """
    name = cfg.server.api_key_env
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(
            f"server.api_key_env={name}, but the environment variable {name} is unset or empty; export "
            f"{name}=TOKEN, or set server.api_key_env= (empty) for no token"
        )
    return value


def reward_settings(body: RewardsRequest, defaults: RewardConfig) -> RewardConfig:
    """The server's reward settings (``rewards:``) with the request's own (422 for a bad one)."""
    own = {f.name: getattr(body, f.name) for f in dataclasses.fields(defaults)}
    try:
        return dataclasses.replace(defaults, **{k: v for k, v in own.items() if v is not None})
    except ValueError as err:
        raise ApiError(422, str(err)) from None


def check_reward_texts(cfg: ServeConfig, body: RewardsRequest) -> None:
    """The limits and empty texts of a rewards request (:func:`check_texts`); 422 for a group with no
    completions. Empty completions pass with ``empty_completions=lose``; prompts and anchors never."""
    texts = [(f"groups[{i}].prompt", g.prompt) for i, g in enumerate(body.groups)]
    completions = []
    for i, g in enumerate(body.groups):
        completions += [(f"groups[{i}].completions[{j}]", c) for j, c in enumerate(g.completions)]
        if g.anchor is not None:
            texts.append((f"groups[{i}].anchor", g.anchor))
        if not g.completions:
            raise ApiError(422, f"groups[{i}].completions is empty; send each prompt's completions")
    lose = body.empty_completions == "lose"
    check_texts(cfg, len(completions), completions, allow_empty=lose)
    check_texts(cfg, len(completions), texts)
    check_texts(cfg, len(completions), reference_texts("groups", [g.references for g in body.groups]), True)


def check_request_references(judge: CalibratedJudge, refs: list[list[str]], field: str) -> None:
    """422 before any judging when the judge reads references and an item or group (``field``: its
    path, ``items`` or ``groups``) sends none."""
    try:
        check_references(
            judge.needs,
            refs,
            len(refs),
            f"send each one's reference summaries in {field}[i].references",
            field + "[{i}].references",
        )
    except MissingReferences as err:
        raise ApiError(422, str(err)) from None


def _one_line(err: RequestValidationError) -> tuple[int, str]:
    errors = err.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return 422, f"{loc}: {first.get('msg', 'invalid')}{more}"


def add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": "<one line>"}`` with its status (module docstring)."""

    def answer(request: Request, status: int, message: str) -> JSONResponse:
        # the path only: a query string may carry ?api_key=
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, status, message)
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return answer(request, err.status, err.message)

    @app.exception_handler(HTTPException)  # Starlette's own: 404, 405 (with its Allow header), 400
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        response = answer(request, err.status_code, str(err.detail))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(Exception)  # anything else: still one line, still JSON; the server stays up
    async def _fault(request: Request, err: Exception) -> JSONResponse:
        logger.exception("%s %s raised", request.method, request.url.path)
        return answer(request, 500, f"internal error: {type(err).__name__}: {err}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return answer(request, *_one_line(err))

    @app.exception_handler(MissingReferences)
    async def _no_references(request: Request, err: MissingReferences) -> JSONResponse:
        return answer(request, 422, str(err))

    @app.exception_handler(JudgeFailure)
    async def _judge_failed(request: Request, err: JudgeFailure) -> JSONResponse:
        return answer(request, 500, f"the judge failed on this request: {err}")


def judge_cache_stats(judge: CalibratedJudge) -> dict[str, int]:
    """The shared judge's pair-cache hits and misses since the server started (every request's)."""
    stats = getattr(judge.judge, "stats", None)
    return {
        "judge_cache_hits": getattr(stats, "cache_hits", 0),
        "judge_cache_misses": getattr(stats, "cache_misses", 0),
    }


def authorizer(token: str | None) -> Callable[[Request], None]:
    """The route dependency that checks the bearer token (``Authorization: Bearer TOKEN``, or
    ``?api_key=TOKEN`` for a client that sends no headers); a no-op without a token."""

    def authorize(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        given = (
            header[7:] if header.lower().startswith("bearer ") else request.query_params.get("api_key", "")
        )
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")

    return authorize


def reward_groups(body: RewardsRequest) -> list[Group]:
    """The request's groups; with ``empty_completions=lose`` an empty completion becomes ``""`` (so
    empty ones tie exactly)."""
    lose = body.empty_completions == "lose"
    return [
        Group(
            g.prompt,
            ["" if lose and is_empty(c) else c for c in g.completions],
            g.anchor,
            tuple(g.references),
        )
        for g in body.groups
    ]


def info_body(
    judge: CalibratedJudge,
    cfg: ServeConfig,
    batcher: ComparisonBatcher,
    prompt_groups: PromptGroups,
    posts: PostStats,
) -> dict[str, Any]:
    """``GET /v1/info``: the judge, its card, the server's settings (no token) and what it has done
    (``stats.requests``: POST requests received; ``stats.judge_jobs``: what the batcher judged, one per
    ``/v1`` request and one per OpenRLHF or verl group)."""
    return {
        "judge": to_dict(judge.config),
        "calibrator": judge.method,
        "pairwise": judge.pairwise,
        "debiases": judge.debiases,
        "needs": judge.needs.as_dict(),
        "routes": to_dict(cfg.routes),
        "card": judge.card,
        "judgeloop_version": __version__,
        "rewards": to_dict(prompt_groups.settings),
        "server": {k: v for k, v in to_dict(cfg.server).items() if k != "api_key_env"},
        "judge_threads": batcher.threads,  # torch intra-op threads of the judge thread
        "stats": {
            "requests": posts.requests,
            "in_flight_requests": posts.in_flight,
            **batcher.stats.as_dict(),
            **judge_cache_stats(judge),
            "openrlhf_groups": prompt_groups.groups,
            "openrlhf_partial_groups": prompt_groups.partial_groups,
            "openrlhf_open_groups": prompt_groups.open_groups,
            "openrlhf_empty_completions": prompt_groups.empty_completions,
        },
    }


# --- the application -----------------------------------------------------------------------------
def build_app(judge: CalibratedJudge, cfg: ServeConfig) -> FastAPI:
    """The ASGI application serving ``judge`` under ``cfg`` (routes in the module docstring of
    :mod:`judgeloop.commands.serve_judge`); ``app.state`` holds its ``batcher``, ``prompt_groups``, ``verl_groups`` and ``drain``."""
    check_routes(cfg, judge.needs)  # a route that cannot carry what the judge reads is never enabled
    token = api_key(cfg)
    batcher = ComparisonBatcher(
        judge, cfg.server.max_batch_size, cfg.server.max_wait_ms, cfg.server.num_threads
    )
    defaults = cfg.rewards
    prompt_groups = PromptGroups(
        batcher,
        defaults,
        max(cfg.openrlhf.n_samples_per_prompt, 1),
        cfg.openrlhf.group_wait_s,
        empty_loses=True,
        idle_s=cfg.openrlhf.group_idle_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="judgeloop judge server", version=__version__, lifespan=lifespan)
    app.state.batcher, app.state.cfg, app.state.prompt_groups = batcher, cfg, prompt_groups
    app.state.posts = PostStats()
    verl_groups = app.state.verl_groups = VerlGroups(batcher, defaults)
    app.state.drain = lambda: (prompt_groups.drain(), verl_groups.drain())

    authorize = authorizer(token)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/info", dependencies=[Depends(authorize)])
    async def info() -> dict[str, Any]:
        body = info_body(judge, cfg, batcher, prompt_groups, app.state.posts)
        body["stats"].update(verl_groups.stats())
        return body

    @app.post("/v1/compare", dependencies=[Depends(authorize)])
    async def compare(body: CompareRequest) -> dict[str, Any]:
        items = body.items
        texts = [
            (f"items[{i}].{k}", getattr(it, k)) for i, it in enumerate(items) for k in ("prompt", "a", "b")
        ]
        check_texts(cfg, len(items), texts)
        check_texts(cfg, len(items), reference_texts("items", [it.references for it in items]), True)
        if not items:
            return {"p": [], "logit": [], "status": []}
        check_request_references(judge, [it.references for it in items], "items")
        refs = [it.references for it in items] if any(it.references for it in items) else None
        out = await batcher.submit(
            [it.prompt for it in items], [it.a for it in items], [it.b for it in items], refs
        )
        return {"p": to_json_floats(out.p), "logit": to_json_floats(out.logit), "status": out.status}

    @app.post("/v1/rewards", dependencies=[Depends(authorize)])
    async def rewards(body: RewardsRequest) -> dict[str, Any]:
        settings = reward_settings(body, defaults)
        check_reward_texts(cfg, body)
        check_request_references(judge, [g.references for g in body.groups], "groups")
        lose = body.empty_completions == "lose"
        try:
            scores = await served_group_scores(batcher, reward_groups(body), settings, empty_loses=lose)
        except ValueError as err:  # e.g. scheme=anchor and a group without an anchor
            raise ApiError(422, str(err)) from None
        return {
            "rewards": scores.rewards,
            "comparisons": scores.comparisons,
            "failed": scores.failed,
            "mean_p": scores.mean_p if scores.mean_p == scores.mean_p else None,
        }

    if cfg.routes.openrlhf:
        app.include_router(openrlhf_router(cfg, prompt_groups), dependencies=[Depends(authorize)])
    if cfg.routes.verl:
        app.include_router(verl_router(cfg, verl_groups), dependencies=[Depends(authorize)])
    app.add_middleware(
        BodyLimit, max_bytes=cfg.server.max_body_bytes, read_timeout_s=cfg.server.read_timeout_s
    )
    app.add_middleware(RequestCounter, stats=app.state.posts)  # outermost: refused posts count too
    return app


__all__ = ["ApiError", "BodyLimit", "build_app", "check_texts"]
