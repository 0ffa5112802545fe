"""judgeloop's version, in one place: the package root, the saved judge's card, ``run.json``, the judge
server's ``/v1/info`` and the packaging metadata (``pyproject.toml`` reads it from here) all take it
from this module, which imports nothing of judgeloop so any module may read it.

What changed in each version is in ``CHANGELOG.md`` at the repository root.
"""

__version__ = "0.2.0"

__all__ = ["__version__"]
