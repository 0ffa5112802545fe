"""Distributed equivalence: two processes with per-process batch b make the same update as one process with 2b.

Runs ``accelerate launch --multi_gpu --num_processes 2`` with ``Accelerator(cpu=True)`` (gloo); note that
``accelerate launch --cpu`` would silently start a single process.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = r"""
import sys
import torch
from accelerate import Accelerator
from judgeloop.loop.config import LossConfig, PolicyConfig
from judgeloop.loop.policy import Policy
from judgeloop.loop.rollout import PromptBuilder, Rollout
from judgeloop.loop.steps import Learner, PairBatch, policy_update
from judgeloop.models import load_causal_lm, load_tokenizer
import copy

out = sys.argv[1]
kind = sys.argv[2]  # dpo, or grpo: groups of 4 whose completion tokens differ between the processes
acc = Accelerator(cpu=True)
n = 4
g = torch.Generator().manual_seed(0)
def seq(lo, hi):
    return torch.randint(10, 900, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
prompts = [seq(4, 9) for _ in range(n)]
a = [seq(2, 6) + [2] for _ in range(n)]
b = [seq(2, 6) + [2] for _ in range(n)]
p = torch.tensor([0.9, 0.2, 0.7, 0.4])
mask = torch.ones(n)
per = n // acc.num_processes
lo, hi = acc.process_index * per, (acc.process_index + 1) * per
roll = Rollout(["x"] * per, prompts[lo:hi], a[lo:hi], b[lo:hi], ["a"] * per, ["b"] * per)
more = [[seq(1, 9) + [2] for _ in range(n)] for _ in range(2)]
adv = torch.randn(n, 4, generator=g)
if kind == "grpo":
    roll.more_ids, roll.more_text = [m[lo:hi] for m in more], [["c"] * per, ["d"] * per]
model = load_causal_lm("judgeloop-tiny/causal-lm").train()
ref = copy.deepcopy(model).eval()
with torch.no_grad():  # move the policy away from the reference so the KL term has a gradient too
    gen = torch.Generator().manual_seed(1)
    for prm in model.parameters():
        prm.add_(0.02 * torch.randn(prm.shape, generator=gen))
init = {k: v.detach().clone() for k, v in model.state_dict().items()}
opt = torch.optim.SGD(model.parameters(), lr=0.5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
model, opt, sched = acc.prepare(model, opt, sched)
tok = load_tokenizer("judgeloop-tiny/causal-lm")  # pad id 0
policy = Policy(acc, model, ref, tok, PromptBuilder(tok, PolicyConfig()))
for _ in range(2):
    batch = PairBatch(1, [], rollout=roll, targets=p[lo:hi], mask=mask[lo:hi])
    loss_cfg = LossConfig(beta=0.5)
    if kind == "grpo":
        batch = PairBatch(1, [], rollout=roll, mask=torch.ones(per, 4), rewards=torch.zeros(per, 4),
                          advantages=adv[lo:hi])
        loss_cfg = LossConfig(type="grpo")
    stats = policy_update(Learner(policy, opt, sched, loss_cfg, 0.0), batch, 0.1)
if acc.is_main_process:
    torch.save({"params": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
                "init": init, "world": acc.num_processes, "loss": stats["loss"]}, out)
acc.wait_for_everyone()
# leave without C++ teardown: gloo's destructors at interpreter exit can abort on a loaded machine
import os
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_two_processes_equal_one_process_with_double_batch(tmp_path, kind):
    """grpo: the token average is over the global batch's completion tokens, which the two processes
    hold unequal shares of."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which(
        "accelerate"
    )
    if accelerate is None:
        pytest.skip("the accelerate launcher is not installed")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(script), str(one), kind], check=True, env=_env(), timeout=120)
    port = str(random.randint(20000, 40000))
    cmd = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        port,
        str(script),
        str(two),
        kind,
    ]
    res = subprocess.run(cmd, env=_env(), timeout=180, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    r1, r2 = torch.load(one), torch.load(two)
    assert r1["world"] == 1 and r2["world"] == 2
    assert r1["params"].keys() == r2["params"].keys()
    for k in r1["params"]:
        assert torch.allclose(r1["params"][k], r2["params"][k], atol=1e-6, rtol=1e-5), k
    moved = [k for k in r1["params"] if not torch.equal(r1["params"][k], r1["init"][k])]
    assert len(moved) == len(r1["params"])  # the update really moved every parameter
    assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-6)


LR_WORKER = r"""
import json, os, sys
from pathlib import Path
from judgeloop.config import load_config
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.setup import make_accelerator, make_optimizer
from judgeloop.models import load_causal_lm

root = Path(sys.argv[2])
cfg = load_config(FeedbackLoopConfig, root / "configs/feedback_loop/tiny.yaml",
                  ["optim.scheduler=linear", "optim.warmup_steps=2", "max_steps=4", "log_with=[]"])
acc = make_accelerator(cfg, Path(sys.argv[1]).parent)
model = load_causal_lm("judgeloop-tiny/causal-lm")
opt, sched = make_optimizer(model, cfg)
model, opt, sched = acc.prepare(model, opt, sched)
lrs = []
for _ in range(cfg.max_steps):
    lrs.append(sched.get_last_lr()[0])
    opt.step()
    sched.step()
if acc.is_main_process:
    Path(sys.argv[1]).write_text(json.dumps({"world": acc.num_processes, "lrs": lrs}))
acc.wait_for_everyone()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_the_lr_schedule_counts_optimizer_steps_on_any_number_of_processes(tmp_path):
    """accelerate steps a prepared scheduler once per process by default; the loop's schedule must not
    run num_processes times faster under DDP (warm-up 2, linear decay over 4 steps)."""
    import json

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which(
        "accelerate"
    )
    if accelerate is None:
        pytest.skip("the accelerate launcher is not installed")
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "lr_worker.py"
    script.write_text(LR_WORKER)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(script), str(one), str(root)], check=True, env=_env(), timeout=120)
    port = str(random.randint(20000, 40000))
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    res = subprocess.run(
        [*cmd, str(script), str(two), str(root)], env=_env(), timeout=180, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r1, r2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert r1["world"] == 1 and r2["world"] == 2
    lr = 1e-3  # tiny.yaml's optim.learning_rate
    assert r1["lrs"] == pytest.approx([0.0, lr / 2, lr, lr / 2])  # transformers: warm-up from 0, then linear
    assert r2["lrs"] == pytest.approx(r1["lrs"])


UNEVEN_WORKER = r"""
import json, os, sys
from pathlib import Path
import torch
from accelerate.utils import gather_object
from judgeloop.config import load_config
from judgeloop.data import load_examples
from judgeloop.loop.config import FeedbackLoopConfig
from judgeloop.loop.policy import Policy
from judgeloop.loop.rollout import PromptBuilder
from judgeloop.loop.setup import make_accelerator
from judgeloop.distributed import real_part, shard
from judgeloop.recipes import train
from judgeloop.models import load_causal_lm, load_tokenizer

out, root = Path(sys.argv[1]), Path(sys.argv[2])
overrides = sys.argv[3:]
cfg = load_config(FeedbackLoopConfig, root / "configs/feedback_loop/tiny.yaml", overrides)
acc = make_accelerator(cfg, Path(cfg.output_dir))
# 1. an odd number of articles over 2 ranks: the same number of policy forward passes on each rank
model, tok = load_causal_lm(cfg.policy.model), load_tokenizer(cfg.policy.model)
calls = []
model.register_forward_hook(lambda *a: calls.append(1))
exs = load_examples(cfg.data)[:5]
mine = shard(exs, acc)
texts = Policy(acc, model, None, tok, PromptBuilder(tok, cfg.policy)).greedy(mine, cfg.generation, 2)
counts = gather_object([len(calls)])
ids = gather_object(real_part([e.id for e in mine], len(exs), acc))
# 2. a whole run with odd test / validation / calibration counts finishes on both ranks
report = train(cfg)
if acc.is_main_process:
    rows = [json.loads(l) for l in (Path(cfg.output_dir) / "per_article.jsonl").read_text().splitlines()]
    out.write_text(json.dumps({"world": acc.num_processes, "counts": counts, "ids": ids,
                               "want": [e.id for e in exs], "rows": [[r["step"], r["id"]] for r in rows],
                               "final": report["final"]}))
# no barrier here: the run's end_training() has closed the process group
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_odd_shards_keep_the_ranks_in_step_and_lose_no_article(tmp_path):
    """5 test, 3 validation and 7 calibration articles over 2 processes: every rank runs the same number
    of forward passes (under FSDP / ZeRO-3 each is a collective), and each article is counted once."""
    import json

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which(
        "accelerate"
    )
    if accelerate is None:
        pytest.skip("the accelerate launcher is not installed")
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "uneven_worker.py"
    script.write_text(UNEVEN_WORKER)
    res_file = tmp_path / "two.json"
    from loop_common import FAST  # tests/ is on sys.path under pytest: the end-to-end tests' fast settings

    overrides = [
        *FAST,
        "num_eval_articles=5",
        "num_validation_articles=3",
        "calibration.num_articles=7",
        "max_steps=2",
        "eval_every_n_steps=2",
        "batch_size=2",
        f"output_dir={tmp_path / 'run'}",
    ]
    port = str(random.randint(20000, 40000))
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    res = subprocess.run(
        [*cmd, str(script), str(res_file), str(root), *overrides],
        env=_env(),
        timeout=400,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res_file.read_text())
    assert r["world"] == 2
    assert r["counts"][0] == r["counts"][1] > 0
    assert sorted(r["ids"]) == sorted(r["want"])  # each article once, the padding dropped
    by_step: dict[int, list[str]] = {}
    for step, i in r["rows"]:
        by_step.setdefault(step, []).append(i)
    assert set(by_step) == {0, 2}
    for ids in by_step.values():
        assert len(ids) == 5 and len(set(ids)) == 5


RETRIEVER_WORKER = r"""
import json, os, random, sys
from pathlib import Path
import torch
from accelerate import Accelerator
from judgeloop.config import load_config
from judgeloop.retrieval import BiEncoder
from judgeloop.retrieval.beir import BeirData
from judgeloop.retrieval.batches import Example, make_batches
from judgeloop.retrieval.trainer import make_optimizer, train_step
from judgeloop.retrieval.trainer_config import TrainRetrieverConfig

out, per = Path(sys.argv[1]), 4
acc = Accelerator(cpu=True)
docs = [f"document {i} about topic {i % 5} with words {i * 7 % 11} and {i * 3 % 13}" for i in range(24)]
data = BeirData({f"d{i}": {"title": "", "text": t} for i, t in enumerate(docs)},
                {f"q{i}": f"what about topic {i % 5} and {i * 7 % 11}" for i in range(16)},
                {f"q{i}": {f"d{i}": 1} for i in range(16)})
negatives = {f"q{i}": [(f"d{(i + 8) % 24}", 0.0), (f"d{(i + 9) % 24}", 0.0)] for i in range(16)}
cfg = load_config(TrainRetrieverConfig, None, [f"train.batch_size={per * (3 - acc.num_processes)}",
                  "negatives.mining.num_negatives=2", "train.learning_rate=1e-3", "train.weight_decay=0.0"])
torch.manual_seed(0)
enc = BiEncoder.from_pretrained("judgeloop-tiny/encoder", max_length=32)
for mod in enc.modules():  # dropout draws differ between one process and two; the update must not
    if isinstance(mod, torch.nn.Dropout):
        mod.p = 0.0
opt = make_optimizer(enc, cfg)
model, opt = acc.prepare(enc, opt)
model.train()
examples = [Example(f"q{i}", f"d{i}") for i in range(16)]
global_bs = per * 2  # the same global batch on one process and on two
batches = make_batches(examples, global_bs, 0, 0, acc.num_processes > 1)
losses = []
for s, gb in enumerate(batches[:2]):
    lo = acc.process_index * (global_bs // acc.num_processes)
    mine = gb[lo : lo + global_bs // acc.num_processes]
    losses.append(train_step(model, enc, mine, data, negatives, cfg, acc, random.Random(s)))
    opt.step()
    opt.zero_grad(set_to_none=True)
loss = acc.reduce(torch.tensor(losses), reduction="mean").tolist()
if acc.is_main_process:
    torch.save({"world": acc.num_processes, "loss": loss,
                "params": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}}, out)
acc.wait_for_everyone()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_the_retriever_on_two_processes_equals_one_process_with_double_batch(tmp_path):
    """The retriever's InfoNCE step with negatives gathered across processes: two processes with per-process
    batch b make the same two updates as one process with batch 2b."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which(
        "accelerate"
    )
    if accelerate is None:
        pytest.skip("the accelerate launcher is not installed")
    script = tmp_path / "retriever_worker.py"
    script.write_text(RETRIEVER_WORKER)
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    subprocess.run([sys.executable, str(script), str(one)], check=True, env=_env(), timeout=180)
    port = str(random.randint(20000, 40000))
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    res = subprocess.run(
        [*cmd, str(script), str(two)], env=_env(), timeout=240, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r1, r2 = torch.load(one), torch.load(two)
    assert r1["world"] == 1 and r2["world"] == 2
    for k in r1["params"]:
        diff = (r2["params"][k] - r1["params"][k]).abs().max().item()
        # AdamW (lr 1e-3) divides by the root of tiny second moments: float noise in the summed gradients shows
        # at ~1% of one step where a gradient is near zero
        assert diff <= 2e-5, (k, diff, r1["loss"], r2["loss"])
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
