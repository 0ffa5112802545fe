"""``judgeloop label-pairs`` input handling: ``data.max_pairs`` samples across the prompts (seeded), the
report says how many prompts the pairs cover, and a dataset mixing TRL's two formats is refused. (Its
output training TRL's DPOTrainer, in both formats: tests/integrations/test_trl_integration.py.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from judgeloop.cli import main as cli
from judgeloop.io import DataError
from judgeloop.preference_labels import PairDataConfig, read_pairs, sample_across_prompts

ROOT = Path(__file__).resolve().parents[1]


def _sorted_by_prompt(path: Path, prompts: int = 4, per_prompt: int = 12) -> Path:
    """A file sorted by prompt, as SummEval's pairs are (every pair of one article, then the next)."""
    rows = [
        {
            "prompt": f"article {k}: the council met on day {k} and voted on the budget.",
            "chosen": f"The council voted on the budget on day {k}, pair {j}.",
            "rejected": f"Day {k} {j}.",
        }
        for k in range(prompts)
        for j in range(per_prompt)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_max_pairs_spreads_over_the_prompts_deterministically(tmp_path):
    data = _sorted_by_prompt(tmp_path / "pairs.jsonl")
    pairs, in_data, _ = read_pairs(PairDataConfig(path=str(data), max_pairs=10, seed=0))
    assert in_data == 4 and len(pairs) == 10
    per_prompt = Counter(p.prompt for p in pairs)
    assert len(per_prompt) == 4 and sorted(per_prompt.values()) == [2, 2, 3, 3]  # not the head's one prompt
    again, _, _ = read_pairs(PairDataConfig(path=str(data), max_pairs=10, seed=0))
    assert [(p.prompt, p.first) for p in again] == [(p.prompt, p.first) for p in pairs]
    other, _, _ = read_pairs(PairDataConfig(path=str(data), max_pairs=10, seed=1))
    assert [(p.prompt, p.first) for p in other] != [(p.prompt, p.first) for p in pairs]
    everything, _, _ = read_pairs(PairDataConfig(path=str(data), max_pairs=1000))
    assert len(everything) == 48


def test_sample_across_prompts_takes_each_prompts_rows_once():
    keys = ["a"] * 5 + ["b"] + ["c"] * 2
    got = sample_across_prompts(keys, 6, seed=3)
    assert got == sorted(set(got)) and len(got) == 6  # distinct rows, in file order
    assert Counter(keys[i] for i in got) == {"a": 3, "b": 1, "c": 2}  # b and c exhausted, a fills up


def test_the_report_says_how_many_prompts_the_pairs_cover(tiny_calibration, tmp_path):
    data = _sorted_by_prompt(tmp_path / "pairs.jsonl")
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.source=null",
            "data.fields.references=null",
            "data.max_pairs=6",
            "data.seed=5",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"] == report["labeled"] == 6
    assert report["prompts"] == {"in_data": 4, "judged": 4, "labeled": 4}
    assert report["max_pairs"] == 6 and report["seed"] == 5 and report["format"] == "standard"
    assert "they cover 4 of the data's 4 prompts, sampled with seed 5" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [
                {"prompt": "p", "chosen": "c", "rejected": "r"},
                {"prompt": [{"role": "user", "content": "p"}], "chosen": "c", "rejected": "r"},
            ],
            ":2: this row is chat messages but the first row is text; give every row in one format",
        ),
        (
            [{"prompt": "p", "chosen": "c", "rejected": "r"}],
            "data.max_pairs=0 must be >= 1 (null: every pair)",
        ),
    ],
)
def test_label_pairs_refuses_mixed_formats_and_a_bad_max_pairs(
    tiny_calibration, tmp_path, capsys, rows, message
):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "label-pairs",
        "--config",
        str(ROOT / "configs/label_pairs/summeval.yaml"),
        f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
        f"data.path={data}",
        "data.fields.source=null",
        "data.fields.references=null",
        f"output_dir={tmp_path / 'out'}",
    ]
    if "max_pairs" in message:
        args.append("data.max_pairs=0")
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError) if "format" in message else pytest.raises(ValueError):
        read_pairs(PairDataConfig(path=str(data), max_pairs=0 if "max_pairs" in message else None))


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_summeval_pairs_writes_an_instruction_prompt(shared_data, tmp_path, chat):
    """The prompt is the feedback loop's instruction with the article, not the bare article (which the
    judge reads from ``article``); ``--chat`` writes TRL's conversational format."""
    import subprocess
    import sys

    from judgeloop.loop.config import PolicyConfig

    out = tmp_path / "pairs.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "scripts/summeval_pairs.py"),
        "--out",
        str(out),
        "--data",
        str(shared_data / "summeval" / "summeval_dev.jsonl"),
    ] + (["--chat"] if chat else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows
    for r in rows[:50]:
        prompt = r["prompt"][0]["content"] if chat else r["prompt"]
        assert prompt == PolicyConfig.prompt_template.format(article=r["article"]) != r["article"]
        assert prompt.startswith("Summarize the following text")
        if chat:
            assert r["prompt"][0]["role"] == "user" and r["chosen"][0]["role"] == "assistant"
        else:
            assert isinstance(r["chosen"], str) and isinstance(r["rejected"], str)


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"prompt": 3},
            ":2: field 'prompt' must be a string or a list of {'role', 'content'} messages"
            " with string content, got number 3;",
        ),
        (
            {"chosen": None},
            ":2: field 'chosen' must be a string or a list of {'role', 'content'} messages"
            " with string content, got null;",
        ),
    ],
)
def test_a_field_of_the_wrong_kind_stops_label_pairs_before_anything_is_written(
    tiny_calibration, tmp_path, capsys, bad, message
):
    """A number prompt was a pyarrow traceback after labeled.jsonl was written; a null was judged as "None"."""
    good = {"prompt": "p", "chosen": "a longer completion", "rejected": "short"}
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps({**good, **bad}) + "\n")
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.source=null",
            "data.fields.references=null",
            f"output_dir={out}",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{data}{message}" in err[0], err
    assert not out.exists()


def test_pairs_with_equal_completions_are_dropped_and_counted(tiny_calibration, tmp_path, caplog):
    """Two equal completions have no better side: judging them counted as the judge agreeing (or not)."""
    rows = [
        {"prompt": f"p{i}", "chosen": f"the council voted on day {i}", "rejected": f"day {i}"}
        for i in range(4)
    ]
    rows[1]["rejected"] = rows[1]["chosen"] + " "  # equal but for whitespace
    rows[3]["rejected"] = rows[3]["chosen"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, in_data, equal = read_pairs(PairDataConfig(path=str(data)))
    assert [p.prompt for p in pairs] == ["p0", "p2"] and in_data == 4 and equal == 2
    assert f"dropped 2 pair(s) whose two completions are the same text (the first: {data}:2)" in caplog.text
    out = tmp_path / "out"
    rc = cli(
        [
            "label-pairs",
            "--config",
            str(ROOT / "configs/label_pairs/summeval.yaml"),
            f"judge_path={tiny_calibration / 'calibrated_judge' / 'platt'}",
            f"data.path={data}",
            "data.fields.source=null",
            "data.fields.references=null",
            f"output_dir={out}",
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"] == 2 and report["dropped"]["equal_completions"] == 2
    assert report["agreement_with_dataset"]["n"] == 2
    assert "'equal_completions': 2" in (out / "report.md").read_text()
    data.write_text(json.dumps(rows[3]) + "\n")
    with pytest.raises(DataError, match="every pair's two completions are the same text; nothing to judge"):
        read_pairs(PairDataConfig(path=str(data)))


def test_a_saved_dataset_is_checked_row_by_row_like_a_file(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": 1, "chosen": "a", "rejected": "b"}]).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(
        DataError, match=r"ds row 0: field 'prompt' must be a string or a list .* got number 1;"
    ):
        read_pairs(PairDataConfig(path=str(tmp_path / "ds"), format="hf"))
