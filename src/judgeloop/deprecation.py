"""Old spellings kept for one release: a Python name or module renamed in a release still works in the
next one, with a ``DeprecationWarning`` that names the new spelling, and goes in the one after (the
config loader does the same for renamed config keys, as an error: ``RENAMED``). ``CHANGELOG.md`` lists
each one under the release that renamed it.

The warning points at the user's line (the call, or the ``import``), so Python's default filter shows it
when that line is in the script being run, and test runners show it for code under test.
"""

from __future__ import annotations

import warnings

from judgeloop.version import __version__

# the release that drops the spellings deprecated in this one
REMOVED_IN = "0.3.0"


def warn_renamed(old: str, new: str, stacklevel: int = 2) -> None:
    """Warn that ``old`` is spelled ``new`` now. ``stacklevel`` as in :func:`warnings.warn`, counted from
    the caller of this function (2: the line that called the caller)."""
    warnings.warn(
        f"{old} is deprecated since judgeloop {__version__} and goes in {REMOVED_IN}; write {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def warn_moved_module(old: str, new: str) -> None:
    """Warn, from a module left at ``old`` as an alias, that it is ``new`` now; the warning names the
    importer's line (:func:`warnings.warn` skips importlib's own frames). The alias module then replaces
    itself with ``new`` in ``sys.modules``, so the old name is the very module object of the new one (its
    functions and classes are the same objects)."""
    warn_renamed(f"the module {old}", f"import {new}", stacklevel=3)  # this, the alias, its importer


def warn_moved_main(old: str, new: str) -> None:
    """Warn, from a module left at ``old`` as an alias and run as ``python -m old``, that the command is
    ``python -m new`` now. The warning names the alias's line, which runs as ``__main__``, so Python's
    default filter shows it on the command line; the alias then runs ``new``'s ``main()``."""
    warn_renamed(f"python -m {old}", f"python -m {new}", stacklevel=2)  # this, the alias


__all__ = ["REMOVED_IN", "warn_moved_main", "warn_moved_module", "warn_renamed"]
