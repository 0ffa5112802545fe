"""``judgeloop serve-judge --config configs/serve/judge.yaml judge_path=DIR server.port=PORT``: serve a
saved calibrated judge over HTTP (:mod:`judgeloop.serving`).

Routes: ``GET /health``; ``GET /v1/info`` (judge, calibrator, held-out figures, batching stats);
``POST /v1/compare`` (``{"items": [{"prompt", "a", "b"}]}`` -> ``{"p", "logit", "status"}``);
``POST /v1/rewards`` (``{"groups": [{"prompt", "completions"}]}`` -> one reward per completion);
``POST /openrlhf/get_reward`` (OpenRLHF's ``--reward.remote_url``, :mod:`judgeloop.serving.openrlhf`).
``POST /verl/reward`` (one verl response in, its groupwise reward out, :mod:`judgeloop.serving.verl_route`),
posted by :func:`judgeloop.integrations.verl.compute_score`.

``routes.openrlhf`` / ``routes.verl`` (default on) turn those two routes off; a judge that reads references
(``judge.embedding_target=references``, :attr:`~judgeloop.judges.calibrated.CalibratedJudge.needs`) is
refused at start-up while either is on, since neither protocol carries them. ``/v1/compare`` and
``/v1/rewards`` answer an item without the references such a judge reads with a 422.

The judge is loaded, and the token checked, before the port is bound: a folder that is no calibrated
judge stops here with exit status 2. SIGTERM (or Ctrl-C) drains: the server stops accepting connections,
scores the OpenRLHF and verl routes' open groups at once (short ones as they are), lets in-flight requests finish
(at most ``server.drain_timeout_s``; then the unfinished are cancelled and their connections closed),
releases the port and exits with status 0. A second Ctrl-C stops without waiting.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from judgeloop.logging import get_logger
from judgeloop.serving.config import ServeConfig

logger = get_logger(__name__)

__all__ = ["DrainingServer", "ServeConfig", "run"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, calling ``on_drain`` as soon as shutdown begins (before it waits for the
    in-flight requests), so requests parked for a group are answered instead of waiting out their timer."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]):
        super().__init__(config)
        self.on_drain = on_drain

    async def shutdown(self, sockets: Any = None) -> None:
        self.on_drain()
        await super().shutdown(sockets)


@contextlib.contextmanager
def stopped_by_signal() -> Iterator[list[int]]:
    """While inside, SIGTERM / SIGINT reaching this handler are noted in the yielded list, not raised.

    uvicorn catches both signals itself while it serves and, once it has drained, restores the handlers
    it found and raises the signal again, for whatever handler that is. Python's defaults would end the
    process with -15 (SIGTERM) or a KeyboardInterrupt after a clean drain; these note it, so the command
    returns and exits 0. Outside the main thread nothing is installed (signals reach the main one only).
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def note(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_port(host: str, port: int) -> None:
    """Refuse an address that cannot be listened on, with the fix, before the judge serves.

    Raises:
        ConfigError: the port is taken, or the host is no address of this machine.
    """
    import socket

    from judgeloop.config import ConfigError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as uvicorn binds: the closed connections of a server stopped a moment ago (TIME_WAIT) do not
        # keep a restart off the port; a socket still listening there does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError as err:
            raise ConfigError(
                f"server.host={host} server.port={port} cannot be listened on ({err.strerror}); choose a free "
                "port (server.port=PORT) or another host"
            ) from None


def run(cfg: ServeConfig) -> None:
    """Load the judge, build the app, serve until SIGTERM (or Ctrl-C), drain, return."""
    from judgeloop.judges.calibrated import CalibratedJudge
    from judgeloop.serving.app import build_app
    from judgeloop.serving.config import check_routes

    # what the judge reads against what each enabled route can carry, before any weights load
    check_routes(cfg, CalibratedJudge.needs_of(cfg.judge_path, cfg.judge_overrides))
    judge = CalibratedJudge.from_pretrained(cfg.judge_path, cfg.judge_overrides)  # fails before binding
    app = build_app(judge, cfg)  # checks the token's variable
    check_port(cfg.server.host, cfg.server.port)
    logger.info(
        "serving %s judge (%s, %s) on http://%s:%d (max_batch_size=%d, max_wait_ms=%g, token %s)",
        judge.config.type,
        judge.config.model,
        judge.method,
        cfg.server.host,
        cfg.server.port,
        cfg.server.max_batch_size,
        cfg.server.max_wait_ms,
        "required" if cfg.server.api_key_env else "off",
    )
    config = uvicorn.Config(
        app,
        host=cfg.server.host,
        port=cfg.server.port,
        log_level=cfg.server.log_level,
        timeout_graceful_shutdown=math.ceil(cfg.server.drain_timeout_s),
        access_log=False,  # the OpenRLHF route may carry ?api_key=
    )
    server = DrainingServer(config, app.state.drain)
    with stopped_by_signal() as received:
        server.run()
    if not server.started:
        raise OSError(f"the server could not listen on {cfg.server.host}:{cfg.server.port} (see above)")
    stats = app.state.batcher.stats
    logger.info(
        "stopped%s after judging %d comparisons of %d requests (%d batcher jobs) in %d judge calls",
        f" on {signal.Signals(received[0]).name}" if received else "",
        stats.comparisons,
        app.state.posts.requests,
        stats.jobs,
        stats.judge_calls,
    )
