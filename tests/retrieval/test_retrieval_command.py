"""Retriever commands and the saved model: sentence-transformers loads it with the same embeddings;
``train-retriever`` runs end to end on a tiny encoder, resumes exactly, and rejects bad configs."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from judgeloop.config import ConfigError, check_output_places, load_config
from judgeloop.retrieval.encoder import BiEncoder
from judgeloop.retrieval.mining import load_negatives

TEXTS = ["a cat sat on the mat", "what pumps blood?", "Insulin regulates blood sugar levels.", "Mars"]

DOCS = [
    "The cat sat on the warm mat in the sun.",
    "Dogs bark at the mailman every morning.",
    "Photosynthesis converts light into chemical energy.",
    "The stock market fell sharply on Monday.",
    "Vitamin D deficiency is linked to bone loss.",
    "Quantum computers use qubits.",
    "Rain forests hold most land species.",
    "The heart pumps blood through arteries.",
    "Insulin regulates blood sugar levels.",
    "Mars has two small moons.",
    "Bees pollinate flowering plants.",
    "Coffee contains caffeine, a stimulant.",
]
QUERIES = [
    "where did the cat sit",
    "what do dogs do",
    "how do plants make energy",
    "what happened to stocks",
    "what causes bone loss",
    "what do quantum computers use",
    "where do species live",
    "what pumps blood",
    "what regulates sugar",
    "how many moons has mars",
    "who pollinates plants",
    "what is in coffee",
]


@pytest.fixture
def beir_dir(tmp_path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    (root / "corpus.jsonl").write_text(
        "".join(
            json.dumps({"_id": f"d{i}", "title": f"Doc {i}", "text": t}) + "\n" for i, t in enumerate(DOCS)
        )
    )
    (root / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(QUERIES))
    )
    rows = [f"q{i}\td{i}\t1" for i in range(len(QUERIES))] + ["q7\td8\t1"]  # q7 has two positives
    (root / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    return root


def _overrides(beir_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "model.name=judgeloop-tiny/encoder",
        f"data.train.corpus_path={beir_dir / 'corpus.jsonl'}",
        f"data.train.queries_path={beir_dir / 'queries.jsonl'}",
        f"data.train.qrels_path={beir_dir / 'qrels.tsv'}",
        "data.eval_fraction=0.3",
        "train.batch_size=4",
        "negatives.mining.num_negatives=2",
        "negatives.mining.range_max=6",
        "negatives.mining.relative_margin=null",
        "eval.batch_size=8",
        *extra,
    ]


def _cfg(overrides: list[str]):
    from judgeloop.commands.train_retriever import TrainRetrieverConfig

    return load_config(TrainRetrieverConfig, None, overrides)


# ------------------------------------------------------------------------------- saved model layout
def _st_roundtrip(enc: BiEncoder, path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    enc.save(path)
    ours = enc.encode(TEXTS, batch_size=2)
    st = SentenceTransformer(str(path), device="cpu")
    theirs = st.encode(TEXTS, convert_to_tensor=True, batch_size=2).cpu()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    reloaded = BiEncoder.from_pretrained(str(path))
    assert (reloaded.pooling, reloaded.normalize, reloaded.max_length) == (
        enc.pooling,
        enc.normalize,
        enc.max_length,
    )
    torch.testing.assert_close(reloaded.encode(TEXTS), ours, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_saved_model_loads_with_sentence_transformers(tmp_path, pooling):
    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", pooling=pooling, max_length=64)
    _st_roundtrip(enc, tmp_path / "model")


def test_minilm_saved_model_loads_with_sentence_transformers(tmp_path):
    enc = BiEncoder.from_pretrained("sentence-transformers/all-MiniLM-L6-v2", max_length=128)
    _st_roundtrip(enc, tmp_path / "minilm")


def test_encoder_rejects_unknown_pooling():
    with pytest.raises(ValueError, match="pooling='max'"):
        BiEncoder.from_pretrained("judgeloop-tiny/encoder", pooling="max")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- train command
def test_train_retriever_end_to_end(tmp_path, beir_dir):
    from judgeloop.commands.train_retriever import run

    out = tmp_path / "out"
    cfg = _cfg(
        _overrides(
            beir_dir,
            out,
            "train.num_epochs=2",
            "negatives.remine_every_n_epochs=1",
            "train.gradcache_chunk_size=2",
            "loss.symmetric=true",
        )
    )
    before_weights = {
        k: v.clone() for k, v in BiEncoder.from_pretrained("judgeloop-tiny/encoder").state_dict().items()
    }
    report = run(cfg)
    saved = json.loads((out / "report.json").read_text())
    for side in ("before", "after"):
        assert {"ndcg@10", "recall@10", "mrr@10"} <= set(saved[side])
    assert report["steps"] == saved["steps"] > 0
    assert (out / "report.md").read_text().startswith("# Retriever training report")
    # mined at the start and re-mined after epoch 1; positives never appear as negatives
    for name in ("epoch_0.jsonl", "epoch_1.jsonl"):
        negs = load_negatives(out / "negatives" / name)
        assert negs and all(len(v) == 2 for v in negs.values())
        assert all(d != f"d{q[1:]}" for q, v in negs.items() for d, _ in v)
        assert all(d != "d8" for d, _ in negs.get("q7", []))
    trained = BiEncoder.from_pretrained(str(out / "model"))
    changed = [
        k
        for k, v in trained.state_dict().items()
        if k in before_weights and not torch.equal(v, before_weights[k])
    ]
    assert changed, "no parameter changed after training"


def test_train_retriever_resumes_exactly(tmp_path, beir_dir):
    from judgeloop.commands.train_retriever import run

    common = ["train.num_epochs=2", "train.save_every_n_steps=1", "train.keep_checkpoints=10"]
    full = tmp_path / "full"
    run(_cfg(_overrides(beir_dir, full, *common)))
    steps = sorted(int(p.name.split("_")[1]) for p in (full / "checkpoints").glob("step_*"))
    assert len(steps) >= 3
    # "interrupt" after the second step: keep only its checkpoint
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "run.json", part / "run.json")  # the run the checkpoint belongs to (judgeloop.rundir)
    shutil.copytree(full / "checkpoints" / "step_2", part / "checkpoints" / "step_2")
    state = json.loads((part / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    if state.get("negatives_path"):
        (part / "negatives").mkdir()
        shutil.copy(state["negatives_path"], part / "negatives" / Path(state["negatives_path"]).name)
        state["negatives_path"] = str(part / "negatives" / Path(state["negatives_path"]).name)
        (part / "checkpoints" / "step_2" / "trainer_state.json").write_text(json.dumps(state))
    resumed = run(_cfg(_overrides(beir_dir, part, *common)))
    assert resumed["steps"] == steps[-1]
    a = BiEncoder.from_pretrained(str(full / "model")).state_dict()
    b = BiEncoder.from_pretrained(str(part / "model")).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


_SIGNAL_DRIVER = """
import os, signal, sys
import judgeloop.retrieval.trainer as tr
from judgeloop.cli import main

sig = getattr(signal, os.environ["JL_SIGNAL"])
calls = []
real = tr.train_step
def train_step(*args, **kwargs):  # mid-step 3: the step still finishes
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), sig)
    return real(*args, **kwargs)
tr.train_step = train_step
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_a_stop_signal_checkpoints_the_step_then_the_rerun_equals_the_uninterrupted_run(
    tmp_path, beir_dir, sig, status
):
    """A real SIGTERM / SIGUSR1 mid-step 3 in a child process: step 3 finishes, its checkpoint is written,
    one line names it, exit 128 + signum; the same command again continues from it and ends with the
    uninterrupted run's weights (bit for bit), losses and metrics. Every segment runs at one thread."""
    import os
    import subprocess
    import sys

    from judgeloop.commands.train_retriever import run
    from judgeloop.devices import intra_op_threads

    common = ["train.num_epochs=2", "train.mixed_precision='no'", "eval.precision='no'"]
    full, part = tmp_path / "full", tmp_path / "part"
    with intra_op_threads(1):
        reference = run(_cfg(_overrides(beir_dir, full, *common)))
    assert reference["steps"] > 3
    driver = tmp_path / "driver.py"
    driver.write_text(_SIGNAL_DRIVER)
    (tmp_path / "empty.yaml").write_text("")
    env = {**os.environ, "JL_SIGNAL": sig, "OMP_NUM_THREADS": "1"}
    command = ["train-retriever", "--config", str(tmp_path / "empty.yaml"), "--allow-empty-config"]
    proc = subprocess.run(
        [sys.executable, str(driver), *command, *_overrides(beir_dir, part, *common)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == status, proc.stderr[-3000:]
    ckpt = part / "checkpoints" / "step_3"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"judgeloop train-retriever: stopped by {sig} after step 3; checkpoint {ckpt}: "
        "run the same command again to continue from it (train.resume=true)"
    )
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 3
    assert not (part / "report.json").exists()
    with intra_op_threads(1):
        resumed = run(_cfg(_overrides(beir_dir, part, *common)))
    assert resumed["steps"] == reference["steps"]
    assert resumed["after"] == reference["after"] and resumed["before"] == reference["before"]
    assert resumed["final_loss"] == reference["final_loss"]
    a = BiEncoder.from_pretrained(str(full / "model")).state_dict()
    b = BiEncoder.from_pretrained(str(part / "model")).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_mine_negatives_command(tmp_path, beir_dir):
    from judgeloop.commands.mine_negatives import MineNegativesConfig, run

    cfg = load_config(
        MineNegativesConfig,
        None,
        [
            f"output_path={tmp_path / 'negs.jsonl'}",
            "model.name=judgeloop-tiny/encoder",
            f"data.corpus_path={beir_dir / 'corpus.jsonl'}",
            f"data.queries_path={beir_dir / 'queries.jsonl'}",
            f"data.qrels_path={beir_dir / 'qrels.tsv'}",
            "mining.num_negatives=2",
            "mining.range_max=5",
            "mining.relative_margin=null",
            "num_bm25=1",
        ],
    )
    summary = run(cfg)
    negs = load_negatives(tmp_path / "negs.jsonl")
    assert summary["num_queries"] == len(negs) == len(QUERIES)
    assert all(2 <= len(v) <= 3 for v in negs.values())  # 2 dense + up to 1 BM25


def test_scifact_config_split_is_leak_free(repo, shared_data):
    from judgeloop.retrieval.trainer import load_retrieval_data
    from judgeloop.retrieval.trainer_config import TrainRetrieverConfig

    cfg = load_config(TrainRetrieverConfig, repo / "configs" / "retriever" / "scifact.yaml")
    cfg.data.train.corpus_path = str(shared_data / "scifact" / "corpus.jsonl")
    cfg.data.train.queries_path = str(shared_data / "scifact" / "queries_train.jsonl")
    cfg.data.train.qrels_path = str(shared_data / "scifact" / "qrels_train.tsv")
    train, held = load_retrieval_data(cfg.data)
    assert len(train.queries) + len(held.queries) == 505
    assert 60 <= len(held.queries) <= 140
    assert not set(train.queries) & set(held.queries)


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.batch_size=1", "train.batch_size=1"),
        ("loss.tau=0", "loss.tau=0"),
        ("data.train.pairs_path=x.jsonl", "either pairs_path or"),
        ("eval.metrics=[ndcg@10]", "must include"),
        ("negatives.mining.range_max=1", "widen range_max"),
        ("train.keep_checkpoints=0", "keep_checkpoints=0"),
    ],
)
def test_config_errors_name_the_parameter(tmp_path, beir_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(_overrides(beir_dir, tmp_path / "o", override))


def test_missing_qrels_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match="missing \\['qrels_path'\\]"):
        _cfg(["data.train.corpus_path=c.jsonl", "data.train.queries_path=q.jsonl"])


def test_cli_suggests_the_closest_key(repo, capsys):
    from judgeloop.cli import main

    rc = main(
        [
            "train-retriever",
            "--config",
            str(repo / "configs/retriever/scifact.yaml"),
            "negatives.mining.num_negative=3",
        ]
    )
    assert rc == 2
    assert "did you mean 'negatives.mining.num_negatives'" in capsys.readouterr().err


def test_no_training_data_is_a_data_error(tmp_path):
    from judgeloop.commands.train_retriever import run
    from judgeloop.io import DataError

    with pytest.raises(DataError, match="no data given"):
        run(_cfg([f"output_dir={tmp_path}", "model.name=judgeloop-tiny/encoder"]))


def test_embedding_cache_serves_a_subset_without_reencoding(tmp_path):
    from judgeloop.retrieval.embedding_cache import encode_texts

    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
    cache = tmp_path / "cache"
    full = encode_texts(enc, DOCS, 4, False, cache_dir=str(cache))
    files = sorted(cache.glob("*.pt"))
    assert len(files) == 1
    sub = encode_texts(enc, DOCS[3:7], 4, False, cache_dir=str(cache))
    torch.testing.assert_close(sub, full[3:7])
    assert sorted(cache.glob("*.pt")) == files  # served from the full-corpus file
    # a changed model (or max length) is a different fingerprint: never served stale embeddings
    enc.max_length = 16
    encode_texts(enc, DOCS[:2], 4, False, cache_dir=str(cache))
    assert len(list(cache.glob("*.pt"))) == 2


def test_embedding_cache_encodes_only_the_texts_it_lacks(tmp_path):
    """A corpus that gained and changed documents since it was cached: only those are encoded, the rest
    come from the cache, and the result equals encoding everything afresh."""
    from judgeloop.retrieval.embedding_cache import encode_texts

    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
    cache = tmp_path / "cache"
    encode_texts(enc, DOCS[:6], 4, False, cache_dir=str(cache))
    grown = [*DOCS[:4], DOCS[4] + " (edited)", *DOCS[5:]]  # one edited, the ones after 6 are new
    encoded: list[str] = []
    real = enc.encode
    enc.encode = lambda texts, *a, **k: encoded.extend(texts) or real(texts, *a, **k)  # type: ignore[method-assign]
    got = encode_texts(enc, grown, 4, False, cache_dir=str(cache))
    assert sorted(encoded) == sorted([grown[4], *DOCS[6:]])
    torch.testing.assert_close(got, real(grown, batch_size=4), atol=1e-5, rtol=1e-5)
    encoded.clear()
    torch.testing.assert_close(encode_texts(enc, grown[::-1], 4, False, cache_dir=str(cache)), got.flip(0))
    assert encoded == []  # everything is cached now


def test_a_study_and_the_trainer_share_one_embedding_cache(tmp_path):
    """The conformal / gate / routing studies encode through the trainer's cache: what a study wrote, the
    trainer reads (same weights and settings), bit for bit, without encoding."""
    from judgeloop.retrieval.dense import EncoderConfig, encode_with
    from judgeloop.retrieval.embedding_cache import encode_texts

    cache = tmp_path / "cache"
    study = encode_with(EncoderConfig(name="judgeloop-tiny/encoder", max_length=32), DOCS, cache, 4)
    assert study.dtype == "float32" and study.shape[0] == len(DOCS) and len(list(cache.glob("*.pt"))) == 1
    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
    enc.encode = lambda *a, **k: pytest.fail("encoded texts the study had cached")  # type: ignore[method-assign]
    assert torch.equal(encode_texts(enc, DOCS, 4, False, cache_dir=cache), torch.from_numpy(study))


def test_max_corpus_docs_keeps_every_judged_document():
    from judgeloop.retrieval.beir import BeirData
    from judgeloop.retrieval.trainer import _shrink_corpus

    corpus = {f"d{i}": {"title": "", "text": str(i)} for i in range(50)}
    data = BeirData(corpus, {"a": "x", "b": "y"}, {"a": {"d40": 1}, "b": {"d41": 1, "d42": 0}})
    train, held = _shrink_corpus(data.subset(["a"]), data.subset(["b"]), 10, "s")
    assert train.corpus is held.corpus and len(train.corpus) == 10
    assert {"d40", "d41", "d42"} <= set(train.corpus)


def test_loss_masks_mark_known_positives_per_process_and_gathered():
    from accelerate import Accelerator

    from judgeloop.retrieval.batches import Example, loss_masks
    from judgeloop.retrieval.beir import BeirData

    corpus = {f"d{i}": {"title": "", "text": f"doc {i}"} for i in range(6)}
    # q1 is answered by d1 and d2: when the batch holds (q1, d1) and (q1, d2), each is not the other's negative
    data = BeirData(corpus, {"q0": "a", "q1": "b"}, {"q0": {"d0": 1}, "q1": {"d1": 1, "d2": 1, "d5": 0}})
    batch = [Example("q0", "d0"), Example("q1", "d1"), Example("q1", "d2")]
    doc_ids = ["d0", "d1", "d2", "d3", "d2", "d5"]  # positives, then one mined negative per query
    acc = Accelerator(cpu=True)
    local, none = loss_masks(batch, doc_ids, data, acc, gather=False)
    assert none is None
    assert local.tolist() == [
        [True, False, False, False, False, False],
        [False, True, True, False, True, False],  # d2 (a positive) never a negative for q1; d5 graded 0 is
        [False, True, True, False, True, False],
    ]
    # gathered, on one process: the same candidates, and the (positive, query) mask for the symmetric term
    gathered, qmask = loss_masks(batch, doc_ids, data, acc, gather=True)
    assert torch.equal(gathered, local)
    assert qmask.tolist() == [[True, False, False], [False, True, True], [False, True, True]]


@pytest.mark.slow
def test_recipe_runs_the_library_loop(tmp_path, beir_dir, repo, capsys):
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "recipe_train_retriever", repo / "recipes" / "train_retriever.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("train:\n  num_epochs: 1\n")
    assert recipe.main(["--config", str(cfg_path), *_overrides(beir_dir, tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"before", "after", "delta"}
    assert (tmp_path / "out" / "report.json").is_file() and (tmp_path / "out" / "model").is_dir()


def test_bf16_encoding_and_training_stay_close_to_float32(tmp_path, beir_dir):
    """bf16 autocast (train.mixed_precision / eval.precision) changes embeddings by bf16 rounding only,
    returns float32, and keys the embedding cache separately."""
    from judgeloop.commands.train_retriever import run
    from judgeloop.retrieval.embedding_cache import _model_fingerprint

    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder")
    texts = [f"document number {i} about proteins and cells" for i in range(10)]
    full = enc.encode(texts)
    fp32_key = _model_fingerprint(enc, False)
    enc.encode_precision = "bf16"
    weights = {k: v.clone() for k, v in enc.model.state_dict().items()}
    model_before = enc.model
    half = enc.encode(texts)
    assert half.dtype == torch.float32
    # encoding ran on a bf16 copy: the encoder's own (training) weights are the same fp32 tensors
    assert enc.model is model_before
    assert all(
        torch.equal(v, weights[k]) and v.dtype == torch.float32 for k, v in enc.model.state_dict().items()
    )
    assert (half - full).abs().max() < 0.05 and not torch.equal(half, full)
    assert _model_fingerprint(enc, False) != fp32_key
    with pytest.raises(ValueError, match="encode_precision"):
        BiEncoder(enc.model, enc.tokenizer, encode_precision="fp8")
    from accelerate.state import AcceleratorState, GradientState

    # accelerate keeps its state per process: start clean, and leave no bf16 state to later tests
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        report = run(
            _cfg(_overrides(beir_dir, tmp_path / "bf16", "train.mixed_precision=bf16", "eval.precision=bf16"))
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert all(math.isfinite(v) for v in report["after"].values())


def test_the_shipped_embedding_cache_lives_in_the_judgeloop_cache_not_the_working_directory(
    tmp_path, monkeypatch
):
    """The retriever configs wrote the embedding cache to ./outputs/ of whatever folder the command ran
    in, and the conformal, gate, route and answer studies to ./runs/cache/; ``auto`` (what they all ship,
    and the studies' default) is ``embeddings/`` (the reader's answers: ``answers/``) under $JUDGELOOP_CACHE."""
    from judgeloop.commands.mine_negatives import MineNegativesConfig
    from judgeloop.retrieval.embedding_cache import encode_texts, resolve_cache_dir
    from judgeloop.retrieval.trainer_config import TrainRetrieverConfig
    from judgeloop.studies.answer import AnswerConfig
    from judgeloop.studies.conformal import ConformalConfig
    from judgeloop.studies.gate import GateConfig
    from judgeloop.studies.routing import RouteConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    root = configs / "retriever"
    shipped = [
        load_config(TrainRetrieverConfig, root / "scifact.yaml").eval.embedding_cache_dir,
        load_config(MineNegativesConfig, root / "mine_scifact.yaml").embedding_cache_dir,
    ]
    studies = {
        ConformalConfig: ["conformal/scifact.yaml"],
        GateConfig: ["gate/scifact.yaml", "gate/scifact_escalate.yaml"],
        RouteConfig: ["routing/squad2.yaml", "routing/pubmedqa.yaml"],
        AnswerConfig: ["routing/squad2_abstain.yaml"],
    }
    for schema, files in studies.items():
        shipped += [schema().cache_dir] + [load_config(schema, configs / f).cache_dir for f in files]
    assert shipped == ["auto"] * len(shipped)
    work, cache = tmp_path / "work", tmp_path / "jl-cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("JUDGELOOP_CACHE", str(cache))
    enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
    encode_texts(enc, DOCS, 4, False, cache_dir="auto")
    assert len(list((cache / "embeddings").glob("*.pt"))) == 1
    assert resolve_cache_dir("auto", "answers") == cache / "answers"  # where the answer study's reader caches
    # checked before any work where it resolves, not as a folder ./auto
    monkeypatch.setenv("JUDGELOOP_CACHE", str(not_a_folder := tmp_path / "a-file"))
    not_a_folder.write_text("")
    with pytest.raises(
        ConfigError, match=re.escape(f"cache_dir=auto ({not_a_folder}) is a file; point cache_dir at")
    ):
        check_output_places(GateConfig())
    assert list(work.iterdir()) == []
