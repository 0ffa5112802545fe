"""The ``conformal`` and ``gate`` commands end to end on a small synthetic BEIR set with the tiny encoder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from judgeloop.config import load_config

ROOT = Path(__file__).resolve().parents[2]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
    "rho",
    "tau",
    "phi",
    "chi",
    "psi",
    "amber",
    "basalt",
    "cobalt",
    "dune",
    "ember",
    "flint",
    "garnet",
    "heath",
    "iris",
    "jade",
]


def _beir(tmp_path: Path, n_queries: int = 60, n_docs: int = 150) -> dict[str, str]:
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, 12)) for _ in range(n_docs)]
    with (tmp_path / "corpus.jsonl").open("w") as fh:
        for i, t in enumerate(docs):
            fh.write(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n")
    qrels = ["query-id\tcorpus-id\tscore"]
    with (tmp_path / "queries.jsonl").open("w") as fh:
        for q in range(n_queries):
            rel = rng.choice(n_docs, 1 + (q % 3 == 0), replace=False)
            text = " ".join(docs[rel[0]].split()[:4])  # the query quotes its first relevant doc
            fh.write(
                json.dumps({"_id": f"q{q}", "text": text, "task": ["qa/a", "qa/b", "chat"][q % 3]}) + "\n"
            )
            qrels += [f"q{q}\td{d}\t1" for d in rel]
    (tmp_path / "qrels.tsv").write_text("\n".join(qrels) + "\n")
    return {
        "corpus": str(tmp_path / "corpus.jsonl"),
        "queries": str(tmp_path / "queries.jsonl"),
        "qrels": str(tmp_path / "qrels.tsv"),
    }


def _data_overrides(paths: dict[str, str]) -> list[str]:
    return [
        f"data.corpus_path={paths['corpus']}",
        f"data.queries_path={paths['queries']}",
        f"data.qrels_path={paths['qrels']}",
        "encoder.name=judgeloop-tiny/encoder",
    ]


def test_config_errors():
    from judgeloop.commands.conformal import ConformalConfig
    from judgeloop.commands.gate import GateConfig
    from judgeloop.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'conformal.alphas'"):
        load_config(ConformalConfig, None, ["conformal.alpha=[0.1]"])
    with pytest.raises(ConfigError, match=r"conformal.alphas=\[1.5\] must be"):
        load_config(ConformalConfig, None, ["conformal.alphas=[1.5]"])
    with pytest.raises(ConfigError, match="gate.signals=.* is not one of"):
        load_config(GateConfig, None, ["gate.signals=[max_scor]"])


def test_conformal_command_end_to_end(tmp_path):
    from judgeloop.commands.conformal import ConformalConfig, run

    paths = _beir(tmp_path)
    out = tmp_path / "out"
    cfg = load_config(
        ConformalConfig,
        ROOT / "configs" / "conformal" / "scifact.yaml",
        _data_overrides(paths)
        + [
            "data.group_field=task",
            "conformal.top_k=20",
            "conformal.max_set_size=null",
            "conformal.min_group_size=10",
            "num_trials=5",
            f"output_dir={out}",
            f"cache_dir={tmp_path / 'cache'}",
        ],
    )
    report = run(cfg)
    assert [r["alpha"] for r in report["results"]] == [0.05, 0.1, 0.2]
    saved = json.loads((out / "report.json").read_text())
    for r in saved["results"]:
        assert {"alpha", "coverage", "mean_set_size", "groups"} <= set(r)
        assert set(r["groups"]) == {"qa/a", "qa/b", "chat"}
        for g in r["groups"].values():
            assert {"n_cal", "coverage", "mean_set_size", "threshold"} <= set(g)
            assert g["n_cal"] > 0
        # ~10 calibration points per group: qa/a and qa/b use their own or their parent's ("qa") threshold
        assert set(r["groups"]["qa/a"]["threshold_source"]) <= {"own", "parent:qa", "global"}
        assert set(r["groups"]["chat"]["threshold_source"]) <= {"own", "global"}
    assert "# Conformal retrieval report" in (out / "report.md").read_text()
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2  # corpus + queries cached (embedding_cache)

    # a single alpha: the keys sit at the top level too
    one = run(
        load_config(
            ConformalConfig,
            None,
            _data_overrides(paths)
            + [
                "conformal.alphas=[0.2]",
                "conformal.top_k=20",
                "num_trials=3",
                "data.grouping=none",
                f"output_dir={tmp_path / 'one'}",
                f"cache_dir={tmp_path / 'cache'}",
            ],
        )
    )
    assert one["alpha"] == 0.2 and set(one["groups"]) == {"all"} and 0.0 <= one["coverage"] <= 1.0


def test_conformal_command_base_rates_unseen_group_cap_and_size_alarm(tmp_path, caplog):
    """tau(alpha, beta) per group, a held-out group tested as unseen (the most conservative threshold, one
    log line per alpha), the cap's cost and the online set-size alarm, end to end."""
    import logging

    from judgeloop.commands.conformal import ConformalConfig, run

    paths = _beir(tmp_path, n_queries=90)
    out = tmp_path / "out"
    cfg = load_config(
        ConformalConfig,
        ROOT / "configs" / "conformal" / "scifact.yaml",
        _data_overrides(paths)
        + [
            "data.group_field=task",
            "conformal.threshold_rule=base_rate",
            "conformal.alphas=[0.2,0.3]",
            "conformal.holdout_groups=[chat]",
            "conformal.top_k=20",
            "conformal.min_group_size=10",
            "conformal.max_set_size=2",
            "online.warmup=10",
            "online.window=20",
            "online.monitor_window=10",
            "online.max_mean_set_size=1.5",
            "num_trials=4",
            f"output_dir={out}",
            f"cache_dir={tmp_path / 'cache'}",
        ],
    )

    with caplog.at_level(logging.INFO, logger="judgeloop.studies.conformal"):
        report = run(cfg)
    assert report["tau"] == {"threshold_rule": "base_rate", "beta": 0.95, "interval": "wilson"}
    for r in report["results"]:
        chat, own = r["groups"]["chat"], [r["groups"][g] for g in ("qa/a", "qa/b")]
        assert chat["threshold_source"] == {"most_conservative": 4} and chat["n_cal"] == 0
        assert chat["threshold"] >= max(g["threshold"] for g in own)  # the most conservative threshold
        assert 0.0 <= chat["coverage"] <= 1.0
        for g in own:
            assert 0.0 < g["base_rate"]["low"] <= g["base_rate"]["rate"] <= 1.0
        assert r["cap"]["max_set_size"] == 2 and r["cap"]["mean_set_size"] <= 2
        assert r["cap"]["coverage_cost"] == pytest.approx(r["coverage"] - r["cap"]["coverage"])
        assert r["cap"]["coverage_cost"] >= 0
    unseen = [x for x in [r.getMessage() for r in caplog.records] if "unseen group 'chat'" in x]
    assert len(unseen) == 2 and all("the most conservative threshold, tau=" in x for x in unseen)
    for o in report["online"]:
        for arm in ("sliding_window", "aci"):
            assert {"median_set_size", "frac_whole_corpus", "num_size_alarm_steps"} <= set(o[arm])
    md = (out / "report.md").read_text()
    assert "tau(alpha, beta)" in md and "most conservative threshold" in md and "capped coverage" in md


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "conformal.beta=1.5",
            "conformal.beta=1.5 must be in (0, 1) (the base rate interval's confidence level)",
        ),
        ("conformal.confidence=0.9", "config key 'conformal.confidence' is now 'conformal.beta'"),
        ("conformal.threshold_rule=mean", "conformal.threshold_rule"),
        ("conformal.max_set_size=0", "conformal.max_set_size=0 must be >= 1 or null (no cap)"),
        ("conformal.max_set_size=5000", "conformal.max_set_size=5000 exceeds conformal.top_k=1000"),
        ("conformal.holdout_groups=[top1/9]", "conformal.holdout_groups=['top1/9']: no group ['top1/9']"),
        (
            "conformal.holdout_groups=[top1/1,top1/2,top1/3]",
            "holds out every group under data.grouping=base_rate",
        ),
        ("online.max_mean_set_size=0", "online.max_mean_set_size=0.0 must be > 0 (documents) or null"),
    ],
)
def test_conformal_config_errors_are_one_line_before_any_work(tmp_path, capsys, override, line):
    from judgeloop.cli import main

    out = tmp_path / "o"
    rc = main(
        ["conformal", "--config", str(ROOT / "configs/conformal/scifact.yaml"), override, f"output_dir={out}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("judgeloop conformal: config error: ")
    assert line in err[0]
    assert not out.exists()


def test_conformal_labels_with_a_cap_is_refused():
    from judgeloop.commands.conformal import ConformalConfig
    from judgeloop.config import ConfigError

    with pytest.raises(
        ConfigError, match="conformal.max_set_size=5 caps a retrieval set, but conformal.guarantee=labels"
    ):
        load_config(ConformalConfig, None, ["conformal.guarantee=labels", "conformal.max_set_size=5"])


def test_conformal_holdout_of_a_missing_field_group_stops_before_encoding(tmp_path):
    from judgeloop.commands.conformal import ConformalConfig, run
    from judgeloop.io import DataError

    paths = _beir(tmp_path, n_queries=12, n_docs=30)
    cfg = load_config(
        ConformalConfig,
        None,
        _data_overrides(paths)
        + [
            "data.group_field=task",
            "conformal.holdout_groups=[code]",
            f"output_dir={tmp_path / 'o'}",
            f"cache_dir={tmp_path / 'cache'}",
        ],
    )
    with pytest.raises(
        DataError,
        match=r"conformal.holdout_groups=\['code'\]: no group \['code'\] under data.group_field=task",
    ):
        run(cfg)
    assert not list((tmp_path / "cache").glob("*.pt"))  # nothing was encoded


def test_conformal_command_missing_group_field(tmp_path):
    from judgeloop.commands.conformal import ConformalConfig, run
    from judgeloop.io import DataError

    paths = _beir(tmp_path, n_queries=12, n_docs=30)
    cfg = load_config(
        ConformalConfig,
        None,
        _data_overrides(paths)
        + ["data.group_field=difficulty", "num_trials=1", f"output_dir={tmp_path / 'o'}", "cache_dir=null"],
    )
    with pytest.raises(DataError, match="has no field 'difficulty'"):
        run(cfg)


def test_gate_command_end_to_end(tmp_path):
    from judgeloop.commands.gate import GateConfig, run

    paths = _beir(tmp_path)
    out = tmp_path / "gate"
    cfg = load_config(
        GateConfig,
        ROOT / "configs" / "gate" / "scifact.yaml",
        _data_overrides(paths)
        + [
            "second_encoder.name=judgeloop-tiny/encoder",
            "gate.window_k=5",
            "gate.min_separation=0.5",
            "gate.num_bootstrap=50",
            f"output_dir={out}",
            "cache_dir=null",
        ],
    )
    report = run(cfg)
    assert set(report["signals"]) == set(cfg.gate.signals)
    for s in report["signals"].values():
        assert 0.0 <= s["auc_test"] <= 1.0 and len(s["auc_test_ci95"]) == 2
    assert report["fit_error"] is None
    assert 0.0 <= report["gate"]["test"]["escalation_rate"] <= 1.0
    assert (out / "gate.json").is_file() and "# Weak-retrieval gate report" in (out / "report.md").read_text()


def _escalate(paths: dict[str, str], tmp_path: Path, method: str, *extra: str):
    from judgeloop.commands.gate import GateConfig, run

    cfg = load_config(
        GateConfig,
        ROOT / "configs" / "gate" / "scifact_escalate.yaml",
        _data_overrides(paths)
        + [
            "second_encoder.name=judgeloop-tiny/encoder",
            "gate.window_k=5",
            "gate.min_separation=0.5",
            "gate.num_bootstrap=20",
            f"escalation.method={method}",
            "escalation.depth=20",
            "escalation.num_bootstrap=50",
            f"output_dir={tmp_path / method}",
            "cache_dir=null",
            *extra,
        ],
    )
    return run(cfg)


@pytest.mark.parametrize("method", ["fuse", "abstain"])
def test_gate_escalation_end_to_end(tmp_path, method):
    paths = _beir(tmp_path)
    report = _escalate(paths, tmp_path, method)
    e = report["escalation"]
    n, nf = e["num_queries"], e["num_flagged"]
    assert n == report["data"]["n_test"] and nf == report["gate"]["test"]["num_escalated"]
    assert 0 < nf < n, "the synthetic set should flag some test queries and not others"
    for key in ("flagged_before", "flagged_after", "all_before", "all_after", "all_escalate_every"):
        assert set(e[key]) == {"ndcg@5", "recall@5"}
    # the unflagged queries keep their rankings: the all-query mean mixes the flagged mean and theirs
    for m in ("ndcg@5", "recall@5"):
        mixed = (nf * e["flagged_after"][m] + (n - nf) * e["unflagged_before"][m]) / n
        assert e["all_after"][m] == pytest.approx(mixed)
        d = e["deltas"]["flagged_after_minus_before"][m]
        assert d["delta"] == pytest.approx(e["flagged_after"][m] - e["flagged_before"][m])
        assert d["ci95"][0] <= d["delta"] <= d["ci95"][1] and d["n"] == nf
    cost = e["extra_cost_per_100_queries"]
    assert (
        cost["gated"]["escalated"] == pytest.approx(100 * nf / n)
        and cost["escalate_every"]["escalated"] == 100
    )
    if method == "abstain":
        assert e["flagged_after"] == {"ndcg@5": 0.0, "recall@5": 0.0}
        assert cost["gated"]["retrievals"] == 0 and e["answered"]["coverage"] == pytest.approx(1 - nf / n)
    else:
        assert (
            cost["gated"]["retrievals"] == pytest.approx(100 * nf / n) and cost["gated"]["model_calls"] == 0
        )
    saved = json.loads((tmp_path / method / "report.json").read_text())
    assert saved["escalation"]["flagged_before"] == pytest.approx(e["flagged_before"])
    assert "## Escalation:" in (tmp_path / method / "report.md").read_text()


def test_gate_escalation_by_rewrite_with_a_tiny_model(tmp_path):
    paths = _beir(tmp_path, n_queries=30, n_docs=60)
    e = _escalate(
        paths,
        tmp_path,
        "rewrite",
        "escalation.rewrite_model=judgeloop-tiny/causal-lm",
        "escalation.rewrite_max_new_tokens=4",
    )
    assert e["escalation"]["extra_cost_per_100_queries"]["escalate_every"]["model_calls"] == 100
    assert all(s["expanded"].startswith(s["query"]) for s in e["escalation"]["rewrite_samples"])


def test_gate_escalation_model_missing_is_one_line_before_any_work(tmp_path, capsys):
    from judgeloop.cli import main

    rc = main(
        [
            "gate",
            "--config",
            str(ROOT / "configs/gate/scifact_escalate.yaml"),
            "escalation.method=rewrite",
            "escalation.rewrite_model=no-such-org/no-such-model",
            f"data.corpus_path={tmp_path / 'missing.jsonl'}",
            f"output_dir={tmp_path / 'o'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "escalation.rewrite_model='no-such-org/no-such-model' is not in the Hugging Face cache" in err[0]
    assert not (tmp_path / "o").exists()


def test_a_group_field_of_the_wrong_kind_stops_before_any_encoding(tmp_path):
    """A list as a query's group was str()-ed into a group name ("['qa']") after the encoder had run."""
    from judgeloop.commands.conformal import ConformalConfig
    from judgeloop.io import DataError
    from judgeloop.retrieval.dense import load_retrieval_data

    paths = _beir(tmp_path, n_queries=12, n_docs=30)
    lines = Path(paths["queries"]).read_text().splitlines()
    lines[3] = json.dumps({**json.loads(lines[3]), "task": ["qa"]})
    Path(paths["queries"]).write_text("\n".join(lines) + "\n")
    cfg = load_config(ConformalConfig, None, _data_overrides(paths) + ["data.group_field=task"])
    with pytest.raises(DataError) as err:
        load_retrieval_data(cfg.data)
    assert str(err.value).startswith(
        f"{paths['queries']}:4: field 'task' must be a string or an integer, got list ['qa']"
    )


@pytest.mark.parametrize("folder", ["conformal_scifact", "conformal_debian"])
def test_the_published_conformal_runs_cover_within_their_band_per_group(folder):
    """The committed runs of docs/retrieval.md section 4: tau(alpha, beta) at three alphas, every group's mean
    coverage at least 1 - alpha - 2 se, and the unseen-group rule in the docs in its own words."""
    report = json.loads((ROOT / "docs" / "retrieval" / folder / "report.json").read_text())
    assert report["tau"]["threshold_rule"] == "base_rate"
    assert [r["alpha"] for r in report["results"]] == [0.05, 0.1, 0.2]
    for r in report["results"]:
        assert r["num_trials"] == 100
        for g in r["groups"].values():
            assert g["in_band"] and g["coverage"] >= r["target"] - 2 * g["coverage_se"]
    if report["holdout_groups"]:
        for r in report["results"]:
            for g in report["holdout_groups"]:
                assert r["groups"][g]["threshold_source"] == {"most_conservative": 100}
    assert "gets the most conservative threshold**" in (ROOT / "docs" / "retrieval.md").read_text()
