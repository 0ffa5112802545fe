"""What the served-judge tests share: the tiny Llama and judgeloop's loopback server over it
(``judgeloop.testing.openai_compat``). Module scope, as each file had them: every test file loads its own
model and starts its own server, so the request counts a file reads are its own."""

from __future__ import annotations

import pytest

from judgeloop.testing.openai_compat import LocalModel
from served_common import TINY, start_server, stop_server


@pytest.fixture(scope="module")
def tiny_lm() -> LocalModel:
    """The tiny Llama built from config, with its tokenizer, behind the server's lock."""
    return LocalModel(TINY)


@pytest.fixture(scope="module")
def tiny_served(tiny_lm):
    """The loopback server over ``tiny_lm``, running: ``(server, base_url)``; ``server.requests`` counts
    the POSTs it answered."""
    srv, url = start_server(tiny_lm)
    yield srv, url
    stop_server(srv)


@pytest.fixture(scope="module")
def tiny_server(tiny_served) -> str:
    """The base URL of :func:`tiny_served`."""
    return tiny_served[1]
