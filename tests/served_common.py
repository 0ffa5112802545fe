"""The loopback OpenAI-compatible server the served-judge tests judge against (judgeloop's own
``testing/openai_compat.py``), started on 127.0.0.1 on a free port in a daemon thread."""

from __future__ import annotations

import threading
from typing import Any

from judgeloop.testing.openai_compat import make_server


def start_server(lm: Any, **kwargs: Any) -> tuple[Any, str]:
    """A running loopback server over ``lm`` (``make_server``'s keyword arguments) and its base URL."""
    srv = make_server(lm, **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def stop_server(srv: Any) -> None:
    srv.shutdown()
    srv.server_close()


def calibrate_served_tiny(base_url: str, out: Any, *extra: str) -> int:
    """``judgeloop calibrate`` of the tiny model served at ``base_url`` on a small embedded corpus with
    ROUGE labels (the served-judge tests' calibration run) into ``out``; ``extra``: more overrides."""
    from judgeloop.cli import main as cli

    return cli(calibrate_served_tiny_args(base_url, out, *extra))


def calibrate_served_tiny_args(base_url: str, out: Any, *extra: str) -> list[str]:
    """The command line (after ``judgeloop``) of :func:`calibrate_served_tiny`."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs/calibrate/summeval_served.yaml"
    tiny = "judgeloop-tiny/causal-lm"
    return [
        "calibrate",
        "--config",
        str(config),
        "data.format=embedded",
        "data.path=null",
        "data.embedded_size=40",
        "labels.type=rouge",
        f"judge.model={tiny}",
        f"judge.server.model={tiny}",
        f"judge.server.base_url={base_url}",
        "max_pairs_per_article=3",
        *extra,
        f"output_dir={out}",
    ]
