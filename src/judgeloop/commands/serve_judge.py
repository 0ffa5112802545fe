"""``judgeloop serve-judge --config configs/serve/judge.yaml judge_path=DIR server.port=PORT``: serve a
saved calibrated judge over HTTP (:mod:`judgeloop.serving`).

Routes: ``GET /health``; ``GET /v1/info`` (judge, calibrator, held-out figures, batching stats);
``POST /v1/compare`` (``{"items": [{"prompt", "a", "b"}]}`` -> ``{"p", "logit", "status"}``);
``POST /v1/rewards`` (``{"groups": [{"prompt", "completions"}]}`` -> one reward per completion);
``POST /openrlhf/get_reward`` (OpenRLHF's ``--reward.remote_url``, :mod:`judgeloop.integrations.openrlhf`).
verl calls ``/v1/rewards`` through :func:`judgeloop.integrations.verl.compute_score`.

The judge is loaded, and the token checked, before the port is bound: a folder that is no calibrated
judge stops here with exit status 2. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight
requests finish (``server.drain_timeout_s``) and exits.
"""

from __future__ import annotations

from judgeloop.logging import get_logger
from judgeloop.serving.config import ServeConfig

logger = get_logger(__name__)

__all__ = ["ServeConfig", "run"]


def check_port(host: str, port: int) -> None:
    """Refuse an address that cannot be listened on, with the fix, before the judge serves.

    Raises:
        ConfigError: the port is taken, or the host is no address of this machine.
    """
    import socket

    from judgeloop.config import ConfigError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"server.host={host} server.port={port} cannot be listened on ({err.strerror}); choose a free "
                "port (server.port=PORT) or another host"
            ) from None


def run(cfg: ServeConfig) -> None:
    """Load the judge, build the app, serve until SIGTERM."""
    import uvicorn

    from judgeloop.judges.calibrated import CalibratedJudge
    from judgeloop.serving.app import build_app

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
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.server.host,
            port=cfg.server.port,
            log_level=cfg.server.log_level,
            timeout_graceful_shutdown=int(cfg.server.drain_timeout_s),
            access_log=False,  # the OpenRLHF route may carry ?api_key=
        )
    )
    server.run()
    if not server.started:
        raise OSError(f"the server could not listen on {cfg.server.host}:{cfg.server.port} (see above)")
