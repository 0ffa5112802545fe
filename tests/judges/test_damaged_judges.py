"""Damaged saved judges: a truncated or invalid file, a non-numeric or non-finite parameter, a method that
does not match its parameters. Loading checks everything it reads; ``label-pairs`` and ``serve-judge``
stop with one line naming the file, before writing or serving anything (issue 40)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from judgeloop.calibration import PlattCalibrator
from judgeloop.calibration.calibrators import CalibrationError, load_calibrator
from judgeloop.cli import main as cli
from judgeloop.config import ConfigError
from judgeloop.io import DataError, read_json
from judgeloop.judges import JudgeConfig
from judgeloop.judges.calibrated import CalibratedJudge

ROOT = Path(__file__).resolve().parents[2]
JUDGELOOP = str(Path(sys.executable).parent / "judgeloop")


def _saved_judge(folder: Path) -> Path:
    """A real calibrated judge that needs no model: the objective length signal, Platt-fitted."""
    cal = PlattCalibrator(min_points=2).fit([-2.0, -1.0, 1.0, 2.0, 0.5, -0.5], [0, 0, 1, 1, 1, 0])
    CalibratedJudge(JudgeConfig(type="objective", signal="length"), cal, {"method": "platt"}).save_pretrained(
        folder
    )
    return folder


def _edit(path: Path, change) -> None:
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


def _truncate(path: Path) -> None:
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


# (case, file damaged, the damage, text the one error line must hold)
DAMAGES = [
    ("truncated calibrator", "calibrator.json", _truncate, "not valid JSON"),
    ("truncated card", "calibrated_judge.json", _truncate, "not valid JSON"),
    ("empty calibrator", "calibrator.json", lambda p: p.write_text(""), "not valid JSON"),
    ("card is a list", "calibrated_judge.json", lambda p: p.write_text("[1]"), "expected a JSON object"),
    (
        "NaN slope (bare NaN)",
        "calibrator.json",
        lambda p: p.write_text(p.read_text().replace('"a_": ', '"a_": NaN, "x": ')),
        "NaN is not strict JSON",
    ),
    (
        "NaN slope (saved as null)",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s["params"].update(a_=None)),
        "params.a_ must be a finite number, got None",
    ),
    (
        "string slope",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s["params"].update(a_="1.5")),
        "params.a_ must be a finite number, got '1.5'",
    ),
    (
        "wrong method",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s.update(method="temperature")),
        "parameters do not match method 'temperature'",
    ),
    (
        "unknown method",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s.update(method="magic")),
        "calibrator method 'magic' is not one of",
    ),
    (
        "string flag",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s["params"].update(fit_intercept="no")),
        "params.fit_intercept must be true or false",
    ),
    (
        "unfitted",
        "calibrator.json",
        lambda p: _edit(p, lambda s: s.update(n_fit_=0)),
        "the calibrator was never fitted",
    ),
    (
        "card names another method",
        "calibrated_judge.json",
        lambda p: _edit(p, lambda s: s.update(method="isotonic")),
        "holds a 'platt' calibrator",
    ),
]
IDS = [d[0] for d in DAMAGES]


@pytest.fixture(scope="module")
def good_judge(tmp_path_factory) -> Path:
    return _saved_judge(tmp_path_factory.mktemp("judge") / "length_judge")


def _damaged(good: Path, tmp: Path, name: str, damage) -> Path:
    folder = tmp / "damaged"
    for f in good.iterdir():
        (folder / f.name).parent.mkdir(parents=True, exist_ok=True)
        (folder / f.name).write_bytes(f.read_bytes())
    damage(folder / name)
    return folder


@pytest.mark.parametrize("case, name, damage, message", DAMAGES, ids=IDS)
def test_from_pretrained_refuses_a_damaged_judge_in_one_line_naming_the_file(
    good_judge, tmp_path, case, name, damage, message
):
    assert CalibratedJudge.from_pretrained(good_judge).calibrator.method == "platt"
    folder = _damaged(good_judge, tmp_path, name, damage)
    with pytest.raises(ConfigError) as err:
        CalibratedJudge.from_pretrained(folder)
    text = str(err.value)
    assert "\n" not in text and message in text and str(folder / name) in text, text


@pytest.mark.parametrize("case, name, damage, message", DAMAGES, ids=IDS)
def test_label_pairs_on_a_damaged_judge_is_one_line_before_any_output(
    good_judge, tmp_path, capsys, case, name, damage, message
):
    folder = _damaged(good_judge, tmp_path, name, damage)
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "an article", "chosen": "a summary", "rejected": "another"}) + "\n")
    args = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        f"judge_path={folder}",
        f"data.path={data}",
        "data.fields.source=null",
        "data.fields.references=null",
        f"output_dir={tmp_path / 'out'}",
    ]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(folder / name) in err[0], err
    assert not (tmp_path / "out").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, name, damage, message",
    [
        d
        for d in DAMAGES
        if d[0] in ("truncated calibrator", "NaN slope (saved as null)", "wrong method", "string slope")
    ],
)
def test_serve_judge_on_a_damaged_judge_fails_in_one_line_before_binding(
    good_judge, tmp_path, case, name, damage, message
):
    folder = _damaged(good_judge, tmp_path, name, damage)
    port = _free_port()
    done = subprocess.run(
        [
            JUDGELOOP,
            "serve-judge",
            "--config",
            str(ROOT / "configs/serve/judge.yaml"),
            f"judge_path={folder}",
            f"server.port={port}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and message in err[0] and str(folder / name) in err[0], err
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port was never taken


def test_read_json_names_the_file_for_each_kind_of_damage(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(DataError, match=r"thing .*x.json does not exist; fix it"):
        read_json(path, "thing", "fix it")
    for text, message in [
        ('{"a": 1', "not valid JSON"),
        ("[]", "expected a JSON object, got list"),
        ('{"a": Infinity}', "Infinity is not strict JSON"),
    ]:
        path.write_text(text)
        with pytest.raises(DataError, match=message):
            read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(DataError, match="not UTF-8"):
        read_json(path)
    path.write_text('{"a": 1}')
    assert read_json(path) == {"a": 1}


def test_load_calibrator_and_load_state_dict_check_every_parameter(tmp_path):
    cal = PlattCalibrator(min_points=2).fit([-1.0, 1.0, 2.0, -2.0], [0, 1, 1, 0])
    path = tmp_path / "cal.json"
    cal.save(path)
    assert load_calibrator(path).state_dict() == cal.state_dict()
    state = cal.state_dict()
    for change, message in [
        ({"params": {**state["params"], "a_": float("nan")}}, "params.a_ must be a finite number, got nan"),
        ({"params": {**state["params"], "b_": float("inf")}}, "params.b_ must be a finite number"),
        ({"params": {**state["params"], "temperature_": 1.0}}, r"unexpected \['temperature_'\]"),
        ({"symmetric": "yes"}, "'symmetric' must be true or false"),
        ({"min_points": 2.5}, "'min_points' must be an integer"),
    ]:
        with pytest.raises(CalibrationError, match=message):
            PlattCalibrator().load_state_dict({**state, **change})
    from judgeloop.calibration.calibrators import IsotonicCalibrator, TemperatureCalibrator

    t = TemperatureCalibrator().state_dict() | {"n_fit_": 4}
    with pytest.raises(CalibrationError, match="temperature_ must be positive"):
        TemperatureCalibrator().load_state_dict(t | {"params": {"temperature_": -1.0}})
    for unfitted in (
        IsotonicCalibrator(),
        PlattCalibrator(),
        TemperatureCalibrator(),
    ):  # a resumed loop has them
        assert type(unfitted)().load_state_dict(unfitted.state_dict()).n_fit_ == 0
    iso = IsotonicCalibrator().state_dict() | {"n_fit_": 4}
    with pytest.raises(CalibrationError, match="non-empty once fitted"):
        IsotonicCalibrator().load_state_dict(
            iso | {"params": {**iso["params"], "x_": [0.0, 1.0], "y_": [0.5]}}
        )
    with pytest.raises(CalibrationError, match="list of finite numbers"):
        IsotonicCalibrator().load_state_dict(
            iso | {"params": {**iso["params"], "x_": [0.0, None], "y_": [0, 1]}}
        )
    path.write_text(path.read_text()[:20])
    with pytest.raises(CalibrationError, match=rf"calibrator file {path}: not valid JSON"):
        load_calibrator(path)
