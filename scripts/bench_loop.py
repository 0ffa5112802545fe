"""Benchmark: our feedback loop vs TRL's online DPO on the tiny config, same steps, prompts and tokens.

    .venv/bin/python scripts/bench_loop.py --steps 8 --repeats 2 --json runs/bench_loop.json

Both sides train the tiny policy (random weights, so every sample runs to ``max_new_tokens``) on the same
prompts with two samples per prompt, the same batch size, max new tokens, temperature, beta and
optimizer, against the same judge: MiniLM similarity of the summary to the article. TRL's
``OnlineDPOTrainer`` takes it as a reward function (the judge's pointwise value), so our side runs
hard targets from the raw judge (the ``raw`` arm with ``loss.target=hard``, no evaluation, no
recalibration) to do the same work; it runs the judge prefetch as the config sets it (the tiny config:
on, with the cores split; ``--prefetch on|off`` overrides). Each measurement runs in a fresh
subprocess (peak RSS is per process), alternating ours and TRL's; the first step of each run is
warm-up and not timed. Prints median step time, prompts/s and peak RSS for each and the ratios
ours / peer, our time per phase, and TRL's time in the judge and in ``generate()``: the work both
loops share, which bounds what a faster loop around it can gain.

``--config configs/feedback_loop/quickstart.yaml`` runs the same comparison at the quickstart's scale:
SmolLM2-135M-Instruct with LoRA on both sides (TRL gets the same ``peft_config`` and, like our loop,
uses the base with adapters disabled as its reference); samples then stop at EOS on both sides.

``--objective grpo`` times a GRPO step instead, against TRL's ``GRPOTrainer`` rewarded by judgeloop's
TRL reward function (``JudgeReward``, the same judge, uncalibrated): k = ``--num-generations`` samples
per prompt (4, the quickstart's), round-robin win-rate rewards, advantages over the group divided by its
std, TRL's clipped token-averaged loss, the KL penalty of ``quickstart_grpo.yaml`` on both sides (our
``loss.kl_coef``, TRL's ``beta``), one optimizer step per rollout. The judge's share of each step is its
time over the step time (ours: the judge phase; TRL's: the time inside the reward function)::

    .venv/bin/python scripts/bench_loop.py --objective grpo --config configs/feedback_loop/quickstart_grpo.yaml \
        --steps 4 --repeats 1 --max-new-tokens 20 --json runs/bench_grpo.json

``--device cuda --size real`` is the GPU benchmark: a Qwen2-0.5B-shaped policy (full fine-tuning, frozen
reference copy) and a MiniLM-shaped judge encoder, built from config with random weights (nothing is
downloaded; the vocabularies are Qwen2's 151936 and BERT's 30522 ids of judgeloop's generated tokenizer),
on one GPU, both sides at the same batch, prompts and max new tokens (random weights rarely sample EOS,
so both generate the full length). It prints step time, generated tokens/s (nominal: prompts x 2 x max
new tokens) and peak GPU memory, ours and TRL's, at ``--precision no`` (fp32) or ``bf16``, and the
ratios. ``--size dry`` builds the same architectures at a toy width, to check the script on CPU:

    .venv/bin/python scripts/bench_loop.py --device cpu --size dry --steps 2 --repeats 1
    python scripts/bench_loop.py --device cuda --size real --steps 6 --repeats 1 --batch-size 8 \
        --max-new-tokens 64 --precision bf16 --json runs/bench_loop_gpu.json

``--generation-backend vllm`` compares our loop with itself instead: the same run of the config (default:
the quickstart) with ``generation.backend: vllm`` against ``hf`` (``model.generate``), at float32 and
bfloat16 (``policy.dtype=bfloat16``: the LoRA base, the engine's weights and both backends' decoding in
bf16). Each side keeps its own defaults: ``hf`` reuses the rollout's prompt pass in the update, ``vllm``
cannot (``optim.share_prompt_pass`` is off with it). It times every step after the first: the rollout,
the weight sync (vLLM: merged weights written and reloaded once per optimizer step), the judging and the
update, and the evaluation passes of the demo (``num_eval_articles`` test and ``num_validation_articles``
validation articles, greedy, ``eval_batch_size`` at a time) every ``--eval-every`` steps; and vLLM's
start-up and its server's memory. The four arms (2 backends x 2 precisions) run in fresh processes,
alternating, in reverse order every other repeat; the machine's load average is recorded before and
after each. The work before step 1 (reference summaries, step-0 evaluation) is shared between an arm's
repeats through a start cache, as an ablation's runs share it. It needs the vLLM environment (``make vllm``, or ``--set generation.vllm.python=...``):

    .venv/bin/python scripts/bench_loop.py --generation-backend vllm --steps 3 --repeats 2 \
        --json runs/bench_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "feedback_loop" / "tiny.yaml"
QUICKSTART = ROOT / "configs" / "feedback_loop" / "quickstart.yaml"


def _cfg(args: argparse.Namespace):
    from judgeloop.config import load_config
    from judgeloop.loop.config import FeedbackLoopConfig

    return load_config(
        FeedbackLoopConfig,
        args.config,
        [
            "policy.sft_steps=0",
            f"batch_size={args.batch_size}",
            f"generation.max_new_tokens={args.max_new_tokens}",
            "calibration.method=raw",
            # the judge both sides run: MiniLM similarity to the article, unstyled (TRL takes its pointwise
            # value as a reward; the quickstart's extractive target and style dial are pair-level features)
            "judge.embedding_target=article",
            "judge.style_weight=0",
            *(
                _grpo_overrides(args)
                if args.objective == "grpo"
                else ["loss.target=hard", "loss.kl_coef=0.0"]
            ),
            "log_with=[jsonl]",
            "progress_bar=false",
            f"device={args.device}",
            f"judge.device={args.device}",
            f"mixed_precision='{args.precision}'",  # quoted: YAML reads a bare no as false
            *args.set,
        ],
    )


def _grpo_overrides(args: argparse.Namespace) -> list[str]:
    # the GRPO objective both sides run; the KL coefficient stays the config's (TRL gets it as beta)
    return [
        "loss.type=grpo",
        f"generation.num_samples_per_article={args.num_generations}",
        "loss.scale_rewards=group",
        "rewards.scheme=round_robin",
        "rewards.aggregate=win_rate",
    ]


# Qwen2-0.5B's and MiniLM-L6's shapes (real), and toy widths of the same classes (dry)
SIZES = {
    "real": {
        "policy": dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
        "judge": dict(
            vocab_size=30522,
            hidden_size=384,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=12,
            max_position_embeddings=512,
        ),
    },
    "dry": {
        "policy": dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        "judge": dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
        ),
    },
}


def build_models(size: str, folder: Path) -> list[str]:
    """Random-weight policy and judge encoder of ``SIZES[size]`` saved under ``folder`` (with tokenizers);
    returns the config overrides that point both sides at them."""
    import torch
    from transformers import BertConfig, BertModel, Qwen2Config, Qwen2ForCausalLM

    from judgeloop.models.tiny import build_tiny_tokenizer

    spec = SIZES[size]
    torch.manual_seed(0)
    ptok = build_tiny_tokenizer(spec["policy"]["vocab_size"])
    ids = {
        "bos_token_id": ptok.bos_token_id,
        "eos_token_id": ptok.eos_token_id,
        "pad_token_id": ptok.pad_token_id,
    }
    policy = Qwen2ForCausalLM(Qwen2Config(**spec["policy"], **ids))
    policy.save_pretrained(folder / "policy")
    ptok.save_pretrained(folder / "policy")
    jtok = build_tiny_tokenizer(spec["judge"]["vocab_size"])
    BertModel(BertConfig(**spec["judge"], pad_token_id=jtok.pad_token_id)).save_pretrained(folder / "judge")
    jtok.save_pretrained(folder / "judge")
    n = sum(p.numel() for p in policy.parameters())
    print(f"built {size} models in {folder}: policy {n / 1e6:.0f}M parameters", flush=True)
    return [
        f"policy.model={folder / 'policy'}",
        f"judge.model={folder / 'judge'}",
        "policy.lora=false",
        "policy.max_article_tokens=256",
        "judge.max_length=512",
    ]


def _gpu_peak_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _prompts(cfg, n: int):
    from judgeloop.loop.rollout import PromptBuilder
    from judgeloop.loop.state import load_splits
    from judgeloop.models import load_tokenizer

    splits = load_splits(cfg)
    tok = load_tokenizer(cfg.policy.model)
    builder = PromptBuilder(tok, cfg.policy)
    exs = [splits.train[i % len(splits.train)] for i in range(n)]
    return exs, builder, tok


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker_ours(args: argparse.Namespace) -> dict:
    """Our loop as users run it: the step sequence of ``recipes/feedback_loop.py`` (``train``), timed per
    phase through its ``phase`` hook; no evaluation, checkpoints or recalibration (the raw arm). The first
    step is warm-up and not timed. Set-up (and the step-0 work of the raw arm: reference summaries and the
    judge's coupling on a few calibration pairs) runs before the first step and is not timed either."""
    import contextlib

    from judgeloop.config import replace
    from judgeloop.recipes import train

    cfg = _cfg(args)
    times, phases = [], {"rollout": 0.0, "judge": 0.0, "update": 0.0}
    current: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(name: str):
        if name not in phases:  # the evaluation phase: off here (eval_every_n_steps=0)
            yield
            return
        _sync()
        t0 = time.perf_counter()
        yield
        _sync()
        current[name] = time.perf_counter() - t0
        if name == "update":  # the step's last phase
            if current.pop("warm", None) is not None:
                times.append(sum(current.values()))
                for k, v in current.items():
                    phases[k] += v
            current.clear()
            current["warm"] = 0.0  # every step after the first is timed

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"output_dir={out}",
            f"max_steps={args.steps + 1}",
            "eval_every_n_steps=0",
            "save_every_n_steps=0",
            "save_final_policy=false",
            "calibration.recalibrate_every_n_steps=0",
            "num_eval_articles=1",
            "num_validation_articles=0",
            "calibration.num_articles=2",
            "calibration.pairs_per_article=1",
            "calibration.extra_rounds=0",
        ]
        if args.prefetch != "config":
            overrides.append(f"judge_prefetch={args.prefetch == 'on'}")
        train(replace(cfg, overrides), phase=phase)
    return {
        "step_times": times,
        "phases_s": phases,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker_peer(args: argparse.Namespace) -> dict:
    import copy

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from judgeloop.judges import build_judge
    from judgeloop.loop.policy import load_policy

    cfg = _cfg(args)
    exs, builder, tok = _prompts(cfg, args.batch_size * (args.steps + 1))
    peft_config = None
    if cfg.policy.lora:  # TRL gets the same LoRA set-up; its reference is then the base with adapters off
        from peft import LoraConfig

        from judgeloop.models import load_causal_lm

        model, ref = load_causal_lm(cfg.policy.model, dtype=cfg.policy.dtype), None
        peft_config = LoraConfig(
            r=cfg.policy.lora_r,
            lora_alpha=cfg.policy.lora_alpha,
            lora_dropout=cfg.policy.lora_dropout,
            target_modules=list(cfg.policy.lora_target_modules),
            task_type="CAUSAL_LM",
        )
    else:
        model, tok, _ = load_policy(cfg.policy, 0)
        ref = copy.deepcopy(model).eval()
    judge = build_judge(cfg.judge)
    # where TRL's step goes: the judge and generate() are the same code our loop runs; the rest is the loop
    spent = {"judge": 0.0, "generate": 0.0}

    def judge_reward(prompts, completions, article, **kwargs):
        # the judge's pointwise value v(summary) = scale * cos(summary, article); s(a, b) = v(a) - v(b)
        t = time.perf_counter()
        vals = judge._values_for([(a, c, ()) for a, c in zip(article, completions)])
        spent["judge"] += time.perf_counter() - t
        return [v if st in ("ok", "truncated") else -1e3 for v, st in vals]

    inner_generate = model.generate  # TRL calls it on this model (through peft's wrapper under LoRA)

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = inner_generate(*a, **k)
        spent["generate"] += time.perf_counter() - t
        return out

    model.generate = timed_generate

    prompts = [tok.decode(builder(e.article)) for e in exs]
    ds = Dataset.from_list([{"prompt": p, "article": e.article} for p, e in zip(prompts, exs)])
    times: list[float] = []
    phases = {"judge": 0.0, "generate": 0.0}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.before = time.perf_counter(), dict(spent)

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if len(times) > 1:  # the first step is warm-up, as for the step times
                for k in phases:
                    phases[k] += spent[k] - self.before[k]

    with tempfile.TemporaryDirectory() as out:
        targs = OnlineDPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            temperature=cfg.generation.temperature,
            beta=cfg.loss.beta,
            learning_rate=cfg.optim.learning_rate,
            max_steps=args.steps + 1,
            report_to=[],
            use_cpu=args.device == "cpu",
            logging_steps=10_000,
            save_strategy="no",
            gradient_checkpointing=False,
            dataloader_drop_last=True,
            seed=0,
            lr_scheduler_type="constant",
            max_grad_norm=cfg.optim.max_grad_norm,
            bf16=args.precision == "bf16",
        )
        trainer = OnlineDPOTrainer(
            model=model,
            ref_model=ref,
            reward_funcs=judge_reward,
            args=targs,
            train_dataset=ds,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[Timer()],
        )
        trainer.train()
    return {
        "step_times": times[1:],
        "phases_s": phases,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


def worker_peer_grpo(args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer with judgeloop's TRL reward function on the same judge, prompts and settings."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from judgeloop.calibration.calibrators import IdentityCalibrator
    from judgeloop.integrations.trl import JudgeReward
    from judgeloop.judges import build_judge
    from judgeloop.judges.calibrated import CalibratedJudge
    from judgeloop.models import load_causal_lm

    cfg = _cfg(args)
    exs, builder, tok = _prompts(cfg, args.batch_size * (args.steps + 1))
    model, peft_config = load_causal_lm(cfg.policy.model, dtype=cfg.policy.dtype), None
    if cfg.policy.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=cfg.policy.lora_r,
            lora_alpha=cfg.policy.lora_alpha,
            lora_dropout=cfg.policy.lora_dropout,
            target_modules=list(cfg.policy.lora_target_modules),
            task_type="CAUSAL_LM",
        )
    judge = CalibratedJudge(config=cfg.judge, calibrator=IdentityCalibrator(), judge=build_judge(cfg.judge))
    reward = JudgeReward(
        judge, cfg.rewards, num_generations=args.num_generations, source_column="article"
    )  # the loop's
    spent = {"generate": 0.0}
    inner_generate = model.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        out = inner_generate(*a, **k)
        spent["generate"] += time.perf_counter() - t
        return out

    model.generate = timed_generate
    prompts = [tok.decode(builder(e.article)) for e in exs]
    ds = Dataset.from_list([{"prompt": p, "article": e.article} for p, e in zip(prompts, exs)])
    times: list[float] = []
    phases = {"judge": 0.0, "generate": 0.0}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.before = time.perf_counter(), (reward.seconds, spent["generate"])

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if len(times) > 1:  # the first step is warm-up
                phases["judge"] += reward.seconds - self.before[0]
                phases["generate"] += spent["generate"] - self.before[1]

    with tempfile.TemporaryDirectory() as out:
        targs = GRPOConfig(
            output_dir=out,
            num_generations=args.num_generations,
            per_device_train_batch_size=args.batch_size * args.num_generations,  # TRL counts completions
            max_completion_length=args.max_new_tokens,
            temperature=cfg.generation.temperature,
            learning_rate=cfg.optim.learning_rate,
            beta=cfg.loss.kl_coef,
            epsilon=cfg.loss.epsilon,
            scale_rewards="group",
            max_steps=args.steps + 1,
            report_to=[],
            use_cpu=args.device == "cpu",
            logging_steps=10_000,
            save_strategy="no",
            gradient_checkpointing=False,
            seed=0,
            lr_scheduler_type="constant",
            max_grad_norm=cfg.optim.max_grad_norm,
            bf16=args.precision == "bf16",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[reward],
            args=targs,
            train_dataset=ds,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[Timer()],
        )
        trainer.train()
    return {
        "step_times": times[1:],
        "phases_s": phases,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": _gpu_peak_mb(),
    }


def worker_backend(args: argparse.Namespace) -> dict:
    """One run of the config on ``--backend`` at ``--dtype``: the recipe's ``train`` timed through its
    ``phase`` hook, each weight sync timed inside the phase it ran in (and taken out of it), vLLM's
    start-up and its server's resident memory (every process of its group) read before it ends."""
    import contextlib

    from judgeloop.config import load_config
    from judgeloop.loop import vllm_backend
    from judgeloop.loop.config import FeedbackLoopConfig
    from judgeloop.recipes import train

    load = [os.getloadavg()]
    steps: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    current: dict[str, float] = {}
    now: dict[str, Any] = {"phase": None, "sync": 0.0, "updates": 0}
    found: dict[str, Any] = {}

    syncs: list[float] = []  # one per optimizer step, in the next rollout or evaluation (taken out of it)

    @contextlib.contextmanager
    def phase(name: str):
        now["phase"], now["sync"] = name, 0.0
        t0 = time.perf_counter()
        yield
        spent, synced = time.perf_counter() - t0, now["sync"]
        now["phase"] = None
        timed = now["updates"] > 1  # every step after the first, and its evaluation
        if name == "evaluate":
            if timed and now["updates"] % args.eval_every == 0:
                evals.append({"evaluate": spent - synced})
        else:
            current[name] = spent - synced
        if synced and (timed or (name == "rollout" and now["updates"] == 1)):
            syncs.append(synced)  # the second step's rollout syncs the first step's update
        if name == "update":
            now["updates"] += 1
            if now["updates"] > 1:  # the first step is warm-up
                steps.append(dict(current))
            current.clear()

    def timed_sync(self: Any, model: Any, force: bool = False) -> bool:
        t0 = time.perf_counter()
        synced = sync(self, model, force)
        if synced and now["phase"] is not None:
            now["sync"] += time.perf_counter() - t0
        return synced

    def timed_start(self: Any, *a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        start(self, *a, **k)
        found["startup_s"], found["server"] = time.perf_counter() - t0, self

    def timed_close(self: Any) -> None:
        found["server_rss_mb"] = _group_rss_mb(self.proc.pid)
        close(self)

    sync, start, close = (
        vllm_backend.VllmEngine.sync,
        vllm_backend.VllmServer.__init__,
        vllm_backend.VllmServer.close,
    )
    vllm_backend.VllmEngine.sync = timed_sync  # type: ignore[method-assign]
    vllm_backend.VllmServer.__init__ = timed_start  # type: ignore[method-assign]
    vllm_backend.VllmServer.close = timed_close  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"output_dir={out}",
            f"max_steps={args.steps + 1}",
            f"eval_every_n_steps={args.eval_every}",
            "save_every_n_steps=0",
            "save_final_policy=false",
            "calibration.method=raw",
            "calibration.recalibrate_every_n_steps=0",
            "calibration.num_articles=2",
            "calibration.pairs_per_article=1",
            "calibration.extra_rounds=0",
            "early_stopping_patience=0",
            f"batch_size={args.batch_size}",
            f"generation.backend={args.backend}",
            "log_with=[jsonl]",
            "progress_bar=false",
            f"device={args.device}",
            f"judge.device={args.device}",
        ]
        if args.max_new_tokens is not None:
            overrides.append(f"generation.max_new_tokens={args.max_new_tokens}")
        if args.dtype == "bfloat16":
            overrides.append("policy.dtype=bfloat16")
        cfg = load_config(FeedbackLoopConfig, args.config, [*overrides, *args.set])
        t0 = time.perf_counter()
        train(cfg, phase=phase)
        wall = time.perf_counter() - t0
    load.append(os.getloadavg())
    found.pop("server", None)
    return {
        "steps": steps,
        "syncs": syncs,
        "evals": evals,
        "wall_s": wall,
        "peak_rss_mb": _peak_rss_mb(),
        "load": load,
        **found,
    }


def _group_rss_mb(pgid: int) -> float:
    """The resident memory of every process in process group ``pgid`` (a server and its workers), in MB."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            status = (proc / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024.0


def bench_backends(args: argparse.Namespace) -> int:
    """``--generation-backend vllm``: the arms in fresh processes, alternating; medians and ratios."""
    med = statistics.median
    arms = [(d, b) for d in args.dtypes for b in ("hf", "vllm")]
    env = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), TOKENIZERS_PARALLELISM="false"
    )
    runs: dict[str, list[dict]] = {f"{d}/{b}": [] for d, b in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for dtype, backend in arms if r % 2 == 0 else arms[::-1]:
                out = Path(tmp) / f"{dtype}-{backend}-{r}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    "backend",
                    "--out",
                    str(out),
                    "--backend",
                    backend,
                    "--dtype",
                    dtype,
                    "--steps",
                    str(args.steps),
                    "--eval-every",
                    str(args.eval_every),
                    "--batch-size",
                    str(args.batch_size),
                    "--config",
                    args.config,
                    "--device",
                    args.device,
                    f"--set=start_cache={Path(tmp) / 'start'}",
                    *[f"--set={kv}" for kv in args.set],
                ]
                if args.max_new_tokens is not None:
                    cmd += ["--max-new-tokens", str(args.max_new_tokens)]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                res = json.loads(out.read_text())
                runs[f"{dtype}/{backend}"].append(res)
                if (
                    args.json
                ):  # kept as it comes: a long run on a busy machine loses nothing to a late failure
                    Path(f"{args.json}.runs").write_text(json.dumps(runs))
                step = med([sum(s.values()) for s in res["steps"]]) + (
                    med(res["syncs"]) if res["syncs"] else 0
                )
                print(
                    f"{dtype} {backend} repeat {r}: median step {step:.2f} s (load {res['load'][0][0]:.1f} -> "
                    f"{res['load'][-1][0]:.1f})",
                    flush=True,
                )
    return report_backends(args, runs, env["OMP_NUM_THREADS"])


def report_backends(args: argparse.Namespace, runs: dict[str, list[dict]], threads: str) -> int:
    """The medians, the ratios and the load of ``bench_backends``' runs: printed, and to ``--json``."""
    med = statistics.median
    arms = [(d, b) for d in args.dtypes for b in ("hf", "vllm")]
    table: dict[str, dict[str, Any]] = {}
    for dtype, backend in arms:
        rs = runs[f"{dtype}/{backend}"]
        all_steps = [s for r in rs for s in r["steps"]]
        all_evals = [e for r in rs for e in r["evals"]]
        all_syncs = [x for r in rs for x in r["syncs"]]
        sync_s = med(all_syncs) if all_syncs else 0.0
        row = {
            # the step: rollout, judging, update, and (vLLM) the one weight sync each optimizer step needs
            "step_s": med([sum(s.values()) for s in all_steps]) + sync_s,
            **{f"{k}_s": med([s[k] for s in all_steps]) for k in ("rollout", "judge", "update")},
            "sync_s": sync_s,
            "syncs_timed": len(all_syncs),
            "evaluate_s": med([e["evaluate"] for e in all_evals]) if all_evals else None,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "steps_timed": len(all_steps),
            "evals_timed": len(all_evals),
        }
        if backend == "vllm":
            row["startup_s"] = med([r["startup_s"] for r in rs])
            row["server_rss_mb"] = max(r["server_rss_mb"] for r in rs)
        table[f"{dtype}/{backend}"] = row
    loads = [la for rs in runs.values() for r in rs for la in r["load"]]
    ratios = {}
    for dtype in args.dtypes:
        hf, vl = table[f"{dtype}/hf"], table[f"{dtype}/vllm"]
        ratios[dtype] = {
            "step": hf["step_s"] / vl["step_s"],
            "rollout": hf["rollout_s"] / (vl["rollout_s"] + vl["sync_s"]),
            "evaluate": hf["evaluate_s"] / vl["evaluate_s"]
            if hf["evaluate_s"] and vl["evaluate_s"]
            else None,
        }
    print(
        f"\n{args.config}, batch {args.batch_size}, {args.steps} timed steps x {args.repeats} repeats, evaluation every "
        f"{args.eval_every} steps; 1-min load average {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} "
        f"on {os.cpu_count()} cores, OMP_NUM_THREADS={threads}; {time.strftime('%Y-%m-%d')}; medians"
    )
    cols = ("step_s", "rollout_s", "sync_s", "judge_s", "update_s", "evaluate_s", "peak_rss_mb")
    print(f"{'arm':16}" + "".join(f"{c:>13}" for c in cols) + f"{'start-up s':>12}{'server MB':>11}")
    for arm, row in table.items():
        cells = "".join(f"{row[c]:13.2f}" if row[c] is not None else f"{'-':>13}" for c in cols)
        extra = f"{row['startup_s']:12.0f}{row['server_rss_mb']:11.0f}" if "startup_s" in row else ""
        print(f"{arm:16}{cells}{extra}")
    for dtype, rt in ratios.items():
        ev = f"{rt['evaluate']:.2f}x" if rt["evaluate"] else "-"
        print(
            f"{dtype}: hf / vLLM time, whole step {rt['step']:.2f}x, rollout (vLLM's with its sync) "
            f"{rt['rollout']:.2f}x, evaluation passes {ev}"
        )
    if args.json:
        from judgeloop.io import atomic_write_json

        atomic_write_json(
            args.json,
            {
                "arms": table,
                "ratio_hf_over_vllm": ratios,
                "runs": runs,
                "load_averages": loads,
                "settings": {
                    "config": args.config,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "eval_every": args.eval_every,
                    "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens,
                    "dtypes": args.dtypes,
                    "overrides": args.set,
                    "cpu_count": os.cpu_count(),
                    "omp_num_threads": threads,
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                },
            },
        )
    return 0


def summarize(runs: list[dict], batch_size: int, max_new_tokens: int, samples: int = 2) -> dict:
    med = statistics.median([t for r in runs for t in r["step_times"]])
    gpu = [r["peak_gpu_mb"] for r in runs if r.get("peak_gpu_mb")]
    out = {
        "median_step_s": med,
        "prompts_per_s": batch_size / med,
        "gen_tokens_per_s": batch_size
        * samples
        * max_new_tokens
        / med,  # nominal: every sample at full length
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "peak_gpu_mb": max(gpu) if gpu else None,
        "runs": len(runs),
    }
    if "phases_s" in runs[0]:
        out["phases_s"] = {k: sum(r["phases_s"][k] for r in runs) for k in runs[0]["phases_s"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config",
        default=None,
        help="feedback-loop config (default: the tiny one; the quickstart under --generation-backend)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override applied to both sides, e.g. --set policy.dtype=bfloat16 (repeatable)",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--max-new-tokens", type=int, default=None, help="default 16 (--generation-backend: the config's)"
    )
    ap.add_argument(
        "--generation-backend",
        choices=["vllm"],
        default=None,
        help="compare our loop on this backend with itself on hf (model.generate) instead of with TRL",
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="--generation-backend")
    ap.add_argument(
        "--eval-every", type=int, default=2, help="--generation-backend: evaluation every n steps"
    )
    ap.add_argument("--backend", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write {ours, peer, ratio} here")
    ap.add_argument(
        "--prefetch",
        choices=["config", "on", "off"],
        default="config",
        help="ours: the judge prefetch thread as the config says (tiny: on, with the cores split), or forced",
    )
    ap.add_argument(
        "--precision",
        choices=["no", "bf16"],
        default="no",
        help="both sides: bf16 autocast (ours: mixed_precision=bf16; TRL: bf16=True)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both sides run here")
    ap.add_argument(
        "--size",
        choices=["config", "real", "dry"],
        default="config",
        help="config: the config's models; real: Qwen2-0.5B / MiniLM shapes built from config, random "
        "weights; dry: the same classes at a toy width (checks the GPU script on CPU)",
    )
    ap.add_argument(
        "--objective",
        choices=["dpo", "grpo"],
        default="dpo",
        help="dpo: ours (hard targets) vs TRL's online DPO; grpo: ours (loss.type=grpo) vs TRL's GRPOTrainer",
    )
    ap.add_argument("--num-generations", type=int, default=4, help="grpo: samples per prompt (k)")
    ap.add_argument("--worker", choices=["ours", "peer", "backend"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    backends = args.generation_backend is not None or args.worker == "backend"
    if args.config is None:
        args.config = str(QUICKSTART if backends else CONFIG)
    if args.max_new_tokens is None and not backends:
        args.max_new_tokens = 16
    if args.worker:
        peer = worker_peer_grpo if args.objective == "grpo" else worker_peer
        workers = {"ours": worker_ours, "peer": peer, "backend": worker_backend}
        Path(args.out).write_text(json.dumps(workers[args.worker](args)))
        return 0
    if args.generation_backend is not None:
        return bench_backends(args)
    env = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), TOKENIZERS_PARALLELISM="false"
    )
    results: dict[str, list[dict]] = {"ours": [], "peer": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.size != "config":
            args.set = [*build_models(args.size, Path(tmp) / "models"), *args.set]
        for r in range(args.repeats):
            for impl in ("ours", "peer"):  # alternate, so load changes on a shared machine hit both
                out = Path(tmp) / f"{impl}{r}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    impl,
                    "--out",
                    str(out),
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                    "--config",
                    args.config,
                    "--precision",
                    args.precision,
                    "--device",
                    args.device,
                    *[f"--set={kv}" for kv in args.set],
                    "--prefetch",
                    args.prefetch,
                    "--objective",
                    args.objective,
                    "--num-generations",
                    str(args.num_generations),
                ]
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                results[impl].append(json.loads(out.read_text()))
                print(
                    f"{impl} run {r}: median step {statistics.median(results[impl][-1]['step_times']):.3f}s, "
                    f"peak RSS {results[impl][-1]['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    samples = args.num_generations if args.objective == "grpo" else 2
    ours = summarize(results["ours"], args.batch_size, args.max_new_tokens, samples)
    peer = summarize(results["peer"], args.batch_size, args.max_new_tokens, samples)
    for side, res in (("ours", ours), ("peer", peer)):  # the judge's share of the timed steps
        res["judge_share"] = res["phases_s"]["judge"] / sum(sum(r["step_times"]) for r in results[side])
    ratio = {
        "throughput": ours["prompts_per_s"] / peer["prompts_per_s"],
        "peak_rss": ours["peak_rss_mb"] / peer["peak_rss_mb"],
    }
    if ours.get("peak_gpu_mb") and peer.get("peak_gpu_mb"):
        ratio["peak_gpu"] = ours["peak_gpu_mb"] / peer["peak_gpu_mb"]
    print(
        f"objective {args.objective}, device {args.device}, size {args.size}, precision {args.precision}, "
        f"batch {args.batch_size} prompts x {samples} samples, max new tokens {args.max_new_tokens}"
    )
    head = f"{'':6} {'median step s':>14} {'prompts/s':>10} {'gen tokens/s':>13} {'peak RSS MB':>12}"
    print(head + (f" {'peak GPU MB':>12}" if "peak_gpu" in ratio else ""))
    for name, s in (("ours", ours), ("trl", peer)):
        line = f"{name:6} {s['median_step_s']:14.3f} {s['prompts_per_s']:10.2f} {s['gen_tokens_per_s']:13.1f}"
        line += f" {s['peak_rss_mb']:12.0f}" + (f" {s['peak_gpu_mb']:12.0f}" if "peak_gpu" in ratio else "")
        print(line)
    extra = f", peak GPU memory {ratio['peak_gpu']:.2f}x" if "peak_gpu" in ratio else ""
    print(f"ratio ours/trl: throughput {ratio['throughput']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x{extra}")
    print("ours, time per phase (s, all timed steps):", {k: round(v, 2) for k, v in ours["phases_s"].items()})
    total = sum(sum(r["step_times"]) for r in results["peer"])
    shared = peer["phases_s"]["judge"] + peer["phases_s"]["generate"]
    print(
        "trl, time per phase (s, all timed steps):",
        {k: round(v, 2) for k, v in peer["phases_s"].items()},
        f"of {total:.2f}: the judge and generate(), which both loops run alike, are {shared / total:.0%} of "
        f"TRL's step, so a loop that only did the rest faster, without running them on spare cores, gains at "
        f"most {total / shared:.2f}x",
    )
    print(f"the judge's share of the step: ours {ours['judge_share']:.0%}, trl {peer['judge_share']:.0%}")
    peer["shared_share"] = shared / total
    if args.json:
        from judgeloop.io import atomic_write_json

        atomic_write_json(
            args.json,
            {
                "ours": ours,
                "peer": peer,
                "ratio": ratio,
                "settings": {
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens,
                    "prefetch": args.prefetch,
                    "config": args.config,
                    "precision": args.precision,
                    "device": args.device,
                    "size": args.size,
                    "objective": args.objective,
                    "num_generations": args.num_generations if args.objective == "grpo" else None,
                    "overrides": args.set,
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
