"""The base of the errors a user can fix (a config key, a data file, a calibration set that cannot
support a fit): :class:`UserError`; and a service the run needs that kept failing: :class:`ServiceFailed`. The CLI answers one with a single line, ``judgeloop COMMAND: error:
MESSAGE``, and exit status 2 (a traceback only under ``--debug``), so it needs to know no component
that raises one. Each message names the parameter or file, the value and the fix."""

from __future__ import annotations


class UserError(ValueError):
    """An error in what the user gave (settings, data), reported as one line; a ``ValueError``."""


class ServiceFailed(RuntimeError):
    """A service the run depends on (a judge server) kept failing after its retries, and the run was set
    to stop on it; the CLI prints the message, one line, and exits with status 1."""


__all__ = ["ServiceFailed", "UserError"]
