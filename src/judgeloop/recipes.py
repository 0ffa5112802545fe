"""Where the recipes live, and how the library runs one.

A recipe (``recipes/*.py`` of the checkout) is a training job written to be read top to bottom; the
command that runs it (``judgeloop train`` runs ``recipes/feedback_loop.py``, ``judgeloop sft`` runs
``recipes/sft_raft.py``) loads that file, so there is one copy of the job. The package lives in
``src/judgeloop``, so the recipes are found beside it; an install without the checkout has none.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

from judgeloop.config import ConfigError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe_path(name: str) -> Path:
    """``recipes/<name>`` of this checkout; a ConfigError when it is not there."""
    path = RECIPES / name
    if not path.is_file():
        raise ConfigError(
            f"recipe {path} not found: judgeloop runs its recipes from a source checkout "
            "(git clone, then pip install -e .)"
        )
    return path


def load_recipe(name: str) -> dict[str, Any]:
    """The names a recipe defines (its module globals), without running its ``__main__`` block."""
    return runpy.run_path(str(recipe_path(name)), run_name=f"judgeloop_recipe_{Path(name).stem}")


def train(cfg: Any, **kwargs: Any) -> dict[str, Any]:
    """One run of the calibrated feedback loop: ``train`` of ``recipes/feedback_loop.py`` (what
    ``judgeloop train`` and every ablation job run)."""
    return load_recipe("feedback_loop.py")["train"](cfg, **kwargs)
