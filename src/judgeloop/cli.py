"""The ``judgeloop`` command: ``judgeloop COMMAND --config CONFIG [key=value ...]``.

Each command is a pair (dataclass schema, run function) living in a library module; the registry
below names them lazily so ``judgeloop --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from judgeloop.config import ConfigError, check_output_places, load_config
from judgeloop.errors import ServiceFailed, UserError
from judgeloop.logging import setup_logging

# command -> "module:ConfigClass:run_function"
COMMANDS: dict[str, str] = {
    "calibrate": "judgeloop.commands.calibrate:CalibrateConfig:run",
    "label-pairs": "judgeloop.commands.label_pairs:LabelPairsConfig:run",
    "probe-judge": "judgeloop.commands.probe_judge:ProbeConfig:run",
    "conformal": "judgeloop.commands.conformal:ConformalConfig:run",
    "gate": "judgeloop.commands.gate:GateConfig:run",
    "route": "judgeloop.commands.route:RouteConfig:run",
    "answer": "judgeloop.commands.answer:AnswerConfig:run",
    "agent": "judgeloop.commands.agent:AgentConfig:run",
    "build-raft": "judgeloop.commands.build_raft:BuildRaftConfig:run",
    "sft": "judgeloop.commands.sft:SftConfig:run",
    "eval-raft": "judgeloop.commands.eval_raft:EvalRaftConfig:run",
    "train": "judgeloop.commands.train:FeedbackLoopConfig:run",
    "ablate": "judgeloop.commands.ablate:AblateConfig:run",
    "train-retriever": "judgeloop.commands.train_retriever:TrainRetrieverConfig:run",
    "mine-negatives": "judgeloop.commands.mine_negatives:MineNegativesConfig:run",
    "serve-judge": "judgeloop.commands.serve_judge:ServeConfig:run",
}

HELP: dict[str, str] = {
    "calibrate": "score judge preferences, fit Platt/isotonic calibrators, write a calibration report",
    "label-pairs": "label a preference dataset with a saved calibrated judge (p_chosen for TRL's DPO)",
    "probe-judge": "attack judges with reward hacks (verdict injection, stuffing, copying...); success rates",
    "conformal": "conformal retrieval sets (per-group thresholds, base rates, ACI) checked over random splits",
    "gate": "select cheap weak-retrieval signals on calibration data, threshold them, report AUCs and cost",
    "route": "confidence routing for QA: retrieve only when the probe is unsure; vs four baselines",
    "answer": "retrieve, read, answer or refuse (threshold on a risk-coverage curve), each refusal with its reason",
    "agent": "the retrieval agent: a bounded loop of actions; fixed, confidence-triggered and learned policies",
    "build-raft": "build a RAFT set (question, distractors, oracle w.p. p_oracle, quoted reasoning) + stats",
    "sft": "LoRA SFT of a causal LM on a RAFT set with TRL SFTTrainer (launches recipes/sft_raft.py)",
    "eval-raft": "answer accuracy with oracle+distractors / distractors / oracle, base vs tuned; quote validity",
    "train": "run the calibrated feedback loop once: online DPO or GRPO (loss.type) against a judge",
    "ablate": "run the feedback loop per calibration arm and seed; write results.json/md and curves.png",
    "train-retriever": "zero-shot eval, train a bi-encoder with mined hard negatives, eval again",
    "mine-negatives": "mine hard negatives for a set of queries with a bi-encoder (JSONL with scores)",
    "serve-judge": "serve a saved calibrated judge over HTTP (OpenRLHF, verl, any client), batched",
}


# commands with options of their own beyond --config / overrides / --print-config
COMMAND_OPTIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "ablate": [
        (
            "--job",
            {"metavar": "ARM:SEED", "help": "run this one job of the grid (skipped when already done)"},
        ),
        (
            "--aggregate",
            {"action": "store_true", "help": "write results.* from the job folders; run nothing"},
        ),
        (
            "--list-jobs",
            {"action": "store_true", "help": "print the grid, one ARM:SEED per line; run nothing"},
        ),
        (
            "--allow-missing",
            {
                "action": "store_true",
                "help": "with --aggregate: summarize the finished jobs, listing the rest",
            },
        ),
    ],
}


def command_options(name: str) -> list[tuple[str, dict[str, Any]]]:
    """The extra command-line options of one command (beyond --config and overrides)."""
    return COMMAND_OPTIONS.get(name, [])


def resolve_command(name: str) -> tuple[type, Any]:
    """Import a command's (schema, run) pair."""
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise SystemExit(
            f"judgeloop: unknown command '{name}'{hint} (commands: {', '.join(sorted(COMMANDS))})"
        )
    module_name, cls_name, fn_name = COMMANDS[name].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name), getattr(module, fn_name)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``judgeloop`` entry point: parse, load and check the config, run; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="judgeloop", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in sorted(COMMANDS):
        p = sub.add_parser(name, help=HELP.get(name, ""))
        p.add_argument("--config", required=True, help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. judge.scale=10")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
        p.add_argument(
            "--allow-empty-config", action="store_true", help="accept an empty config file (all defaults)"
        )
        for flag, kwargs in command_options(name):
            p.add_argument(flag, **kwargs)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    setup_logging()
    schema, run = resolve_command(args.command)
    try:
        cfg: Any = load_config(schema, args.config, args.overrides, allow_empty=args.allow_empty_config)
        if not args.print_config:
            check_output_places(cfg)
    except ConfigError as err:
        sys.stderr.write(f"judgeloop {args.command}: config error: {err}\n")
        return 2
    if args.print_config:
        from judgeloop.config import to_yaml

        sys.stdout.write(to_yaml(cfg))
        return 0
    extra = {
        flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
        for flag, _ in command_options(args.command)
    }
    if "aggregate" in extra:
        extra["aggregate_only"] = extra.pop("aggregate")
    from judgeloop.signals import Stopped

    try:
        run(cfg, **{k: v for k, v in extra.items() if v not in (None, False)})
    except UserError as err:  # a config, data or calibration error: one line
        if args.debug:
            raise
        sys.stderr.write(f"judgeloop {args.command}: error: {err}\n")
        return 2
    except (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as err:
        # a place the user named cannot be read or written (the message names the path)
        if args.debug:
            raise
        sys.stderr.write(f"judgeloop {args.command}: error: {err}; check the path and its permissions\n")
        return 2
    except ServiceFailed as err:  # e.g. judge.server.on_failure=stop: one line, not a traceback
        if args.debug:
            raise
        sys.stderr.write(f"judgeloop {args.command}: error: {err}\n")
        return 1
    except Stopped as err:  # a stop signal: the checkpoint is written; one line on how to continue
        sys.stderr.write(f"judgeloop {args.command}: {err}\n")
        return err.exit_status
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stderr.write(f"judgeloop {args.command}: interrupted{_resume_hint(cfg)}\n")
        return 130
    return 0


def _resume_hint(cfg: Any) -> str:
    """'; continue with resume_from=...' naming the newest checkpoint under the run's output_dir, if any."""
    from pathlib import Path

    out = getattr(cfg, "output_dir", None)
    if not out:
        return ""
    ckpts = [p for p in (Path(out) / "checkpoints").glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    if not ckpts:
        return " (no checkpoint was written; set save_every_n_steps to make them)"
    last = max(ckpts, key=lambda p: int(p.name[5:]))
    return f"; the last checkpoint is {last}: continue with resume_from={last}"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
