"""The loopback OpenAI-compatible server the served-judge tests judge against (judgeloop's own
``serving/openai_compat.py``), started on 127.0.0.1 on a free port in a daemon thread."""

from __future__ import annotations

import threading
from typing import Any

from judgeloop.serving.openai_compat import make_server


def start_server(lm: Any, **kwargs: Any) -> tuple[Any, str]:
    """A running loopback server over ``lm`` (``make_server``'s keyword arguments) and its base URL."""
    srv = make_server(lm, **kwargs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def stop_server(srv: Any) -> None:
    srv.shutdown()
    srv.server_close()
