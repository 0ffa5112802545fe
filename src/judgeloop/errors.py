"""The base of the errors a user can fix (a config key, a data file, a calibration set that cannot
support a fit): :class:`UserError`. The CLI answers one with a single line, ``judgeloop COMMAND: error:
MESSAGE``, and exit status 2 (a traceback only under ``--debug``), so it needs to know no component
that raises one. Each message names the parameter or file, the value and the fix."""

from __future__ import annotations


class UserError(ValueError):
    """An error in what the user gave (settings, data), reported as one line; a ``ValueError``."""


__all__ = ["UserError"]
