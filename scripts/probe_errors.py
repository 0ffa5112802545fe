"""Try the bad inputs a hostile but fair new user tries, and print what each one gets.

    .venv/bin/python scripts/probe_errors.py [--out docs/errors.md]
    .venv/bin/python scripts/probe_errors.py --only "kl_coef=nan" --only "truncated YAML" --out docs/errors.md

``--only TEXT`` (repeatable) runs the command cases whose name holds TEXT and no server probe; with
``--out`` it replaces (or adds) just those rows of the file's first table, leaving the other rows as
they were measured.

Each case runs one ``judgeloop`` command in this process (``judgeloop.cli.main``) on inputs built in a
temporary folder, and records its exit status, the seconds until it stopped, and the first line it
wrote to stderr. A case passes when the exit status is 2 and that line names the value (the check
column). Then a real ``judgeloop serve-judge`` gets the bad requests of :func:`http_cases`; each must
be a 4xx with a one-line ``{"error"}`` body, the server staying up (the second table). Needs no shared data and no model downloads; the one real run (a tiny-config checkpoint to
resume from) takes about 20 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "feedback_loop" / "tiny.yaml")
QUICK = [
    "judge.model=judgeloop-tiny/encoder",
    "policy.sft_steps=20",
    "max_steps=2",
    "save_every_n_steps=1",
    "calibration.min_points=4",
    "num_eval_articles=2",
    "num_validation_articles=2",
    "data.embedded_size=120",
    "generation.max_new_tokens=4",
    "progress_bar=false",
    "log_with=[jsonl]",
]


def run_cli(argv: list[str]) -> tuple[int, float, str]:
    from judgeloop.cli import main

    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = int(exc.code or 0)
        except Exception as exc:  # a traceback is what the probe is for: record it, go on
            rc = -1
            err.write(f"TRACEBACK {type(exc).__name__}: {exc}\n")
    lines = [line for line in err.getvalue().splitlines() if line.strip() and " INFO " not in line]
    return rc, time.perf_counter() - t0, (lines[0] if lines else "")


def damaged_judge(tmp: Path, name: str, file: str, damage: Callable[[str], str]) -> Path:
    """A Platt-fitted length judge (no model needed) saved to ``tmp/name`` with ``file`` rewritten by
    ``damage`` (its text in, the damaged text out)."""
    from judgeloop.calibration import PlattCalibrator
    from judgeloop.judges import JudgeConfig
    from judgeloop.judges.calibrated import CalibratedJudge

    folder = tmp / name
    cal = PlattCalibrator(min_points=2).fit([-2.0, -1.0, 1.0, 2.0], [0, 0, 1, 1])
    CalibratedJudge(JudgeConfig(type="objective", signal="length"), cal, {"method": "platt"}).save_pretrained(
        folder
    )
    (folder / file).write_text(damage((folder / file).read_text()))
    return folder


def _set(path: str, value: object) -> Callable[[str], str]:
    """A damage: set the JSON entry at ``path`` (dotted) to ``value``."""

    def damage(text: str) -> str:
        state = json.loads(text)
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[key]
        node[last] = value
        return json.dumps(state)

    return damage


# a case's arguments, or (the environment to run them in, the arguments)
Argv = list[str] | tuple[dict[str, str], list[str]]


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for the block, the variables as they were after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cases(tmp: Path) -> list[tuple[str, Callable[[], Argv], str]]:
    """(case, argv builder, text the first error line must hold)."""
    label_pairs = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        "data.fields.source=null",
        "data.fields.references=null",
        f"output_dir={tmp / 'labeled'}",
    ]
    pair = {"prompt": "an article", "chosen": "a summary", "rejected": "another"}
    squad_row = {
        "id": "q0",
        "question": "Who?",
        "context": "Town 0.",
        "answers": ["Ann"],
        "is_impossible": False,
    }
    vllm = [
        "train",
        "--config",
        TINY,
        f"output_dir={tmp / 'vllm'}",
        "generation.backend=vllm",
        "policy.model=judgeloop-tiny/causal-lm-h32",
    ]

    def saved_judge() -> Path:
        """A calibrated judge that needs no model: the objective length signal, raw."""
        from judgeloop.calibration import IdentityCalibrator
        from judgeloop.judges import JudgeConfig
        from judgeloop.judges.calibrated import CalibratedJudge

        folder = tmp / "length_judge"
        if not folder.is_dir():
            judge = CalibratedJudge(JudgeConfig(type="objective", signal="length"), IdentityCalibrator())
            judge.save_pretrained(folder)
        return folder

    def write(name: str, data: bytes | str) -> Path:
        path = tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path

    def jsonl(name: str, rows: list[dict]) -> Path:
        return write(name, "".join(json.dumps(r) + "\n" for r in rows))

    def resume_changed() -> list[str]:
        out = tmp / "resume_run"
        run_cli(["train", "--config", TINY, *QUICK, f"output_dir={out}"])
        ckpt = out / "checkpoints" / "step_1"
        return [
            "train",
            "--config",
            TINY,
            *QUICK,
            f"output_dir={out}",
            f"resume_from={ckpt}",
            "loss.kl_coef=0.5",
        ]

    INF_QRELS = "query-id\tcorpus-id\tscore\n1\t31715818\tinf\n"  # noqa: N806

    def damaged_checkpoint() -> list[str]:
        """The checkpoint of a real run, its state.json cut in half."""
        out = tmp / "damaged_run"
        if not (out / "checkpoints" / "step_1").is_dir():
            run_cli(["train", "--config", TINY, *QUICK, f"output_dir={out}"])
        state = out / "checkpoints" / "step_1" / "state.json"
        text = state.read_text()
        state.write_text(text[: len(text) // 2])
        return ["train", "--config", TINY, *QUICK, f"output_dir={out}", f"resume_from={state.parent}"]

    ablate = ["ablate", "--config", TINY, *QUICK, "ablation.arms=[raw,platt]", "ablation.seeds=[0]"]

    def aggregate_some() -> list[str]:
        out = tmp / "grid"
        with contextlib.redirect_stdout(io.StringIO()):  # one of the two jobs finishes
            run_cli([*ablate, f"output_dir={out}", "--job", "raw:0"])
        return [*ablate, f"output_dir={out}", "--aggregate"]

    def squad() -> Path:
        rows = [
            {
                "id": f"q{i}",
                "question": f"Who founded town {i}?",
                "context": f"Town {i} was founded by {i}.",
                "answers": [] if i % 2 else [str(i)],
                "is_impossible": bool(i % 2),
            }
            for i in range(4)
        ]
        return jsonl("squad.jsonl", rows)

    def other_conformal() -> Path:
        """A conformal file fitted on a one-passage pool that is not this run's."""
        import numpy as np

        from judgeloop.retrieval.conformal import ConformalRetriever, corpus_fingerprint, save_conformal_file

        model = ConformalRetriever(0.2).fit(np.full((5, 1), 0.8), np.ones((5, 1), bool), np.zeros(5, int))
        scorer = {
            "encoder": "sentence-transformers/all-MiniLM-L6-v2",
            "pooling": "mean",
            "max_length": 256,
            "score_map": "affine",
        }
        save_conformal_file(
            tmp / "conformal.json", model, corpus_fingerprint(["0"], ["another pool"]), scorer
        )
        return tmp / "conformal.json"

    good = {"id": "a", "article": "An article about a thing. It has two sentences.", "summary": "A thing."}
    LATIN1_ROW = json.dumps(good).encode().replace(b"thing.", b"th\xe9me.") + b"\n"  # noqa: N806
    return [
        ("resume with a changed loss.kl_coef", resume_changed, "loss.kl_coef: 0.1 -> 0.5"),
        (
            "resume a checkpoint past max_steps",
            lambda: [
                "train",
                "--config",
                TINY,
                *QUICK,
                f"output_dir={tmp / 'resume_run'}",
                f"resume_from={tmp / 'resume_run' / 'checkpoints' / 'step_2'}",
                "max_steps=1",
            ],
            "is at step 2, past max_steps=1",
        ),
        (
            "early stopping with num_validation_articles=0",
            lambda: [
                "train",
                "--config",
                TINY,
                f"output_dir={tmp / 'es'}",
                "early_stopping_patience=1",
                "num_validation_articles=0",
            ],
            "num_validation_articles=0",
        ),
        (
            "early stopping with an empty validation split",
            lambda: [
                "train",
                "--config",
                TINY,
                *QUICK,
                f"output_dir={tmp / 'es'}",
                "early_stopping_patience=1",
                "data.split.validation=0.001",
            ],
            "the 'validation' split is empty",
        ),
        (
            "ablation.seeds=[0,0]",
            lambda: ["ablate", "--config", TINY, "ablation.seeds=[0,0]"],
            "ablation.seeds=[0, 0] lists 0 more than once",
        ),
        (
            "an unknown policy.model, offline",
            lambda: [
                "train",
                "--config",
                TINY,
                f"output_dir={tmp / 'm'}",
                "policy.model=no-such-org/no-such-model",
            ],
            "policy.model",
        ),
        (
            "resume_from a folder that is no checkpoint",
            lambda: ["train", "--config", TINY, f"output_dir={tmp / 'r'}", f"resume_from={tmp}"],
            f"resume_from={tmp} is not a checkpoint directory",
        ),
        (
            "online.alpha=1.5 (conformal)",
            lambda: [
                "conformal",
                "--config",
                str(ROOT / "configs/conformal/scifact.yaml"),
                "online.alpha=1.5",
            ],
            "online.alpha=1.5",
        ),
        (
            "router.max_retrieval_rate=1.5 (route)",
            lambda: [
                "route",
                "--config",
                str(ROOT / "configs/routing/squad2.yaml"),
                "router.max_retrieval_rate=1.5",
            ],
            "router.max_retrieval_rate=1.5",
        ),
        (
            "model.type=served without a server (route)",
            lambda: ["route", "--config", str(ROOT / "configs/routing/squad2.yaml"), "model.type=served"],
            "model.server.base_url",
        ),
        (
            "model.server.base_url where nothing listens (route)",
            lambda: [
                "route",
                "--config",
                str(ROOT / "configs/routing/squad2.yaml"),
                "model.type=served",
                "model.server.base_url=http://127.0.0.1:9",
                "model.server.model=m",
                f"output_dir={tmp / 'route_served'}",
            ],
            "model.server.base_url='http://127.0.0.1:9'",
        ),
        (
            "abstain.target_risk=1.5 (answer)",
            lambda: [
                "answer",
                "--config",
                str(ROOT / "configs/routing/squad2_abstain.yaml"),
                "abstain.target_risk=1.5",
            ],
            "abstain.target_risk=1.5 must be in (0, 1)",
        ),
        (
            "an escalation.rewrite_model that is not there (gate)",
            lambda: [
                "gate",
                "--config",
                str(ROOT / "configs/gate/scifact_escalate.yaml"),
                "escalation.method=rewrite",
                "escalation.rewrite_model=no-such-org/no-such-model",
                f"output_dir={tmp / 'gate'}",
            ],
            "escalation.rewrite_model='no-such-org/no-such-model'",
        ),
        (
            "a conformal file fitted on another pool (answer)",
            lambda: [
                "answer",
                "--config",
                str(ROOT / "configs/routing/squad2_abstain.yaml"),
                f"data.path={squad()}",
                f"abstain.conformal_path={other_conformal()}",
                f"output_dir={tmp / 'answer'}",
            ],
            "was fitted on another corpus",
        ),
        (
            "data.eval_fraction=0 (train-retriever)",
            lambda: [
                "train-retriever",
                "--config",
                str(ROOT / "configs/retriever/scifact.yaml"),
                "data.eval_fraction=0",
            ],
            "data.eval_fraction=0.0",
        ),
        (
            "calibration.min_points no fit can reach (train)",
            lambda: [
                "train",
                "--config",
                TINY,
                f"output_dir={tmp / 'mp'}",
                "calibration.method=platt",
                "calibration.num_articles=4",
                "calibration.extra_rounds=0",
                "calibration.min_points=500",
            ],
            "calibration.min_points=500 can never be reached",
        ),
        (
            "calibrator.min_points above the labeled pairs (calibrate)",
            lambda: [
                "calibrate",
                "--config",
                str(ROOT / "configs/calibrate/embedded_embedding.yaml"),
                f"output_dir={tmp / 'cal'}",
                "calibrator.min_points=100000",
            ],
            "calibrator.min_points=100000",
        ),
        (
            "output_dir is a file",
            lambda: ["train", "--config", TINY, f"output_dir={write('a_file', 'x')}"],
            "is a file",
        ),
        (
            "generation.backend=vllm with a python that is not there",
            lambda: [*vllm, "generation.vllm.python=/no/such/python"],
            "generation.vllm.python='/no/such/python' is not a file",
        ),
        (
            "generation.backend=vllm at a URL nothing answers",
            lambda: [*vllm, "generation.vllm.url=http://127.0.0.1:9"],
            "generation.vllm.url='http://127.0.0.1:9' does not answer",
        ),
        (
            "generation.backend=vllm on the tiny policy (heads of 16) on a CPU",
            lambda: [*vllm[:-1], "policy.model=judgeloop-tiny/causal-lm"],
            "has attention heads of size 16",
        ),
        (
            "output_path is a folder (mine-negatives)",
            lambda: [
                "mine-negatives",
                "--config",
                str(write("mine.yaml", f"output_path: {tmp}\n")),
            ],
            "is a folder",
        ),
        (
            "a latin-1 byte in a JSONL data file",
            lambda: [
                "train",
                "--config",
                TINY,
                f"output_dir={tmp / 'enc'}",
                "data.format=jsonl",
                f"data.path={write('latin1.jsonl', LATIN1_ROW)}",
            ],
            "is not UTF-8",
        ),
        (
            "a number where text belongs (debian)",
            lambda: [
                "train",
                "--config",
                TINY,
                f"output_dir={tmp / 'num'}",
                "data.format=debian",
                f"data.path={jsonl('num.jsonl', [good, {**good, 'id': 'b', 'summary': 7}])}",
            ],
            "field 'summary' must be a string",
        ),
        (
            "an empty oracle in RAFT input (build-raft)",
            lambda: [
                "build-raft",
                "--config",
                str(ROOT / "configs/raft/squad.yaml"),
                f"output_dir={tmp / 'raft'}",
                "data.format=jsonl",
                f"data.path={jsonl('raft.jsonl', [{'id': 'q1', 'question': 'Q?', 'oracle': '', 'answer': 'A'}])}",
            ],
            "id q1: field 'oracle' is empty",
        ),
        (
            "an id repeated with another article (duplicate_ids=error)",
            lambda: [
                "calibrate",
                "--config",
                str(ROOT / "configs/calibrate/embedded_embedding.yaml"),
                f"output_dir={tmp / 'dup'}",
                "data.format=debian",
                "data.duplicate_ids=error",
                f"data.path={jsonl('dup.jsonl', [good, {**good, 'article': 'Another text.'}])}",
            ],
            "id 'a' appears again with different text",
        ),
        (
            "--aggregate before any job has finished",
            lambda: [*ablate, f"output_dir={tmp / 'no_jobs'}", "--aggregate"],
            "no job has finished under TMP/no_jobs (0 of 2 have a report.json); run them first, one per line "
            "of --list-jobs",
        ),
        (
            "--aggregate with a job missing",
            aggregate_some,
            "not finished: platt:0); run them with --job ARM:SEED, or pass --allow-missing",
        ),
        (
            "--allow-missing without --aggregate",
            lambda: [*ablate, f"output_dir={tmp / 'am'}", "--allow-missing"],
            "--allow-missing goes with --aggregate",
        ),
        (
            "stop_signals=[SIGTREM] (a typo)",
            lambda: ["train", "--config", TINY, "stop_signals=[SIGTREM]"],
            "stop_signals lists 'SIGTREM', which is no signal name; did you mean SIGTERM?",
        ),
        (
            "stop_signals=[SIGKILL] (train-retriever)",
            lambda: [
                "train-retriever",
                "--config",
                str(ROOT / "configs/retriever/scifact.yaml"),
                "stop_signals=[SIGKILL]",
            ],
            "stop_signals lists SIGKILL, which cannot be caught",
        ),
        (
            "ablation.save_every_n_steps=-1",
            lambda: ["ablate", "--config", TINY, "ablation.save_every_n_steps=-1"],
            "ablation.save_every_n_steps=-1 must be >= 0",
        ),
        (
            "label-pairs: judge_path is no calibrated judge",
            lambda: [*label_pairs, f"judge_path={tmp}", f"data.path={jsonl('pairs.jsonl', [pair])}"],
            "is not a calibrated judge (no calibrated_judge.json)",
        ),
        (
            "label-pairs: a truncated calibrator.json",
            lambda: [
                *label_pairs,
                f"judge_path={damaged_judge(tmp, 'cut_judge', 'calibrator.json', lambda t: t[: len(t) // 2])}",
                f"data.path={jsonl('pairs.jsonl', [pair])}",
            ],
            "calibrator.json: not valid JSON",
        ),
        (
            "label-pairs: a NaN slope in calibrator.json",
            lambda: [
                *label_pairs,
                f"judge_path={damaged_judge(tmp, 'nan_judge', 'calibrator.json', _set('params.a_', None))}",
                f"data.path={jsonl('pairs.jsonl', [pair])}",
            ],
            "params.a_ must be a finite number, got None",
        ),
        (
            "label-pairs: a calibrator method that does not match its parameters",
            lambda: [
                *label_pairs,
                f"judge_path={damaged_judge(tmp, 'method_judge', 'calibrator.json', _set('method', 'temperature'))}",
                f"data.path={jsonl('pairs.jsonl', [pair])}",
            ],
            "parameters do not match method 'temperature'",
        ),
        (
            "label-pairs: a truncated calibrated_judge.json",
            lambda: [
                *label_pairs,
                f"judge_path={damaged_judge(tmp, 'card_judge', 'calibrated_judge.json', lambda t: t[:30])}",
                f"data.path={jsonl('pairs.jsonl', [pair])}",
            ],
            "calibrated_judge.json: not valid JSON",
        ),
        (
            "label-pairs: a pair without its rejected field",
            lambda: [
                *label_pairs,
                f"judge_path={saved_judge()}",
                f"data.path={jsonl('norej.jsonl', [{'prompt': 'p', 'chosen': 'c'}])}",
            ],
            "missing field(s) ['rejected']",
        ),
        (
            "label-pairs: a judge that reads references, no data.fields.references",
            lambda: [
                *label_pairs,
                f"judge_path={rouge_judge(tmp)}",
                f"data.path={jsonl('norefs.jsonl', [pair])}",
            ],
            "set data.fields.references=FIELD",
        ),
        (
            "label-pairs: an empty completion",
            lambda: [
                *label_pairs,
                f"judge_path={saved_judge()}",
                f"data.path={jsonl('empty.jsonl', [{**pair, 'rejected': ' '}])}",
            ],
            "field 'rejected' is empty",
        ),
        (
            "label-pairs: a number where the prompt belongs",
            lambda: [
                *label_pairs,
                f"judge_path={saved_judge()}",
                f"data.path={jsonl('numprompt.jsonl', [pair, {**pair, 'prompt': 3}])}",
            ],
            "field 'prompt' must be a string or a list of {'role', 'content'} messages with string content, got number 3",
        ),
        (
            "label-pairs: null where a completion belongs",
            lambda: [
                *label_pairs,
                f"judge_path={saved_judge()}",
                f"data.path={jsonl('nullchosen.jsonl', [pair, {**pair, 'chosen': None}])}",
            ],
            "field 'chosen' must be a string or a list of {'role', 'content'} messages with string content, got null",
        ),
        (
            "route: an answer given as a string, not a list (squad2)",
            lambda: [
                "route",
                "--config",
                str(ROOT / "configs/routing/squad2.yaml"),
                f"output_dir={tmp / 'route'}",
                f"data.path={jsonl('squad_str.jsonl', [{**squad_row, 'answers': 'France'}])}",
            ],
            "field 'answers' must be a list of strings, got string 'France'",
        ),
        (
            "label-pairs: min_confidence=0.3",
            lambda: [*label_pairs, f"judge_path={tmp}", "data.path=x.jsonl", "min_confidence=0.3"],
            "min_confidence=0.3 must be in [0.5, 1]",
        ),
        (
            "threads=0 (train)",
            lambda: ["train", "--config", TINY, "threads=0"],
            "threads=0 must be >= 1",
        ),
        (
            "an empty config file",
            lambda: ["calibrate", "--config", str(write("empty.yaml", "# to do\n"))],
            "is empty",
        ),
        (
            "loss.kl_coef=nan (train)",
            lambda: ["train", "--config", TINY, f"output_dir={tmp / 'nan'}", "loss.kl_coef=nan"],
            "'loss.kl_coef'=nan is not a finite number",
        ),
        (
            "optim.learning_rate=inf (train)",
            lambda: ["train", "--config", TINY, f"output_dir={tmp / 'inf'}", "optim.learning_rate=inf"],
            "'optim.learning_rate'=inf is not a finite number",
        ),
        (
            "loss.tau=nan (train-retriever)",
            lambda: [
                "train-retriever",
                "--config",
                str(ROOT / "configs/retriever/scifact.yaml"),
                f"output_dir={tmp / 'tau'}",
                "loss.tau=nan",
            ],
            "'loss.tau'=nan is not a finite number",
        ),
        (
            "server.port=70000 (serve-judge)",
            lambda: ["serve-judge", "--config", str(ROOT / "configs/serve/judge.yaml"), "server.port=70000"],
            "'server.port'=70000 must be in [0, 65535]",
        ),
        (
            "a truncated YAML config file",
            lambda: ["calibrate", "--config", str(write("cut.yaml", "judge:\n  scale: [1, 2\n"))],
            "is not valid YAML",
        ),
        (
            "gate.min_separation=-1 (gate): out of range",
            lambda: [
                "gate",
                "--config",
                str(ROOT / "configs/gate/scifact.yaml"),
                f"output_dir={tmp / 'gate'}",
                "gate.min_separation=-1",
            ],
            "'gate.min_separation'=-1.0 must be in [0.5, 1]",
        ),
        (
            "a qrels score of inf (gate)",
            lambda: [
                "gate",
                "--config",
                str(ROOT / "configs/gate/scifact.yaml"),
                f"output_dir={tmp / 'gate_qrels'}",
                "data.qrels_path=" + str(write("qrels.tsv", INF_QRELS)),
            ],
            "score 'inf' is not a finite number",
        ),
        ("a truncated state.json in the checkpoint to resume", damaged_checkpoint, "checkpoint state"),
        (
            "judge.server.timeout_s=1e300 (calibrate)",
            lambda: [
                "calibrate",
                "--config",
                str(ROOT / "configs/calibrate/summeval_served.yaml"),
                f"output_dir={tmp / 'timeout'}",
                "judge.server.timeout_s=1e300",
            ],
            "'judge.server.timeout_s'=1e+300 must be",
        ),
        (
            "judge.server.base_url with no server behind it (calibrate)",
            lambda: [
                "calibrate",
                "--config",
                str(ROOT / "configs/calibrate/summeval_served.yaml"),
                f"output_dir={tmp / 'no_server'}",
                "judge.server.base_url=http://127.0.0.1:9/v1",
                "judge.server.model=X",
            ],
            "judge.server.base_url='http://127.0.0.1:9/v1': no server answers",
        ),
        (
            "judge.server.api_key_env naming an unset variable (calibrate)",
            lambda: [
                "calibrate",
                "--config",
                str(ROOT / "configs/calibrate/summeval_served.yaml"),
                f"output_dir={tmp / 'no_key'}",
                "judge.server.api_key_env=JUDGELOOP_PROBE_UNSET_KEY",
            ],
            "$JUDGELOOP_PROBE_UNSET_KEY is not set",
        ),
        *serve_cases(tmp, write),
        *run_dir_cases(tmp, resume_changed),
        *launch_cases(tmp),
    ]


def launch_cases(tmp: Path) -> list[tuple[str, Callable[[], Argv], str]]:
    """Launches the loop cannot follow (judgeloop.distributed.check_launch): the variables ``accelerate
    launch`` sets for the flags, set around the run here; refused before any work."""

    def launched(flags: dict[str, str], name: str) -> Callable[[], Argv]:
        env = {f"ACCELERATE_{k}": v for k, v in flags.items()}
        return lambda: (env, ["train", "--config", TINY, f"output_dir={tmp / name}"])

    zero2 = {"USE_DEEPSPEED": "true", "DEEPSPEED_ZERO_STAGE": "2"}

    def ds_file() -> Argv:
        path = tmp / "ds_config.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8}))
        env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
        return env, ["train", "--config", TINY, f"output_dir={tmp / 'ds_file'}"]

    return [
        (
            "accelerate launch --use_deepspeed --gradient_clipping 0.5 (optim.max_grad_norm=1.0)",
            launched({**zero2, "GRADIENT_CLIPPING": "0.5"}, "ds_clip"),
            "launch with --gradient_clipping 1.0",
        ),
        (
            "accelerate launch --use_deepspeed --gradient_accumulation_steps 2",
            launched({**zero2, "GRADIENT_ACCUMULATION_STEPS": "2"}, "ds_accum"),
            "launch with --gradient_accumulation_steps 1",
        ),
        (
            "accelerate launch --use_deepspeed --offload_optimizer_device cpu",
            launched({**zero2, "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "ds_offload"),
            "launch without --offload_optimizer_device",
        ),
        (
            "accelerate launch --deepspeed_config_file with train_micro_batch_size_per_gpu: 8 (batch_size=4)",
            ds_file,
            "set it to auto there, or set batch_size=8",
        ),
        (
            "accelerate launch --mixed_precision fp16",
            launched({"MIXED_PRECISION": "fp16"}, "fp16"),
            "launch with --mixed_precision no or bf16",
        ),
    ]


def run_dir_cases(
    tmp: Path, resume_changed: Callable[[], list[str]]
) -> list[tuple[str, Callable[[], list[str]], str]]:
    """An output folder that holds another run (judgeloop.rundir): refused in one line before any work."""
    calibrate = ["calibrate", "--config", str(ROOT / "configs/calibrate/embedded_embedding.yaml")]
    run = tmp / "resume_run"
    held: list[object] = []

    def finished_run() -> Path:
        if not (run / "run.json").is_file():
            resume_changed()  # a finished tiny train run with checkpoints
        return run

    def busy() -> list[str]:
        from judgeloop.loop.config import FeedbackLoopConfig
        from judgeloop.rundir import open_run_dir

        held.append(open_run_dir(tmp / "busy", "train", FeedbackLoopConfig()))  # held until the probe ends
        return ["train", "--config", TINY, *QUICK, f"output_dir={tmp / 'busy'}"]

    def old_folder() -> list[str]:
        (tmp / "old_run").mkdir(exist_ok=True)
        (tmp / "old_run" / "report.json").write_text("{}")
        return ["gate", "--config", str(ROOT / "configs/gate/scifact.yaml"), f"output_dir={tmp / 'old_run'}"]

    return [
        (
            "train afresh into a train run's folder",
            lambda: ["train", "--config", TINY, *QUICK, f"output_dir={finished_run()}"],
            "holds this train run already (stopped); continue it with resume_from=auto",
        ),
        (
            "calibrate into a train run's folder",
            lambda: [*calibrate, f"output_dir={finished_run()}"],
            "holds a train run, not a calibrate run",
        ),
        ("a second train into a folder in use", busy, "is in use by another run (train), pid"),
        ("gate into an older judgeloop's folder (no run.json)", old_folder, "but no run.json"),
    ]


def rouge_judge(tmp: Path) -> Path:
    """A saved judge that reads references (ROUGE-L against them, ``judge.signal=rouge``); no model."""
    from judgeloop.calibration import IdentityCalibrator
    from judgeloop.judges import JudgeConfig
    from judgeloop.judges.calibrated import CalibratedJudge

    path = tmp / "rouge_judge"
    if not path.exists():
        CalibratedJudge(JudgeConfig(type="objective", signal="rouge"), IdentityCalibrator()).save_pretrained(
            path
        )
    return path


def serve_cases(
    tmp: Path, write: Callable[[str, str], Path]
) -> list[tuple[str, Callable[[], list[str]], str]]:
    """``serve-judge``'s bad inputs: each must stop before the port is bound."""
    import socket

    from judgeloop.calibration import IdentityCalibrator
    from judgeloop.judges import JudgeConfig
    from judgeloop.judges.calibrated import CalibratedJudge

    serve = ["serve-judge", "--config", str(ROOT / "configs/serve/judge.yaml")]
    judge = tmp / "length_judge"

    def good_judge() -> str:
        if not judge.exists():
            CalibratedJudge(
                JudgeConfig(type="objective", signal="length"), IdentityCalibrator()
            ).save_pretrained(judge)
        return f"judge_path={judge}"

    def taken_port() -> list[str]:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken.append(s)  # held until the probe ends
        return [*serve, good_judge(), f"server.port={s.getsockname()[1]}"]

    taken: list[socket.socket] = []
    return [
        (
            "serve-judge: judge_path is no calibrated judge",
            lambda: [*serve, f"judge_path={tmp}"],
            "is not a calibrated judge",
        ),
        ("serve-judge: judge_path empty", lambda: [*serve, "judge_path="], "judge_path is empty"),
        (
            "serve-judge: a string slope in calibrator.json",
            lambda: [
                *serve,
                f"judge_path={damaged_judge(tmp, 'str_judge', 'calibrator.json', _set('params.a_', '1.5'))}",
            ],
            "params.a_ must be a finite number, got '1.5'",
        ),
        (
            "serve-judge: server.api_key_env names an unset variable",
            lambda: [*serve, good_judge(), "server.api_key_env=JUDGELOOP_PROBE_UNSET_TOKEN"],
            "JUDGELOOP_PROBE_UNSET_TOKEN is unset or empty",
        ),
        ("serve-judge: server.port already taken", taken_port, "cannot be listened on"),
        (
            "serve-judge: server.read_timeout_s=0",
            lambda: [*serve, "server.read_timeout_s=0"],
            "server.read_timeout_s=0.0 must be > 0",
        ),
        (
            "serve-judge: server.max_batch_size=0",
            lambda: [*serve, "server.max_batch_size=0"],
            "server.max_batch_size=0",
        ),
        ("serve-judge: rewards.scheme=pairs", lambda: [*serve, "rewards.scheme=pairs"], "rewards.scheme"),
        (
            "serve-judge: a judge that reads references, with the OpenRLHF and verl routes on",
            lambda: [*serve, f"judge_path={rouge_judge(tmp)}"],
            "set routes.openrlhf=false routes.verl=false",
        ),
        (
            "serve-judge: a judge override that changes its meaning",
            lambda: [*serve, good_judge(), "judge_overrides=[scale=3]"],
            "overrides change ['scale']",
        ),
    ]


SURROGATE = b'"p\\ud800"'  # valid JSON, but no Unicode text


def http_cases() -> list[tuple[str, str, str, bytes | None, str]]:
    """The bad requests a client sends a running judge server: (case, method, route, body or None, text
    the ``{"error"}`` must hold). The server runs with ``server.max_chars_per_text=50`` and
    ``server.read_timeout_s=1``; a body of ``b"HALF"`` declares 100 bytes, sends 8 and stops."""
    long = json.dumps("r" * 51)
    return [
        ("an unknown route", "GET", "/no/such/route", None, "Not Found"),
        ("a GET of a POST route", "GET", "/v1/compare", None, "Method Not Allowed"),
        (
            "a body that is not UTF-8",
            "POST",
            "/v1/compare",
            b'{"items": [{"prompt": "p", "a": "\xff", "b": "x"}]}',
            "request body is not UTF-8: byte 0xff",
        ),
        (
            "a lone surrogate in a text",
            "POST",
            "/v1/compare",
            b'{"items": [{"prompt": ' + SURROGATE + b', "a": "a", "b": "bb"}]}',
            "items[0].prompt holds \\ud800",
        ),
        (
            "a lone surrogate in a query",
            "POST",
            "/openrlhf/get_reward",
            b'{"query": [' + SURROGATE + b'], "prompts": ["p"]}',
            "query[0] holds \\ud800",
        ),
        (
            "a reference over max_chars_per_text",
            "POST",
            "/v1/compare",
            b'{"items": [{"prompt": "p", "a": "a", "b": "bb", "references": [' + long.encode() + b"]}]}",
            "items[0].references[0] has 51 characters",
        ),
        (
            "a reference over max_chars_per_text",
            "POST",
            "/v1/rewards",
            b'{"groups": [{"prompt": "p", "completions": ["a", "bb"], "references": ['
            + long.encode()
            + b"]}]}",
            "groups[0].references[0] has 51 characters",
        ),
        (
            "half a body, then nothing",
            "POST",
            "/v1/compare",
            b"HALF",
            "did not arrive within server.read_timeout_s=1",
        ),
    ]


def _http(port: int, method: str, route: str, body: bytes | None) -> tuple[int, str]:
    """One request on a raw socket (a half-sent body included): the status and the body, read until the
    server closes the connection (``Connection: close`` asked for, so it does)."""
    import socket

    half = body == b"HALF"
    length = 100 if half else len(body or b"")
    head = f"{method} {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += (
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n" if body is not None else "\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + (b'{"items"' if half else body or b""))
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    status_line, _, rest = got.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2].decode()


def probe_server(tmp: Path) -> list[tuple[str, int, float, str, bool]]:
    """Run :func:`http_cases` against a real ``judgeloop serve-judge`` (a length judge, no model); a case
    passes when the status is a 4xx, the body is ``{"error": "<one line>"}`` holding the expected text,
    and ``/health`` still answers after it."""
    import socket
    import subprocess

    from judgeloop.calibration import IdentityCalibrator
    from judgeloop.judges import JudgeConfig
    from judgeloop.judges.calibrated import CalibratedJudge

    judge = tmp / "http_judge"
    CalibratedJudge(JudgeConfig(type="objective", signal="length"), IdentityCalibrator()).save_pretrained(
        judge
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "judgeloop.cli",
        "serve-judge",
        "--config",
        str(ROOT / "configs/serve/judge.yaml"),
        f"judge_path={judge}",
        f"server.port={port}",
        "server.max_chars_per_text=50",
        "server.read_timeout_s=1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError, IndexError, ValueError):
                if _http(port, "GET", "/health", None)[0] == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the judge server did not start ({' '.join(cmd)})")
            time.sleep(0.2)
        for name, method, route, body, expect in http_cases():
            t0 = time.perf_counter()
            status, text = _http(port, method, route, body)
            secs = time.perf_counter() - t0
            try:
                error = json.loads(text)
                ok = list(error) == ["error"] and expect in error["error"] and "\n" not in error["error"]
            except ValueError:
                ok = False
            ok = ok and 400 <= status < 500 and _http(port, "GET", "/health", None)[0] == 200
            rows.append((f"{name}: {method} {route}", status, secs, text, ok))
            print(f"{'ok ' if ok else 'BAD'} {name}: {status} {secs:.1f}s {text[:160]}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def _row(name: str, rc: int, secs: float, line: str, ok: bool) -> str:
    return f"| {name} | {rc} | {secs:.1f} | `{line.replace('|', '/')}` | {'ok' if ok else 'FAILED'} |"


def _update_rows(rows: list[tuple[str, int, float, str, bool]], out: str | None) -> int:
    """Print ``rows``; with ``out``, replace those rows of its first table (by case name) or add them at its
    end, keeping every other row as measured before."""
    text = "\n".join(_row(*r) for r in rows) + "\n"
    sys.stdout.write(text)
    if out:
        from judgeloop.io import atomic_write_text

        lines = Path(out).read_text().splitlines()
        end = next(i for i, line in enumerate(lines) if i > 1 and not line.startswith("|"))
        for r in rows:
            at = [i for i in range(end) if lines[i].startswith(f"| {r[0]} |")]
            if at:
                lines[at[0]] = _row(*r)
            else:
                lines.insert(end, _row(*r))
                end += 1
        atomic_write_text(out, "\n".join(lines) + "\n")
    return 0 if all(r[-1] for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="run only the cases whose name holds TEXT (repeatable)",
    )
    args = parser.parse_args()
    logging.getLogger("judgeloop").setLevel(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, build, expect in cases(tmp):
            if args.only and not any(text in name for text in args.only):
                continue
            built = build()
            env, argv = built if isinstance(built, tuple) else ({}, built)
            with environment(env):
                rc, secs, line = run_cli(argv)
            ok = rc == 2 and (expect in line or expect in line.replace(str(tmp), "TMP"))
            rows.append((name, rc, secs, line.replace(str(tmp), "TMP"), ok))
            print(f"{'ok ' if ok else 'BAD'} {name}: rc={rc} {secs:.1f}s {line[:160]}", file=sys.stderr)
        if args.only:
            return _update_rows(rows, args.out)
        http_rows = probe_server(tmp)
    table = ["| case | exit | seconds | first line of stderr | check |", "|---|---|---|---|---|"]
    table += [_row(*r) for r in rows]
    table += [
        "",
        "Requests to a running `judgeloop serve-judge` (a length judge; `server.max_chars_per_text=50`,",
        '`server.read_timeout_s=1`); each must get a 4xx and `{"error": "<one line>"}`, the server staying up:',
        "",
        "| request | status | seconds | body | check |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {n} | {status} | {s:.1f} | `{body.replace('|', '/')}` | {'ok' if ok else 'FAILED'} |"
        for n, status, s, body, ok in http_rows
    ]
    rows += [(n, 2, s, b, ok) for n, _, s, b, ok in http_rows]  # for the exit status
    text = "\n".join(table) + "\n"
    sys.stdout.write(text)
    if args.out:
        from judgeloop.io import atomic_write_text

        atomic_write_text(args.out, text)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
