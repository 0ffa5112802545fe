"""The loopback OpenAI-compatible server the served-judge tests judge against (judgeloop's own
``testing/openai_compat.py``), started on 127.0.0.1 on a free port in a daemon thread."""

from __future__ import annotations

import threading
from typing import Any

from judgeloop.testing.openai_compat import make_server

TINY = "judgeloop-tiny/causal-lm"  # the tiny Llama built from config: the served model and its tokenizer
# four pairs (article, summary A, summary B) the served-judge tests judge
ARTICLES = ["The cat sat on the mat today. It was warm and the sun was out."] * 3 + ["Rain fell all day."]
A = ["A cat sat.", "The mat was warm.", "Cat.", "It rained."]
B = ["It was warm.", "A cat.", "The cat sat on the mat.", "Sun all day."]


def start_server(lm: Any, **kwargs: Any) -> tuple[Any, str]:
    """A running loopback server over ``lm`` (``make_server``'s keyword arguments) and its base URL."""
    return serve(make_server(lm, **kwargs))


def serve(srv: Any) -> tuple[Any, str]:
    """Start a server made by ``make_server`` (and set up by the caller) in a daemon thread: it and its
    base URL."""
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
    tiny = TINY
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


def grpo_trl_tiny(judge_path: Any, out: Any, *extra: str) -> dict:
    """``recipes/grpo_trl.py`` (TRL's GRPOTrainer) on ``configs/grpo_trl/tiny.yaml``, rewarded by the saved
    judge at ``judge_path``, on 8 training articles, into ``out``: what its ``main`` returns (``report``,
    ``reward``); ``extra``: more overrides."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("grpo_trl", root / "recipes" / "grpo_trl.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    config = str(root / "configs/grpo_trl/tiny.yaml")
    args = [
        "--config",
        config,
        f"judge_path={judge_path}",
        "max_train_articles=8",
        *extra,
        f"output_dir={out}",
    ]
    return recipe.main(args)
