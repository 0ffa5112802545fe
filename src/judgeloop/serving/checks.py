"""The judge server's request checks: :class:`ApiError` (an HTTP error with a one-line reason) and
:func:`check_texts` (the request and text limits of ``server.*``), shared by the server's routes
(:mod:`judgeloop.serving.app`, :mod:`judgeloop.serving.openrlhf`)."""

from __future__ import annotations

from judgeloop.serving.config import ServeConfig


class ApiError(Exception):
    """An HTTP error with a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def check_texts(
    cfg: ServeConfig, n_items: int, texts: list[tuple[str, str]], allow_empty: bool = False
) -> None:
    """Refuse a request over the limits (413) or with an empty text (422, unless ``allow_empty``);
    ``texts``: (field, text)."""
    limits = cfg.server
    if n_items > limits.max_items_per_request:
        raise ApiError(
            413,
            f"{n_items} items in one request; the limit is server.max_items_per_request="
            f"{limits.max_items_per_request}: split the request",
        )
    for name, text in texts:
        if len(text) > limits.max_chars_per_text:
            raise ApiError(
                413,
                f"{name} has {len(text)} characters; the limit is server.max_chars_per_text="
                f"{limits.max_chars_per_text}",
            )
    for name, text in [] if allow_empty else texts:
        if not text.strip():
            raise ApiError(422, f"{name} is empty; every prompt and completion needs text")


__all__ = ["ApiError", "check_texts"]
