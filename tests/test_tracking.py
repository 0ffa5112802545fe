"""Trackers: any accelerate tracker through ``log_with``, read back from TensorBoard's event files and from
MLflow's local file store (both offline); a tracker that is named but not installed is a one-line error
before any work; an ablation's jobs are named runs in one group."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from judgeloop.config import ConfigError, load_config
from judgeloop.loop.config import FeedbackLoopConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
HAVE_TB = importlib.util.find_spec("tensorboard") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None


def _tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: list[tuple[int, float]] = []
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out += [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def _mlflow_run(uri: str, experiment: str, run_name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == run_name]
    assert len(runs) == 1, [r.info.run_name for r in client.search_runs([exp.experiment_id])]
    return client, runs[0]


@pytest.mark.slow
@pytest.mark.skipif(
    not (HAVE_TB and HAVE_MLFLOW), reason="tensorboard and mlflow(-skinny) are dev dependencies"
)
def test_the_loop_logs_to_tensorboard_and_mlflow_and_both_read_back(tmp_path, monkeypatch):
    from judgeloop.recipes import train
    from loop_common import FAST  # tests/ is on sys.path under pytest

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind a flag
    out = tmp_path / "run"
    over = [
        *FAST,
        "max_steps=2",
        f"output_dir={out}",
        "log_with=[jsonl,tensorboard,mlflow]",
        "project_name=judgeloop-test",
    ]
    train(load_config(FeedbackLoopConfig, TINY, over))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert [s for s, _ in want] == [1, 2]
    tb = _tensorboard_scalars(out, "train/loss")
    assert [s for s, _ in tb] == [1, 2]
    assert [v for _, v in tb] == pytest.approx([v for _, v in want], rel=1e-6)
    client, run = _mlflow_run(uri, "judgeloop-test", "platt-seed0")  # tiny.yaml's method, seed 0
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert [s for s, _ in history] == [1, 2]
    assert [v for _, v in history] == pytest.approx([v for _, v in want], rel=1e-6)
    eval_rows = [r for r in rows if "eval/rouge_l_neutral" in r]
    ml_eval = client.get_metric_history(run.info.run_id, "eval/rouge_l_neutral")
    assert sorted(m.step for m in ml_eval) == [r["step"] for r in eval_rows]
    assert run.data.params["calibration.method"] == "platt"  # the config, flattened, as parameters


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="checks a tracker that is absent")
def test_a_tracker_that_is_not_installed_is_a_one_line_error_before_any_work(tmp_path):
    from judgeloop.recipes import train

    out = tmp_path / "run"
    cfg = load_config(FeedbackLoopConfig, TINY, [f"output_dir={out}", "log_with=[jsonl,wandb]"])
    with pytest.raises(
        ConfigError, match=r"log_with names 'wandb' but it is not installed; pip install wandb"
    ):
        train(cfg)
    assert not out.exists()


def test_an_unknown_tracker_names_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"unknown tracker\(s\) \['tensorbord'\]; choose from \['jsonl', 'tensorboard'"
    ):
        load_config(FeedbackLoopConfig, TINY, ["log_with=[tensorbord]"])
    # jsonl is always written (the loop's resume reads it back)
    assert load_config(FeedbackLoopConfig, TINY, ["log_with=[]"]).log_with == ["jsonl"]


def test_ablation_jobs_are_named_runs_in_one_group(tmp_path):
    from judgeloop.studies.ablation import arm_config
    from judgeloop.studies.ablation_config import AblateConfig

    cfg = load_config(AblateConfig, TINY, [f"output_dir={tmp_path / 'study'}"])
    jobs = [arm_config(cfg, arm, seed) for arm in ("raw", "platt") for seed in (0, 1)]
    assert [j.run_name for j in jobs] == ["raw-seed0", "raw-seed1", "platt-seed0", "platt-seed1"]
    assert {j.run_group for j in jobs} == {"study"}


@pytest.mark.skipif(not HAVE_TB, reason="tensorboard is a dependency")
def test_the_retriever_logs_through_the_same_trackers(tmp_path):
    from test_retrieval_command import _cfg, _overrides, beir_dir  # noqa: F401 - the fixture's body

    from judgeloop.commands.train_retriever import run

    data = tmp_path / "data"
    data.mkdir()
    import test_retrieval_command as trc

    (data / "corpus.jsonl").write_text(
        "".join(
            json.dumps({"_id": f"d{i}", "title": f"Doc {i}", "text": t}) + "\n"
            for i, t in enumerate(trc.DOCS)
        )
    )
    (data / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(trc.QUERIES))
    )
    rows = [f"q{i}\td{i}\t1" for i in range(len(trc.QUERIES))]
    (data / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out"
    cfg = trc._cfg(
        trc._overrides(
            data, out, "train.num_epochs=2", "train.log_every_n_steps=1", "log_with=[jsonl,tensorboard]"
        )
    )
    report = run(cfg)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in logged if "train/loss" in r]
    assert steps == list(range(1, report["steps"] + 1)) and steps
    assert [s for s, _ in _tensorboard_scalars(out, "train/loss")] == steps
    final = [r for r in logged if "eval/ndcg@10" in r]
    assert [r["step"] for r in final] == [0, report["steps"]]
    assert final[-1]["eval/ndcg@10"] == pytest.approx(report["after"]["ndcg@10"])


@pytest.mark.skipif(not HAVE_MLFLOW, reason="mlflow(-skinny) is a dev dependency")
def test_mlflow_without_a_tracking_uri_logs_under_output_dir_and_writes_nothing_to_the_cwd(
    tmp_path, monkeypatch
):
    """mlflow-skinny and no MLFLOW_TRACKING_URI: MLflow's own default (sqlite:///mlflow.db in the working
    directory) fails mid-run; the run logs to a file store under output_dir instead, the cwd stays empty."""
    import mlflow
    from accelerate import Accelerator

    from judgeloop.tracking import init_trackers, make_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "run"
    try:
        acc = Accelerator(cpu=True, log_with=make_trackers(["jsonl", "mlflow"], out), project_dir=str(out))
        init_trackers(acc, "judgeloop-test", "platt-seed0", "grid", {"calibration": {"method": "platt"}})
        acc.log({"train/loss": 0.5}, step=1)
        acc.log({"train/loss": 0.25}, step=2)
        acc.end_training()
        uri = (out / "mlruns").as_uri()
        assert mlflow.get_tracking_uri() == uri
        client, run = _mlflow_run(uri, "judgeloop-test", "platt-seed0")
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
        assert history == [(1, 0.5), (2, 0.25)]
        assert list(cwd.iterdir()) == []  # no mlflow.db, no mlruns/ where the command was started
    finally:
        mlflow.set_tracking_uri("")
