"""The HTTP client of the served judge: verdict-token log-probabilities from vLLM, SGLang or an OpenAI API.

One request asks the next-token distribution at the end of a judge prompt (given as token ids, so the
server sees exactly the tokens the in-process judge would) and returns a :class:`Reply`. Routes, best
first (``route: auto`` probes them in this order on the first call):

* ``vllm``: ``POST /v1/completions`` with ``logprob_token_ids`` (the log-probability of the given ids
  whatever their rank) and ``return_tokens_as_token_ids``; read from
  ``choices[0].logprobs.top_logprobs[0]``, keys ``token_id:N``;
* ``sglang``: ``POST /generate`` with ``input_ids``, ``return_logprob`` and ``token_ids_logprob``; read from
  ``meta_info.output_token_ids_logprobs[0]``, entries ``[logprob, token_id, text]``;
* ``generative_scoring``: vLLM's ``POST /generative_scoring`` (0.32): a ``query`` (the common prefix of the
  prompts) and ``items`` (the rest of each), ``label_token_ids``, ``apply_softmax: false``; each item's
  ``score`` is the full-vocabulary probability of the first label id, so one request per label carries a
  whole call's prompts (both orders of every pair);
* ``top_logprobs``: ``POST /v1/completions`` with ``logprobs: k`` (at most 20 on OpenAI); a verdict token
  missing from the top k is bounded above by the k-th log-probability (:attr:`Reply.bound`);
* ``decisions``: ``POST /v1/decisions`` (vLLM 0.33 in OpenAI's Decisions shape, SGLang 0.5 in its own), and
  ``systemone``: ``POST /v1/systemone`` (vLLM 0.32's structured decisions): the server renders its own
  prompt from a text ``input``/``state`` (the article) and choice questions (the two summaries, each order
  one question), so one request carries every order of every pair of an article; the options'
  probabilities and their ``label_mass`` come back (:class:`Question`, :func:`decision_request`);
* ``text``: the same completion with no log-probabilities: the sampled token as a hard label.

``route: auto`` probes them in that order: the exact-id routes on judgeloop's own prompt, then its prompt
with a top k, then the servers' own decision prompts, then text. Every route that returns the labels'
full-vocabulary probabilities records their sum (:attr:`Reply.label_mass`): a verdict the model gives
little mass is status ``low_label_mass`` (``judge.server.min_label_mass``).

A request may instead ask the log-probabilities of the prompt's own tokens from position ``start`` on (the
``likelihood`` extractor; :meth:`ServedClient.replies` with ``starts``), read into
:attr:`Reply.prompt_logprobs`, on the two routes that return them (:meth:`ServedClient.find_prompt_route`
finds or checks one before any judging; there is no text fallback):

* ``vllm``: ``POST /v1/completions`` with ``prompt_logprobs: 0``; read from ``choices[0].prompt_logprobs``
  (``None`` for the first token, then ``{"<id>": {"logprob", "rank", "decoded_token"}}``);
* ``sglang``: ``POST /generate`` with ``return_logprob`` and ``logprob_start_len: start - 1``; read from
  ``meta_info.input_token_logprobs`` (``[logprob, id, text]`` from ``start - 1``, its first logprob ``None``).

Each returned id is checked against the id sent, so a server that tokenized the prompt otherwise is an
error (status ``failed``), never a likelihood of other tokens.

The prompt goes as token ids, or (``prompt_format: text``, or ``auto`` when the server refuses ids, as
llama.cpp's ``llama-cpp-python`` server does) as those ids decoded back to text; the server's count of
the prompt's tokens (``usage.prompt_tokens``) is then checked against the ids, and a reply whose count
differs is an error (status ``failed``), never a score of other tokens.

Calls are async (httpx) with bounded concurrency, requests- and tokens-per-minute limits, retries with
backoff on 429 (honouring ``Retry-After``), 5xx, timeouts and dropped connections. A call that still
fails is a :class:`Reply` with ``error`` set, never an exception in the middle of a batch. Successful
replies can be kept in an SQLite cache keyed by server, model, route and prompt ids.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from judgeloop.config import WAIT_S, bounded, check_fields, field_order
from judgeloop.errors import ServiceFailed, UserError
from judgeloop.logging import get_logger

logger = get_logger(__name__)

ROUTES = ("vllm", "sglang", "generative_scoring", "top_logprobs", "decisions", "systemone", "text")
PROMPT_ROUTES = ("vllm", "sglang")  # the routes that return the prompt's own log-probabilities
GROUP_ROUTES = ("generative_scoring", "decisions", "systemone")  # one request carries many prompts
QUESTION_ROUTES = ("decisions", "systemone")  # the server renders the prompt from a Question
PROMPT_FORMATS = ("ids", "text")
T = TypeVar("T")
MAX_GROUP = 64  # prompts (or questions) in one request of a group route (vLLM's decisions take 64)


@dataclass(frozen=True)
class Question:
    """One order of a pair as a decision API asks it: the server renders ``state`` (the article), then
    ``instructions`` (the criteria and both summaries in this order) and the options, labelled ``A``, ``B``
    in order, in its own prompt. Questions with one ``state`` go in one request."""

    state: str
    instructions: str
    options: tuple[str, ...]


@dataclass
class EndpointConfig:
    """An OpenAI-compatible server and how calls to it are made: the part of ``judge.server`` (the served
    judge) that ``model.server`` of ``judgeloop route`` (a served routed model) shares.

    Attributes:
        base_url: the server's root, e.g. ``http://localhost:8000`` (``/v1`` is added by the client).
        model: the model id the server serves (``GET /v1/models``); the saved judge records it.
        api_key_env: name of the environment variable holding the API key (the key itself is never
            stored in a config, a saved judge or a log); empty: no key.
        timeout_s: per-call timeout, seconds.
        max_retries: retries of one call after a 429, a 5xx, a timeout or a dropped connection.
        backoff_s: first retry delay, doubled on each retry (a 429's ``Retry-After`` wins when given).
        concurrency: requests in flight at once.
        max_requests_per_minute, max_tokens_per_minute: rate limits (0: none); tokens are prompt tokens.

    ``SECTION`` is where a config holds it (the dotted prefix its error messages name).
    """

    SECTION: ClassVar[str] = "server"

    base_url: str = ""
    model: str = ""
    api_key_env: str = ""
    timeout_s: float = bounded(60.0, WAIT_S, gt=0, shape="section")
    max_retries: int = bounded(3, ge=0, shape="section")
    backoff_s: float = bounded(0.5, WAIT_S)
    concurrency: int = bounded(8, ge=1, shape="section")
    max_requests_per_minute: int = bounded(0, ge=0, hint=" (0: no limit)", shape="section")
    max_tokens_per_minute: int = bounded(0, ge=0, hint=" (0: no limit)", shape="section")

    def __post_init__(self) -> None:
        check_fields(self.SECTION, self)


@field_order(
    "base_url",
    "model",
    "api_key_env",
    "route",
    "top_logprobs",
    "prompt_format",
    "timeout_s",
    "max_retries",
    "backoff_s",
    "concurrency",
    "max_requests_per_minute",
    "max_tokens_per_minute",
    "on_failure",
    "cache_path",
    "min_label_mass",
)
@dataclass
class ServerConfig(EndpointConfig):
    """Where the served judge's model runs (``judge.server``, with ``judge.type: served``): the
    :class:`EndpointConfig` settings and the judge's own.

    Attributes:
        route: ``auto`` (probe the best route the server answers, in the order of ``ROUTES``) or one of
            ``vllm``, ``sglang``, ``generative_scoring``, ``top_logprobs``, ``decisions``, ``systemone``,
            ``text``.
        top_logprobs: k of the ``top_logprobs`` route (OpenAI allows at most 20).
        prompt_format: ``ids`` (the prompt's token ids), ``text`` (the ids decoded back to text, for a
            server that takes strings only, e.g. llama-cpp-python's; its token count is checked) or
            ``auto`` (with ``route: auto``, probed on the first call, ids before text; else ids).
        on_failure: ``mask`` (a failed call is status ``failed``, its pair dropped and counted) or
            ``stop`` (raise after the batch, naming the count and the first error).
        cache_path: SQLite file of judgements kept across runs (empty: none).
        min_label_mass: a reply whose labels (the verdict or grade tokens) hold less than this share of the
            next-token probability is status ``low_label_mass`` (scored, counted): the model mostly wanted
            another token. Read on the routes that return full-vocabulary probabilities; 0 (the default):
            the masses are recorded, no reply is flagged.
    """

    SECTION: ClassVar[str] = "judge.server"

    route: Literal[
        "auto", "vllm", "sglang", "generative_scoring", "top_logprobs", "decisions", "systemone", "text"
    ] = "auto"
    top_logprobs: int = bounded(20, ge=1, shape="section")
    prompt_format: Literal["auto", "ids", "text"] = "auto"
    on_failure: Literal["mask", "stop"] = "mask"
    cache_path: str = ""
    min_label_mass: float = bounded(0.0, ge=0, le=1, shape="section")

    def __post_init__(self) -> None:
        if self.route not in ("auto", *ROUTES):
            raise ValueError(f"judge.server.route={self.route!r}; use auto or one of {list(ROUTES)}")
        if self.on_failure not in ("mask", "stop"):
            raise ValueError(f"judge.server.on_failure={self.on_failure!r}; use mask or stop")
        if self.prompt_format not in ("auto", *PROMPT_FORMATS):
            raise ValueError(f"judge.server.prompt_format={self.prompt_format!r}; use auto, ids or text")
        super().__post_init__()  # after the choices, whose messages say more than a Literal's list


def check_served(server: EndpointConfig, setting: str = "judge.type=served") -> None:
    """Refuse a served model without a server or a model (the config's check, and a judge or routed model
    built in Python's); ``setting`` names what asked for the server."""
    if not server.base_url or not server.model:
        s = server.SECTION
        raise ValueError(
            f"{setting} needs {s}.base_url and {s}.model (got {server.base_url!r}, {server.model!r}); e.g. "
            f"{s}.base_url=http://localhost:8000"
        )


@dataclass
class Reply:
    """One prompt's answer.

    Attributes:
        logprobs: token id -> log-probability at the answer position, for the ids the route returned;
            ``None`` when the server returned no log-probabilities (route ``text``).
        bound: the k-th (smallest) returned log-probability of the ``top_logprobs`` route: an upper bound
            of any id missing from ``logprobs``; ``None`` on the exact-id routes.
        text: the sampled next token's text.
        error: why the call failed after its retries (empty: it did not).
        n_prompt: the server's count of the prompt's tokens (``usage.prompt_tokens``), when it says.
        prompt_logprobs: a prompt-log-probability request's answer: ``log P(ids[t] | ids[:t])`` for
            ``t`` from its ``start`` to the prompt's end; ``None`` when the server returned none.
    """

    logprobs: dict[int, float] | None = None
    bound: float | None = None
    text: str = ""
    error: str = ""
    n_prompt: int | None = None
    prompt_logprobs: list[float] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "logprobs": self.logprobs,
                "bound": self.bound,
                "text": self.text,
                "prompt_logprobs": self.prompt_logprobs,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> Reply:
        """The reply :meth:`to_json` wrote; a ``ValueError``/``KeyError``/``TypeError``/``AttributeError`` for
        anything else (a damaged cache row is then a miss)."""
        d = json.loads(raw)
        lp = None if d["logprobs"] is None else {int(k): _logprob(v) for k, v in d["logprobs"].items()}
        bound = None if d["bound"] is None else _logprob(d["bound"])
        prompt = d.get("prompt_logprobs")
        if not isinstance(d["text"], str):
            raise TypeError(f"text {d['text']!r} is not a string")
        return cls(
            lp, bound, d["text"], prompt_logprobs=None if prompt is None else [_logprob(v) for v in prompt]
        )


class ServerSetupError(UserError):
    """The ``judge.server`` settings do not reach a usable server, found before any judging: no server at
    ``base_url``, a refused or unset key, a model it does not serve, an answer that is not an OpenAI model
    list, no prompt log-probabilities for the likelihood extractor. One line naming the key, the value and
    the fix (the command line prints it and exits with status 2)."""


class ServedJudgeFailed(ServiceFailed):
    """Calls to the server failed after their retries under ``judge.server.on_failure: stop``; the message
    is one line (the count, the server, the first error) that the command line prints as it is."""


class _RateLimiter:
    """Requests- and tokens-per-minute over a sliding 60 s window (0 disables a limit). One per client, so
    the limits hold across batches, not only within one.

    ``clock`` (seconds, monotonic) and ``sleep`` (awaitable) are the time it reads and waits on: the
    event loop's by default; a test passes a clock that moves only when the limiter sleeps, so what it
    decides does not depend on how fast the machine answers.
    """

    window_s = 60.0  # a minute

    def __init__(
        self,
        rpm: int,
        tpm: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ):
        self.rpm, self.tpm = rpm, tpm
        self.clock, self.sleep = clock, sleep
        self._sent: deque[tuple[float, int]] = deque()

    async def wait(self, tokens: int) -> None:
        while True:
            now = self.clock()
            while self._sent and now - self._sent[0][0] >= self.window_s:
                self._sent.popleft()
            used = sum(t for _, t in self._sent)
            rpm_ok = not self.rpm or len(self._sent) < self.rpm
            tpm_ok = not self.tpm or not self._sent or used + tokens <= self.tpm
            if rpm_ok and tpm_ok:
                self._sent.append((now, tokens))
                return
            await self.sleep(max(0.01, self.window_s - (now - self._sent[0][0])))


class CacheFileError(UserError):
    """``judge.server.cache_path`` cannot serve as the judgement cache (not an SQLite file, another
    program's database, not writable); one line naming the path and the fix, before any judging."""


class _ReplyCache:
    """SQLite judgement cache: key (server, model, route, prompt ids, verdict ids) -> reply JSON; and the
    route ``route: auto`` found on a server (key: server, model, settings) -> route and prompt format, so
    a rerun reads its judgements from the cache without probing the server first.

    The file is checked when opened (an SQLite file whose tables are these or absent, written to once);
    later, a row that does not read back as a reply is a miss (asked again and replaced), and a read or
    write that fails (a full disk, a file taken away) is a miss or a judgement not kept, with one warning:
    never an error in the middle of a batch."""

    TABLES = {"replies": ["key", "reply"], "routes": ["key", "route", "form"], "meta": ["key", "value"]}

    def __init__(self, path: str):
        from pathlib import Path

        self.path = path
        fix = "delete it or set judge.server.cache_path to another file"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # a run beside another on the same file waits for its write (up to 30 s), not fails
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
            found = {
                name: [c[1] for c in self._db.execute(f"PRAGMA table_info({name})")] for name in self.TABLES
            }
        except (OSError, sqlite3.Error) as err:
            what = "is not an SQLite judgement cache" if "not a database" in str(err) else "cannot be opened"
            raise CacheFileError(f"judge.server.cache_path={path}: {what} ({err}); {fix}") from None
        other = [n for n, cols in found.items() if cols and cols != self.TABLES[n]]
        if other:
            raise CacheFileError(
                f"judge.server.cache_path={path}: is not an SQLite judgement cache (its table {other[0]!r} has "
                f"columns {found[other[0]]}); {fix}"
            )
        try:
            for name, cols in self.TABLES.items():
                typed = ", ".join(
                    f"{c} TEXT PRIMARY KEY" if c == "key" else f"{c} TEXT NOT NULL" for c in cols
                )
                self._db.execute(f"CREATE TABLE IF NOT EXISTS {name} ({typed})")
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('opened', ?)", (time.strftime("%Y-%m-%dT%H:%M:%S"),)
            )
            self._db.commit()
        except sqlite3.Error as err:
            raise CacheFileError(
                f"judge.server.cache_path={path}: cannot be written ({err}); make it writable or {fix}"
            ) from None
        self._lock = threading.Lock()
        self._warned = False

    def _failed(self, doing: str, err: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "judge.server.cache_path=%s: %s failed (%s); judgements are still used but not kept in it "
                "from now on: check the disk and the file",
                self.path,
                doing,
                " ".join(str(err).split()),
            )

    def get(self, key: str) -> Reply | None:
        try:
            with self._lock:
                row = self._db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as err:
            self._failed("a read", err)
            return None
        if row is None:
            return None
        try:
            return Reply.from_json(row[0])
        except (ValueError, KeyError, TypeError, AttributeError):  # a damaged row: asked again, replaced
            return None

    def put(self, key: str, reply: Reply) -> None:
        try:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?)", (key, reply.to_json()))
                self._db.commit()
        except sqlite3.Error as err:
            self._failed("a write", err)

    def get_route(self, key: str) -> tuple[str, str] | None:
        try:
            with self._lock:
                row = self._db.execute("SELECT route, form FROM routes WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as err:
            self._failed("a read", err)
            return None
        return (row[0], row[1]) if row and row[0] in ROUTES and row[1] in PROMPT_FORMATS else None

    def put_route(self, key: str, route: str, form: str) -> None:
        try:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO routes VALUES (?, ?, ?)", (key, route, form))
                self._db.commit()
        except sqlite3.Error as err:
            self._failed("a write", err)


class _Retryable(Exception):
    """A failure worth another try (429, 5xx, timeout, dropped connection); ``wait_s`` from Retry-After."""

    def __init__(self, message: str, wait_s: float | None = None):
        super().__init__(message)
        self.wait_s = wait_s


class _Endpoint:
    """What a client of an OpenAI-compatible server does before and around each request: check the server
    serves the model (:meth:`connect`), the headers, one POST with its timeout, and the retries with backoff
    (:meth:`_retrying`). The served judge's :class:`ServedClient` and the routed model's
    :class:`ChatClient` share it; a class using it has ``cfg`` (an :class:`EndpointConfig`), ``api_key``,
    ``info``, ``calls`` and ``retries``."""

    cfg: EndpointConfig
    api_key: str
    info: dict[str, Any]
    calls: int
    retries: int

    @property
    def root(self) -> str:
        return self.cfg.base_url.rstrip("/").removesuffix("/v1")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # --- before any judging --------------------------------------------------------------------
    def connect(self) -> dict[str, Any]:
        """Check the server serves ``cfg.model`` and record what it says of itself; one-line errors.

        Raises:
            ServerSetupError: no server at ``base_url``, a refused key, an answer that is not a model list,
                or a model the server does not serve.
        """
        import httpx

        try:
            r = httpx.get(
                f"{self.root}/v1/models",
                headers=self._headers(),
                timeout=min(self.cfg.timeout_s, 10),
                verify=_tls_context(),
            )
        except httpx.HTTPError as err:
            raise ServerSetupError(
                f"{self.cfg.SECTION}.base_url={self.cfg.base_url!r}: no server answers ({type(err).__name__}: "
                f"{_one_line(str(err))}); start it (docs/served.md) or fix the URL"
            ) from None
        if r.status_code in (401, 403):
            raise ServerSetupError(
                f"{self.cfg.SECTION}.base_url={self.cfg.base_url!r} refused the API key (HTTP {r.status_code}); set "
                f"the key in ${self.cfg.api_key_env or self.cfg.SECTION + '.api_key_env'}"
            )
        if r.status_code != 200:
            raise ServerSetupError(
                f"{self.cfg.SECTION}.base_url={self.cfg.base_url!r}: {self.root}/v1/models answered HTTP "
                f"{r.status_code} ({_one_line(r.text)}); point base_url at an OpenAI-compatible server"
            )
        models = _model_list(r)
        if models is None:
            raise ServerSetupError(
                f"{self.cfg.SECTION}.base_url={self.cfg.base_url!r}: {self.root}/v1/models answered something that is "
                f"not an OpenAI model list ({_one_line(r.text)}); point base_url at an OpenAI-compatible server"
            )
        served = [m["id"] for m in models]
        if self.cfg.model not in served:
            raise ServerSetupError(
                f"{self.cfg.SECTION}.model={self.cfg.model!r} is not served at {self.cfg.base_url} (it serves "
                f"{served[:20]}); set {self.cfg.SECTION}.model to one of them"
            )
        entry = next(m for m in models if m["id"] == self.cfg.model)
        self.info = {"model": self.cfg.model, "served_models": served}
        for path in ("/version", "/get_server_info"):
            try:
                v = httpx.get(f"{self.root}{path}", headers=self._headers(), timeout=5, verify=_tls_context())
                if v.status_code == 200:
                    self.info["version"] = v.json()
                    break
            except (httpx.HTTPError, ValueError):
                continue
        # what the server says of the model and its limits, where it says it (vLLM's model card has
        # max_model_len; no server names its log-probability limit in one place: None is "not reported")
        version = self.info.get("version")
        sources = [entry, version if isinstance(version, dict) else {}]
        for key in ("max_model_len", "max_logprobs"):
            self.info[key] = next((d[key] for d in sources if d.get(key) is not None), None)
        return self.info

    async def _http_post(self, http: Any, path: str, body: dict[str, Any]) -> Any:
        """One POST of ``body`` to ``path`` under ``cfg.timeout_s``; the response (any status but 429 and
        5xx), or :class:`_Retryable` for a 429, a 5xx, a timeout or a dropped connection."""
        import httpx

        try:
            # httpx's timeout bounds each read; wait_for bounds the whole answer (a reply that trickles in)
            r = await asyncio.wait_for(
                http.post(self.root + path, json=body, headers=self._headers(), timeout=self.cfg.timeout_s),
                self.cfg.timeout_s,
            )
        except TimeoutError:
            raise _Retryable(
                f"no whole answer within {self.cfg.SECTION}.timeout_s={self.cfg.timeout_s}"
            ) from None
        except (httpx.TimeoutException, httpx.TransportError) as err:
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        if r.status_code == 429:
            raise _Retryable("HTTP 429", self._retry_after(r.headers.get("retry-after")))
        if r.status_code >= 500:
            raise _Retryable(f"HTTP {r.status_code}: {_one_line(r.text, 120)}")
        return r

    def _retry_after(self, value: str | None) -> float | None:
        """The wait a 429's ``Retry-After`` asks (seconds or an HTTP date), at most ``timeout_s`` so no
        answer holds a call longer than the settings allow; ``None`` (the backoff) when it is unreadable."""
        if not value:
            return None
        try:
            wait = float(value)
        except ValueError:
            from email.utils import parsedate_to_datetime

            try:
                wait = parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError, IndexError, OverflowError):
                return None
        if not math.isfinite(wait):
            return None
        return min(max(wait, 0.0), self.cfg.timeout_s)

    async def _retrying(
        self,
        gate: asyncio.Semaphore,
        limiter: _RateLimiter,
        n_tokens: int,
        once: Callable[[], Awaitable[T]],
        failed: Callable[[str], T],
    ) -> T:
        """``once()`` under the concurrency gate and the rate limits, retried after a :class:`_Retryable`
        up to ``cfg.max_retries`` times (backoff doubling from ``cfg.backoff_s``, or the 429's wait);
        ``failed(why)`` when the retries run out."""
        error = ""
        for attempt in range(self.cfg.max_retries + 1):
            async with gate:
                await limiter.wait(n_tokens)
                self.calls += 1
                try:
                    return await once()
                except _Retryable as err:
                    error, wait = str(err), err.wait_s
            if attempt < self.cfg.max_retries:
                self.retries += 1
                await asyncio.sleep(wait if wait is not None else self.cfg.backoff_s * 2**attempt)
        return failed(f"{error} (after {self.cfg.max_retries} retries)")


@dataclass
class ServedClient(_Endpoint):
    """Asks a server for verdict-token log-probabilities (see the module docstring for the routes).

    Args:
        cfg: the ``judge.server`` settings.
        verdict_ids: the two verdict token ids (of the model's tokenizer).
        api_key: the key read from ``cfg.api_key_env`` (kept in memory only).
        detokenize: token ids -> text, for ``prompt_format`` ``text`` (the served model's tokenizer).
    """

    cfg: ServerConfig
    verdict_ids: tuple[int, int]
    api_key: str = ""
    detokenize: Callable[[Sequence[int]], str] | None = None
    route: str = ""
    prompt_format: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    retries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    def __post_init__(self) -> None:
        self.route = "" if self.cfg.route == "auto" else self.cfg.route
        # auto: probed with the route (route: auto); ids with a route asked for, or nothing to decode with
        fmt: str = self.cfg.prompt_format
        if fmt == "auto":
            fmt = "" if not self.route and self.detokenize is not None else "ids"
        if fmt == "text" and self.detokenize is None:
            raise ValueError("judge.server.prompt_format=text needs the served model's tokenizer to decode")
        self.prompt_format = fmt
        self._limiter = _RateLimiter(self.cfg.max_requests_per_minute, self.cfg.max_tokens_per_minute)
        self._cache = _ReplyCache(self.cfg.cache_path) if self.cfg.cache_path else None
        # route: auto: the route read back from the cache, used until a probe of this run confirms it
        self._recalled = False
        self._sglang_decisions = False  # route decisions: SGLang's request shape (found on the first 4xx)
        self._route_key_format = self.prompt_format  # what a probe starts from ('' : ids, then text)
        what = [self.root, self.cfg.model, self.prompt_format, list(self.verdict_ids), self.cfg.top_logprobs]
        self._route_key = hashlib.sha256(json.dumps(what).encode()).hexdigest()

    # --- requests ------------------------------------------------------------------------------
    def _request(
        self, route: str, ids: Sequence[int], form: str = "ids", start: int | None = None
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one greedy next-token request on ``route``, the prompt sent as ``form``; with
        ``start``, a request of the prompt tokens' log-probabilities from ``start`` on."""
        prompt: Any = list(ids) if form == "ids" else self.detokenize(ids)  # type: ignore[misc]
        if start is not None:
            if route not in PROMPT_ROUTES:
                raise ValueError(
                    f"route {route!r} returns no prompt log-probabilities; use {list(PROMPT_ROUTES)}"
                )
            if route == "sglang":
                return "/generate", {
                    ("input_ids" if form == "ids" else "text"): prompt,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "return_logprob": True,
                    # SGLang pads the first returned entry with None: start one token early; the prefix
                    # before it stays eligible for the radix cache
                    "logprob_start_len": start - 1,
                }
            # prompt_logprobs: 0 returns each prompt token's own log-probability (no top-k beside it)
            return "/v1/completions", {
                "model": self.cfg.model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            }
        if route == "sglang":
            return "/generate", {
                ("input_ids" if form == "ids" else "text"): prompt,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "token_ids_logprob": list(self.verdict_ids),
                "logprob_start_len": -1,
            }
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if route == "vllm":
            body.update(logprobs=1, logprob_token_ids=list(self.verdict_ids), return_tokens_as_token_ids=True)
        elif route == "top_logprobs":
            body.update(logprobs=self.cfg.top_logprobs, return_tokens_as_token_ids=True)
        return "/v1/completions", body

    def _parse(
        self,
        route: str,
        data: dict[str, Any],
        token_ids: dict[str, int],
        ids: Sequence[int] = (),
        start: int | None = None,
    ) -> Reply:
        """The :class:`Reply` in a server's JSON answer on ``route`` (``KeyError``/``TypeError`` if malformed);
        with ``start``, the prompt log-probabilities of ``ids[start:]``."""
        if start is not None:
            return _parse_prompt_logprobs(route, data, ids, start)
        if route == "sglang":
            meta = data["meta_info"]
            entries = (meta.get("output_token_ids_logprobs") or [None])[0]
            n = meta.get("prompt_tokens")
            if not entries:
                return _no_logprobs(route)
            return Reply({int(e[1]): _logprob(e[0]) for e in entries}, None, data.get("text", ""), n_prompt=n)
        choice = data["choices"][0]
        text = choice.get("text", "")
        n = (data.get("usage") or {}).get("prompt_tokens")
        if route == "text":
            return Reply(None, None, text, n_prompt=n)
        tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
        if not tops or not tops[0]:
            return _no_logprobs(route)
        out: dict[int, float] = {}
        for key, value in tops[0].items():
            tid = int(key[9:]) if key.startswith("token_id:") else token_ids.get(key)
            if tid is not None:
                out[tid] = _logprob(value)
        bound = min(_logprob(v) for v in tops[0].values()) if route == "top_logprobs" else None
        return Reply(out, bound, text, n_prompt=n)

    async def _post_once(
        self,
        http: Any,
        route: str,
        ids: Sequence[int],
        token_ids: dict[str, int],
        form: str,
        start: int | None = None,
    ) -> Reply:
        path, body = self._request(route, ids, form, start)
        r = await self._http_post(http, path, body)
        if r.status_code != 200:
            return Reply(error=f"HTTP {r.status_code}: {_one_line(r.text)}")
        try:
            reply = self._parse(route, r.json(), token_ids, ids, start)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise _Retryable(f"malformed reply ({type(err).__name__}: {_one_line(str(err), 120)})") from None
        if form == "text" and reply.n_prompt is not None and reply.n_prompt != len(ids):
            # the server tokenized the text otherwise: its log-probabilities are of another prompt
            return Reply(
                error=f"the server read the prompt text as {reply.n_prompt} tokens, not the {len(ids)} sent"
            )
        return reply

    async def _post(
        self,
        http: Any,
        gate: asyncio.Semaphore,
        limiter: _RateLimiter,
        route: str,
        ids: Sequence[int],
        token_ids: dict[str, int],
        form: str = "",
        start: int | None = None,
        question: Question | None = None,
    ) -> Reply:
        """One request with its retries; a reply whose ``error`` says why when they run out. On a group
        route, a request of this prompt alone."""
        if route in GROUP_ROUTES:
            return (await self._post_group(http, gate, limiter, route, [ids], [question], form))[0]

        async def send() -> Reply:
            return await self._post_once(http, route, ids, token_ids, form or self.prompt_format, start)

        return await self._retrying(gate, limiter, len(ids), send, lambda error: Reply(error=error))

    async def _post_group(
        self,
        http: Any,
        gate: asyncio.Semaphore,
        limiter: _RateLimiter,
        route: str,
        prompts: Sequence[Sequence[int]],
        questions: Sequence[Question | None],
        form: str = "",
    ) -> list[Reply]:
        """The replies to ``prompts`` on a group route: one request per label (``generative_scoring``) or per
        article (the decision routes), each with its retries; a request that fails fails its prompts."""
        out: list[Reply] = [Reply(error="not asked")] * len(prompts)
        if route == "generative_scoring":
            if (form or self.prompt_format) == "text":
                return [
                    Reply(
                        error="route 'generative_scoring' takes token ids; set judge.server.prompt_format=ids"
                    )
                ] * len(prompts)
            jobs = [
                list(range(i, min(i + MAX_GROUP, len(prompts)))) for i in range(0, len(prompts), MAX_GROUP)
            ]
        else:
            if any(q is None for q in questions):
                return [
                    Reply(
                        error=f"route {route!r} takes the pairwise choice judge's questions only (judge.extractor: verdict)"
                    )
                ] * len(prompts)
            by_state: dict[str, list[int]] = {}
            for i, q in enumerate(questions):
                by_state.setdefault(q.state, []).append(i)  # type: ignore[union-attr]
            jobs = [m[j : j + MAX_GROUP] for m in by_state.values() for j in range(0, len(m), MAX_GROUP)]

        async def one(members: list[int]) -> None:
            tokens = sum(len(prompts[i]) for i in members)
            if route == "generative_scoring":
                labels = list(self.verdict_ids)

                async def ask(label: int) -> list[float]:
                    return await self._retrying(
                        gate,
                        limiter,
                        tokens,
                        lambda: self._send_scoring(http, [prompts[i] for i in members], label),
                        lambda error: error,
                    )

                answers = await asyncio.gather(*(ask(t) for t in labels))
                bad = next((a for a in answers if isinstance(a, str)), None)
                for k, i in enumerate(members):
                    out[i] = (
                        Reply(error=bad)
                        if bad is not None
                        else Reply(
                            {t: a[k] for t, a in zip(labels, answers)}, None, "", n_prompt=len(prompts[i])
                        )
                    )
                return
            got = await self._retrying(
                gate,
                limiter,
                tokens,
                lambda: self._send_decisions(http, route, [questions[i] for i in members]),  # type: ignore[misc]
                lambda error: error,
            )
            for k, i in enumerate(members):
                out[i] = Reply(error=got) if isinstance(got, str) else got[k]

        await asyncio.gather(*(one(m) for m in jobs))
        return out

    async def _send(self, http: Any, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``path``; the JSON answer, or :class:`_Retryable` / a ``str`` error (final)."""
        r = await self._http_post(http, path, body)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {_one_line(r.text)}"
        try:
            return r.json()
        except ValueError as err:
            raise _Retryable(f"malformed reply (not JSON: {_one_line(str(err), 120)})") from None

    async def _send_scoring(
        self, http: Any, prompts: Sequence[Sequence[int]], label: int
    ) -> list[float] | str:
        """``log P(label | prompt)`` for each prompt, from one ``/generative_scoring`` request: the prompts'
        common prefix as the ``query``, the rest of each as its item (at least one token)."""
        n = min(len(p) for p in prompts) - 1
        prefix = 0
        while prefix < n and all(p[prefix] == prompts[0][prefix] for p in prompts):
            prefix += 1
        body = {
            "model": self.cfg.model,
            "query": list(prompts[0][:prefix]),
            "items": [list(p[prefix:]) for p in prompts],
            "label_token_ids": [label],
            "apply_softmax": False,  # the full-vocabulary probability, not one renormalized over the labels
            "add_special_tokens": False,
        }
        data = await self._send(http, "/generative_scoring", body)
        if isinstance(data, str):
            return data
        try:
            rows = sorted(data["data"], key=lambda d: int(d["index"]))
            if [int(d["index"]) for d in rows] != list(range(len(prompts))):
                raise ValueError(f"{len(rows)} scores for {len(prompts)} items")
            used = (data.get("usage") or {}).get("prompt_tokens")
            scores = [float(d["score"]) for d in rows]
            if any(not (0.0 < p <= 1.0 + 1e-6) for p in scores):
                raise ValueError(f"a probability outside (0, 1] in {scores[:4]}")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _Retryable(f"malformed reply ({type(err).__name__}: {_one_line(str(err), 120)})") from None
        if used is not None and used != sum(len(p) for p in prompts):
            # the server cut a prompt (to --max-model-len): its probabilities are of another prompt
            return (
                f"the server scored {used} prompt tokens, not the {sum(len(p) for p in prompts)} sent (a prompt "
                "longer than its --max-model-len is cut); lower judge.max_length"
            )
        return [min(math.log(p), 0.0) for p in scores]

    async def _send_decisions(
        self, http: Any, route: str, questions: Sequence[Question]
    ) -> list[Reply] | str:
        """One decision request carrying ``questions`` (one ``state``); a reply per question whose
        ``logprobs`` are ``log(p_option * label_mass)`` under the verdict ids (A, B in option order)."""
        path, body = decision_request(route, self.cfg.model, questions)
        if route == "decisions" and self._sglang_decisions:
            body = sglang_decision_request(self.cfg.model, questions)
        data = await self._send(http, path, body)
        if (
            isinstance(data, str)
            and route == "decisions"
            and not self._sglang_decisions
            and data.startswith(("HTTP 400", "HTTP 422"))
        ):
            # SGLang's /v1/decisions refuses OpenAI's shape: its own, and kept for the run
            data = await self._send(http, path, sglang_decision_request(self.cfg.model, questions))
            self._sglang_decisions = not isinstance(data, str)
        if isinstance(data, str):
            return data
        try:
            found = parse_decisions(route, data, questions)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise _Retryable(f"malformed reply ({type(err).__name__}: {_one_line(str(err), 120)})") from None
        out = []
        for probs, mass in found:
            if mass <= 0.0:
                out.append(Reply(error=f"route {route!r}: a label_mass of {mass}"))
                continue
            lp = {t: (math.log(p * mass) if p > 0 else -math.inf) for t, p in zip(self.verdict_ids, probs)}
            if any(not math.isfinite(v) for v in lp.values()):
                out.append(Reply(error=f"route {route!r}: an option with probability 0"))
                continue
            out.append(Reply({t: min(v, 0.0) for t, v in lp.items()}, None, ""))
        return out

    def _key(self, route: str, ids: Sequence[int], start: int | None = None) -> str:
        # a text prompt is tokenized by the server: kept apart from the same ids sent as ids; the top k
        # decides which tokens a top_logprobs reply holds and its bound
        tag = route if self.prompt_format != "text" else f"{route}+text"
        if route == "top_logprobs":
            tag += f"@{self.cfg.top_logprobs}"
        what: list[Any] = list(self.verdict_ids) if start is None else ["prompt_logprobs", start]
        raw = json.dumps([self.root, self.cfg.model, tag, what, list(ids)])
        return hashlib.sha256(raw.encode()).hexdigest()

    async def _many(
        self,
        prompts: Sequence[Sequence[int]],
        token_ids: dict[str, int],
        starts: Sequence[int | None] | None = None,
        questions: Sequence[Question | None] | None = None,
    ) -> list[Reply]:
        import httpx

        gate = asyncio.Semaphore(self.cfg.concurrency)
        limiter = self._limiter
        limits = httpx.Limits(max_connections=self.cfg.concurrency)
        at = list(starts) if starts is not None else [None] * len(prompts)
        qs = list(questions) if questions is not None else [None] * len(prompts)
        first: Reply | None = None
        async with _async_client(limits) as http:
            if not self.route:
                self.route, self.prompt_format, first = await self._probe(
                    http, gate, limiter, prompts[0], token_ids, qs[0]
                )
            # the probe's answer is the first prompt's judgement
            done = [first] if first is not None and at[0] is None else []
            k = len(done)
            if self.route in GROUP_ROUTES and all(s is None for s in at):
                return [*done, *await self._post_group(http, gate, limiter, self.route, prompts[k:], qs[k:])]
            rest = await asyncio.gather(
                *(
                    self._post(http, gate, limiter, self.route, p, token_ids, "", s, q)
                    for p, s, q in zip(prompts[k:], at[k:], qs[k:])
                )
            )
            return [*done, *rest]

    def find_prompt_route(self, ids: Sequence[int], start: int) -> None:
        """Find (``route: auto``) or check (a named route) the route and prompt format on which this server
        returns the log-probabilities of ``ids[start:]``, before any judging.

        Raises:
            ServerSetupError: one line naming the routes tried, the last answer and the fix, when none returns
                them (a server that returns no prompt log-probabilities: the likelihood has no text fallback).
        """
        route, form, last = _run(self._probe_prompt(ids, start))
        if not route:
            tried = [self.cfg.route] if self.cfg.route != "auto" else list(PROMPT_ROUTES)
            raise ServerSetupError(
                f"judge.extractor=likelihood needs prompt log-probabilities, and {self.cfg.base_url} returned none "
                f"on route {tried} ({last}); serve the model with vLLM (/v1/completions with prompt_logprobs) or "
                "SGLang (/generate with logprob_start_len) and set judge.server.route to auto, vllm or sglang"
            )
        self.route, self.prompt_format = route, form

    async def _probe_prompt(self, ids: Sequence[int], start: int) -> tuple[str, str, str]:
        """``(route, prompt format, '')`` of the first route returning prompt log-probabilities (ids before
        text), or ``('', '', what the last try answered)``."""

        gate, limiter = asyncio.Semaphore(1), _RateLimiter(0, 0)
        routes = [self.cfg.route] if self.cfg.route != "auto" else list(PROMPT_ROUTES)
        forms = [self.prompt_format] if self.prompt_format else list(PROMPT_FORMATS)
        last = "nothing tried"
        saved, self.cfg.max_retries = self.cfg.max_retries, 0  # a route the server lacks answers at once
        try:
            async with _async_client() as http:
                for form in forms:
                    for route in routes:
                        if route not in PROMPT_ROUTES:
                            last = f"route {route!r} has no prompt log-probabilities"
                            continue
                        reply = await self._post(http, gate, limiter, route, ids, {}, form, start)
                        if not reply.error and reply.prompt_logprobs is not None:
                            return route, form, ""
                        last = reply.error or f"{route}: a reply without prompt log-probabilities"
        finally:
            self.cfg.max_retries = saved
        return "", "", " ".join(last.split())[:160]

    async def _probe(
        self,
        http: Any,
        gate: asyncio.Semaphore,
        limiter: _RateLimiter,
        ids: Sequence[int],
        token_ids: dict[str, int],
        question: Question | None = None,
    ) -> tuple[str, str, Reply | None]:
        """``(route, prompt format, reply)``: the best this server answers for ``ids`` (or ``question`` on
        the decision routes) and its answer there (the judgement of ``ids``, so it is not asked twice), the
        route ``text`` and no reply when none returns log-probabilities; ids before text."""
        tries = [(r, f) for f in PROMPT_FORMATS for r in ROUTES[:-1]] + [("text", f) for f in PROMPT_FORMATS]
        for route, form in tries:
            if self.prompt_format and form != self.prompt_format:
                continue
            if (route in GROUP_ROUTES and form == "text") or (route in QUESTION_ROUTES and question is None):
                continue  # generative_scoring takes ids; the decision routes a question (of the verdict)
            saved = self.cfg.max_retries
            self.cfg.max_retries = 0  # a route the server lacks answers 4xx/5xx at once
            try:
                reply = await self._post(http, gate, limiter, route, ids, token_ids, form, None, question)
            finally:
                self.cfg.max_retries = saved
            if reply.error or (route != "text" and reply.logprobs is None):
                continue
            if route in ("top_logprobs", "text") or all(
                t in (reply.logprobs or {}) for t in self.verdict_ids
            ):
                return route, form, reply
        return "text", self.prompt_format or "ids", None

    def replies(
        self,
        prompts: Sequence[Sequence[int]],
        token_ids: dict[str, int],
        starts: Sequence[int] | None = None,
        questions: Sequence[Question] | None = None,
    ) -> list[Reply]:
        """Replies to ``prompts`` (token id lists), all in flight together, in order; cached ones are
        read from the cache, successful new ones written to it. ``token_ids``: token string -> id, for
        servers that key ``top_logprobs`` by token text. ``starts``: ask each prompt's own tokens'
        log-probabilities from ``starts[i]`` on (:attr:`Reply.prompt_logprobs`) instead of the next
        token's (call :meth:`find_prompt_route` first). ``questions``: each prompt as a decision route
        asks it (the pairwise verdict only; without them those routes are not used).

        Under ``route: auto`` with a cache, the route found on an earlier run is read back from it, so
        judgements already cached are read without a request; the first request of the run probes the
        server again (its answer is kept as a judgement), and if the server now answers on another route
        the cached judgements of this call are asked again on it (a run never mixes two routes)."""
        at: list[int | None] = list(starts) if starts is not None else [None] * len(prompts)
        if not self.route and self._cache is not None:
            recalled = self._cache.get_route(self._route_key)
            if recalled is not None:
                self.route, self.prompt_format = recalled
                self._recalled = True
        out: list[Reply | None] = [None] * len(prompts)
        todo = self._lookup(prompts, at, out)
        if todo:
            recalled = (self.route, self.prompt_format)
            if self._recalled:  # not confirmed this run: the first request probes the server
                self.route, self.prompt_format = "", self._route_key_format
            probed = not self.route
            self._ask(prompts, token_ids, at, todo, out, questions)
            answered = any(out[i] is not None and not out[i].error for i in todo)  # type: ignore[union-attr]
            if probed and not answered:
                # a probe of a server that answered nothing found no route (it fell to text): probe again
                # next call, and keep the cached judgements and the route they came from
                self.route, self.prompt_format = recalled
            elif self._recalled:
                self._recalled = False
                if (self.route, self.prompt_format) != recalled:
                    asked = set(todo)
                    hits = [i for i in range(len(prompts)) if i not in asked]
                    logger.warning(
                        "served judge: %s now answers on route %r (%s prompts), not the %r (%s) its cached "
                        "judgements came from; asking the %d of this call again",
                        self.cfg.base_url,
                        self.route,
                        self.prompt_format,
                        *recalled,
                        len(hits),
                    )
                    self.cache_hits -= len(hits)
                    again = self._lookup(prompts, at, out, hits)
                    if again:
                        self._ask(prompts, token_ids, at, again, out, questions)
            if self._cache is not None and self.cfg.route == "auto" and answered:
                # remembered for the next run (a route found while the server failed every call is not)
                self._cache.put_route(self._route_key, self.route, self.prompt_format)
        return [r for r in out if r is not None]

    def _lookup(
        self,
        prompts: Sequence[Sequence[int]],
        at: Sequence[int | None],
        out: list[Reply | None],
        among: Sequence[int] | None = None,
    ) -> list[int]:
        """Fill ``out`` from the cache on the current route (all prompts, or those ``among``); the indices
        still to ask. Without a route yet (``route: auto`` before its probe) nothing is looked up."""
        todo = []
        for i in range(len(prompts)) if among is None else among:
            hit = (
                self._cache.get(self._key(self.route, prompts[i], at[i]))
                if self._cache is not None and self.route
                else None
            )
            if hit is not None:
                out[i] = hit
                self.cache_hits += 1
            else:
                out[i] = None
                todo.append(i)
                self.cache_misses += self._cache is not None
        return todo

    def _ask(
        self,
        prompts: Sequence[Sequence[int]],
        token_ids: dict[str, int],
        at: Sequence[int | None],
        todo: Sequence[int],
        out: list[Reply | None],
        questions: Sequence[Question] | None = None,
    ) -> None:
        """Ask the server the prompts ``todo`` (probing the route first when there is none yet); successful
        replies go to ``out`` and the cache."""
        qs = None if questions is None else [questions[i] for i in todo]
        new = _run(self._many([prompts[i] for i in todo], token_ids, [at[i] for i in todo], qs))
        for i, reply in zip(todo, new):
            out[i] = reply
            if self._cache is not None and not reply.error:
                self._cache.put(self._key(self.route, prompts[i], at[i]), reply)


@dataclass
class Completion:
    """One chat completion's answer.

    Attributes:
        text: the assistant message's content.
        prompt_tokens, completion_tokens: the server's counts (``usage``); ``None`` where it gives none.
        token_logprobs: ``(token text, log-probability)`` of each generated token, when asked and given.
        seconds: the wall time of the call's attempts (not the wait for a free slot, nor the backoff).
        error: why the call failed after its retries (empty: it did not).
    """

    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_logprobs: list[tuple[str, float]] | None = None
    seconds: float = 0.0
    error: str = ""


@dataclass
class ChatClient(_Endpoint):
    """Greedy chat completions (``POST /v1/chat/completions``, temperature 0) from an OpenAI-compatible
    server: vLLM, llama.cpp, SGLang, or a hosted API. The routed model of ``judgeloop route`` with
    ``model.type: served``; it shares the served judge's connection check, timeouts, retries and rate
    limits (:class:`_Endpoint`).

    Args:
        cfg: the server's settings (``model.server``).
        api_key: the key read from ``cfg.api_key_env`` (kept in memory only).
    """

    cfg: EndpointConfig
    api_key: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self._limiter = _RateLimiter(self.cfg.max_requests_per_minute, self.cfg.max_tokens_per_minute)

    def complete(self, prompts: Sequence[str], max_tokens: int, logprobs: bool = False) -> list[Completion]:
        """One single-turn completion per user message in ``prompts``, all in flight together (up to
        ``cfg.concurrency``), in order. ``logprobs``: ask each generated token's log-probability. A call
        that still fails after its retries is a :class:`Completion` with ``error`` set."""
        return list(_run(self._many(prompts, max_tokens, logprobs)))

    async def _many(self, prompts: Sequence[str], max_tokens: int, logprobs: bool) -> list[Completion]:
        import httpx

        gate = asyncio.Semaphore(self.cfg.concurrency)
        async with _async_client(httpx.Limits(max_connections=self.cfg.concurrency)) as http:
            return list(
                await asyncio.gather(*(self._one(http, gate, p, max_tokens, logprobs) for p in prompts))
            )

    async def _one(
        self, http: Any, gate: asyncio.Semaphore, prompt: str, max_tokens: int, logprobs: bool
    ) -> Completion:
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if logprobs:
            body["logprobs"] = True
        spent = [0.0]  # the attempts' own time, not the wait for a free slot under cfg.concurrency

        async def once() -> Completion:
            t0 = time.perf_counter()
            try:
                r = await self._http_post(http, "/v1/chat/completions", body)
            finally:
                spent[0] += time.perf_counter() - t0
            if r.status_code != 200:
                return Completion(error=f"HTTP {r.status_code}: {_one_line(r.text)}")
            try:
                return _parse_chat(r.json(), logprobs)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                raise _Retryable(
                    f"malformed reply ({type(err).__name__}: {_one_line(str(err), 120)})"
                ) from None

        # the rate limiter counts prompt tokens; a chat prompt's are not known before the server says:
        # its length in characters / 4 stands in for them
        out = await self._retrying(
            gate, self._limiter, len(prompt) // 4 + 1, once, lambda why: Completion(error=why)
        )
        out.seconds = spent[0]
        return out


def _parse_chat(data: dict[str, Any], logprobs: bool) -> Completion:
    """The :class:`Completion` in an OpenAI chat answer (``choices[0].message.content``, ``usage``,
    ``choices[0].logprobs.content[i].{token, logprob}``); an error when log-probabilities were asked and
    the server gave none (never a confidence from nothing)."""
    choice = data["choices"][0]
    text = choice["message"].get("content") or ""
    if not isinstance(text, str):
        raise TypeError(f"message content {text!r} is not a string")
    usage = data.get("usage") or {}
    out = Completion(text, usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if logprobs:
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            return Completion(
                error="the server returned no token log-probabilities for the chat completion; route on "
                "router.confidence=verbalized, or serve the model where chat logprobs are returned"
            )
        out.token_logprobs = [(str(e["token"]), _logprob(e["logprob"])) for e in content]
    return out


def _logprob(value: Any) -> float:
    """``value`` as a log-probability: a finite number <= 0 (a little above 0 is rounding); a ``ValueError``
    (a malformed reply) otherwise, never a NaN or a positive score passed on as a judgement."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a log-probability {value!r} that is not a number")
    if not math.isfinite(value) or value > 1e-3:
        raise ValueError(f"a log-probability {value!r} that is not a finite number <= 0")
    return float(value)


def label_mass(reply: Reply, ids: Sequence[int]) -> float | None:
    """The share of the next-token probability on the labels ``ids`` (the verdict or grade tokens): the sum
    of their probabilities, when the reply holds each one's exact full-vocabulary log-probability (every
    route but ``text`` and a ``top_logprobs`` reply missing one); ``None`` otherwise."""
    if reply.error or reply.logprobs is None or any(t not in reply.logprobs for t in ids):
        return None
    return math.fsum(math.exp(reply.logprobs[t]) for t in ids)


def _no_logprobs(route: str) -> Reply:
    """The reply to a request on a log-probability route that came back without them: ``failed`` (not
    retried: the server answers so), never the sampled text scored as a hard verdict."""
    return Reply(
        error=f"the server returned no log-probabilities on route {route!r}; set judge.server.route=auto to find "
        "the route it answers"
    )


def _parse_prompt_logprobs(route: str, data: dict[str, Any], ids: Sequence[int], start: int) -> Reply:
    """The log-probabilities of ``ids[start:]`` in a ``vllm`` or ``sglang`` answer (see the module
    docstring); a reply with ``error`` set when the server's prompt tokens are not ``ids``."""
    if route == "sglang":
        meta = data["meta_info"]
        n = meta.get("prompt_tokens")
        entries = meta.get("input_token_logprobs")
        if not entries:
            return Reply(None, None, data.get("text", ""), n_prompt=n)
        got = [int(e[1]) for e in entries]
        values = [e[0] for e in entries[1:]]  # entries[0] is ids[start - 1], its logprob None
        want = list(ids[start - 1 :])
    else:
        choice = data["choices"][0]
        n = (data.get("usage") or {}).get("prompt_tokens")
        rows = choice.get("prompt_logprobs")
        if not rows:
            return Reply(None, None, choice.get("text", ""), n_prompt=n)
        want = list(ids[start:])
        got, values = [], []
        for tid, row in zip(want, rows[start:]):
            entry = (row or {}).get(str(tid))
            got.append(tid if entry is not None else -1)
            values.append(None if entry is None else entry["logprob"])
        if len(rows) != len(ids):
            got.append(-1)
    if got != want or any(v is None for v in values):
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        return Reply(
            error=f"the server's prompt tokens differ from the ids sent (from position {bad} of the scored "
            "span): its tokenizer or prompt handling is not the judge's"
        )
    return Reply(None, None, "", n_prompt=n, prompt_logprobs=[_logprob(v) for v in values])


def decision_request(route: str, model: str, questions: Sequence[Question]) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one decision request asking ``questions`` (one ``state``) as choice questions.

    * ``systemone`` (vLLM 0.32, ``vllm/entrypoints/generate/structured_decisions/protocol.py``): ``state``,
      ``questions`` as a map id -> ``{type: choice, instructions, criteria: {option: null}}``;
    * ``decisions`` (OpenAI's Decisions shape, vLLM 0.33 ``entrypoints/openai/decisions/protocol.py``):
      ``input``, ``questions`` as a list of ``{type: choice, name, instructions, choices: [{value}]}``.
    """
    state = questions[0].state
    if route == "systemone":
        return "/v1/systemone", {
            "model": model,
            "state": state,
            "questions": {
                f"q{i}": {
                    "type": "choice",
                    "instructions": q.instructions,
                    "criteria": dict.fromkeys(q.options),
                }
                for i, q in enumerate(questions)
            },
        }
    return "/v1/decisions", {
        "model": model,
        "input": state,
        "questions": [
            {
                "type": "choice",
                "name": f"q{i}",
                "instructions": q.instructions,
                "choices": [{"value": o} for o in q.options],
            }
            for i, q in enumerate(questions)
        ],
    }


def sglang_decision_request(model: str, questions: Sequence[Question]) -> dict[str, Any]:
    """The body of SGLang 0.5's ``/v1/decisions`` (``srt/entrypoints/openai/protocol.py`` ``DecisionRequest``:
    ``input``, ``questions`` as a list of ``{id, type: choice, question, options: [{name}]}``), which refuses
    OpenAI's shape (its models forbid extra fields): sent when that shape is answered with a 4xx."""
    return {
        "model": model,
        "input": questions[0].state,
        "questions": [
            {
                "id": f"q{i}",
                "type": "choice",
                "question": q.instructions,
                "options": [{"name": o} for o in q.options],
            }
            for i, q in enumerate(questions)
        ],
    }


def parse_decisions(
    route: str, data: dict[str, Any], questions: Sequence[Question]
) -> list[tuple[list[float], float]]:
    """``(probabilities of the options in order, label_mass)`` per question of a decision answer.

    ``label_mass`` (the labels' share of the next-token probability) is the answer's own where it has one
    (SGLang's answers, vLLM 0.32's ``diagnostics``); OpenAI's shape has none, and it is read back from
    ``confidence``, which vLLM 0.33 computes as the top option's probability times the label mass.
    A ``ValueError``/``KeyError``/``TypeError`` for an answer of another shape."""
    answers = data["answers"]
    out = []
    for i, q in enumerate(questions):
        qid = f"q{i}"
        if isinstance(answers, list):  # OpenAI's shape: in request order, probabilities as a list
            a = answers[i]
            if a.get("name") not in (None, qid):
                raise ValueError(f"answer {i} is named {a.get('name')!r}, not {qid!r}")
            table = {str(e["value"]): e["probability"] for e in a["probabilities"]}
        else:
            a = answers[qid]
            table = a["probabilities"]
        probs = [table[o] for o in q.options]
        if "label_mass" in a:
            mass = a["label_mass"]
        elif route == "systemone":
            mass = data["diagnostics"][qid]["label_mass"]
        else:
            mass = a["confidence"] / max(probs)
        values = [*probs, mass]
        if any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 + 1e-6 for v in values
        ):
            raise ValueError(f"a probability or label_mass outside [0, 1] in {values}")
        out.append(([float(p) for p in probs], min(float(mass), 1.0)))
    return out


@functools.cache
def _tls_context() -> Any:
    """The TLS context of every call's HTTP client, built once per process: httpx builds one per client
    (it reads the CA bundle, about 90 ms), and a client lives for one call (one batch of judgements)."""
    import httpx

    return httpx.create_ssl_context()


def _async_client(limits: Any = None) -> Any:
    """An ``httpx.AsyncClient`` for one call, with ``limits`` and the process's TLS context."""
    import httpx

    return httpx.AsyncClient(verify=_tls_context(), **({"limits": limits} if limits is not None else {}))


def _run(coro: Any) -> Any:
    """Run ``coro`` to completion, on a thread of its own when this thread already runs an event loop
    (the judge server calls judges from inside one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(coro)))
    thread.start()
    thread.join()
    return result[0]


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters (a server's error page has many)."""
    return " ".join(text.split())[:limit]


def _model_list(r: Any) -> list[dict[str, Any]] | None:
    """The entries of an OpenAI ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``), each a dict with a
    string ``id``; ``None`` when the answer is not that."""
    try:
        data = r.json()
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(
        isinstance(m, dict) and isinstance(m.get("id"), str) for m in models
    ):
        return None
    return models


def read_api_key(cfg: EndpointConfig) -> str:
    """The key in ``$cfg.api_key_env`` ('' when no variable is named); a one-line error when it is unset."""
    if not cfg.api_key_env:
        return ""
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise ServerSetupError(
            f"{cfg.SECTION}.api_key_env={cfg.api_key_env!r} but ${cfg.api_key_env} is not set; export the key "
            "(it is never written to a config or a saved judge)"
        )
    return key


__all__ = [
    "GROUP_ROUTES",
    "PROMPT_ROUTES",
    "QUESTION_ROUTES",
    "ROUTES",
    "Question",
    "CacheFileError",
    "ChatClient",
    "Completion",
    "EndpointConfig",
    "Reply",
    "ServedClient",
    "ServedJudgeFailed",
    "ServerConfig",
    "ServerSetupError",
    "decision_request",
    "label_mass",
    "parse_decisions",
    "read_api_key",
    "sglang_decision_request",
]
