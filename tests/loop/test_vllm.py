"""generation.backend: vllm against model.generate, on vLLM's CPU build.

The tests marked ``needs_vllm`` need the separate vLLM environment that ``make vllm`` builds
(``.venv-vllm``, 3.5 GB, about 9 minutes here) or ``$JUDGELOOP_VLLM_PYTHON``; without one they skip with
that reason. CI's ``make test`` builds it first (from cached wheels after the first run: docs/vllm.md),
so they run there. The others (the run's generation backend
reaching every generation of the policy, the configuration errors) need no vLLM.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from judgeloop.config import ConfigError, load_config
from judgeloop.loop.config import FeedbackLoopConfig, GenerationConfig, PolicyConfig, VllmConfig
from judgeloop.loop.rollout import PromptBuilder, decode, generate, token_logprobs
from judgeloop.loop.state import load_splits
from judgeloop.loop.vllm_backend import check_server, default_pythons, has_vllm, serving
from judgeloop.models import load_causal_lm, load_tokenizer
from loop_common import FAST, TINY

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_H32 = "judgeloop-tiny/causal-lm-h32"


def _vllm_python() -> str | None:
    return next((str(p) for p in default_pythons() if p.is_file() and has_vllm(p)), None)


VLLM_PYTHON = _vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="no vLLM environment: make vllm (or make test) builds .venv-vllm (3.5 GB, see docs/vllm.md)",
)


def _articles(n: int) -> list[str]:
    from judgeloop.data.embedded import embedded_texts

    return list(embedded_texts())[:n]


@pytest.fixture(scope="module")
def smol_engine(tmp_path_factory):
    """SmolLM2-135M at float32 and one vLLM server started on it, for the module."""
    tok = load_tokenizer(SMOL)
    model = load_causal_lm(SMOL, dtype="float32").eval()
    root = tmp_path_factory.mktemp("vllm")
    with serving(
        VLLM_PYTHON,
        root / "weights",
        model,
        tok,
        VllmConfig(max_model_len=1024),
        torch.float32,
        root / "server.log",
        cpu=True,
    ) as engine:
        yield model, tok, engine


@pytest.mark.slow
@needs_vllm
def test_greedy_equals_generate_without_and_with_an_adapter_and_after_a_step(smol_engine):
    """At float32 vLLM's greedy summaries equal model.generate's token for token: on the folder judgeloop
    writes (its tied embedding stored as transformers does), with LoRA adapters merged in, and after one
    optimizer step's weight sync."""
    from peft import LoraConfig, get_peft_model

    model, tok, engine = smol_engine
    build = PromptBuilder(tok, PolicyConfig(model=SMOL, max_article_tokens=96))
    prompts = [build(a) for a in _articles(8)]
    gen = GenerationConfig(max_new_tokens=16)

    def both(m):
        with torch.no_grad():
            ref = generate(m, tok, prompts, gen, greedy=True)  # the training model's own generate
        return ref, engine.generate(m, tok, prompts, gen, greedy=True)

    hf_base, vl_base = both(model)
    assert vl_base == hf_base
    assert all(len(c) > 1 for c in vl_base)  # real summaries, not an empty or a token-0 repeat

    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # adapters that change the output (peft starts B at zero)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.03)
    syncs = len(engine.sync_seconds)
    hf_lora, vl_lora = both(peft)
    assert len(engine.sync_seconds) == syncs + 1
    assert hf_lora != hf_base  # the adapters matter, so the comparison can fail
    assert vl_lora == hf_lora

    peft.train()
    from judgeloop.optim import adamw

    opt = adamw([p for p in peft.parameters() if p.requires_grad], lr=3e-2)  # the loop's (fused) AdamW
    hook = engine.watch(opt)
    logp, mask = token_logprobs(peft, prompts, hf_lora, tok.pad_token_id)
    (-(logp.sum() / mask.sum())).backward()  # away from nothing in particular: a real optimizer step
    opt.step()
    peft.eval()
    hf_step, vl_step = both(peft)
    assert len(engine.sync_seconds) == syncs + 2
    assert hf_step != hf_lora
    assert vl_step == hf_step
    # no new step, no new sync
    engine.generate(peft, tok, prompts[:1], gen, greedy=True)
    assert len(engine.sync_seconds) == syncs + 2
    hook.remove()


@pytest.mark.slow
@needs_vllm
def test_sampling_is_seeded_per_article_and_maps_the_settings(smol_engine):
    """Samples are reproducible from the call's seed, the two samples of an article differ, another
    seed draws others, and top_k=1 sampling is the greedy summary (the settings reach the engine). The
    server passes generation.vllm.url's checks, and one serving another name does not."""
    model, tok, engine = smol_engine
    check_server(engine.url)  # the server judgeloop starts is one generation.vllm.url may name
    with pytest.raises(
        ValueError, match="serves \\['policy'\\], not 'other': start it with --served-model-name"
    ):
        check_server(engine.url, served_name="other")
    build = PromptBuilder(tok, PolicyConfig(model=SMOL, max_article_tokens=96))
    prompts = [build(a) for a in _articles(4)]
    gen = GenerationConfig(max_new_tokens=12, temperature=1.0)
    first = engine.generate(model, tok, prompts, gen, num_samples=2, seed=7)
    assert engine.generate(model, tok, prompts, gen, num_samples=2, seed=7) == first
    assert len(first) == 8 and any(first[2 * i] != first[2 * i + 1] for i in range(4))
    assert engine.generate(model, tok, prompts, gen, num_samples=2, seed=8) != first
    assert all(len(c) <= 12 for c in first)
    greedy = engine.generate(model, tok, prompts, gen, greedy=True)
    top1 = GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=1)
    assert engine.generate(model, tok, prompts, top1, num_samples=1, seed=3) == greedy


@pytest.mark.slow
@needs_vllm
def test_tiny_loop_on_vllm_evaluates_as_the_hf_backend(tmp_path):
    """The tiny loop (full fine-tuning) runs with generation.backend: vllm: its step-0 greedy evaluation
    equals the hf backend's metric for metric (same weights, float32), and after training the summaries
    vLLM produced at the last evaluation are the exported policy's greedy summaries by model.generate
    (the engine held the trained weights)."""
    from judgeloop.recipes import train

    over = [*FAST, "policy.model=" + TINY_H32, "max_steps=2", "eval_every_n_steps=2"]
    hf = train(load_config(FeedbackLoopConfig, TINY, [*over, f"output_dir={tmp_path / 'hf'}"]))
    vl = train(
        load_config(
            FeedbackLoopConfig,
            TINY,
            [
                *over,
                f"output_dir={tmp_path / 'vllm'}",
                "generation.backend=vllm",
                f"generation.vllm.python={VLLM_PYTHON}",
            ],
        )
    )
    assert vl["steps_run"] == 2 and all(math.isfinite(r["loss"]) for r in vl["train_log"])
    greedy_keys = [
        k
        for k in hf["history"][0]
        if k.startswith(("rouge", "val_", "copy", "novel", "length", "hack", "win"))
    ]
    assert "rouge_l_neutral" in greedy_keys and "win_rate" in greedy_keys
    for k in greedy_keys:
        assert vl["history"][0][k] == hf["history"][0][k], k
    # the last evaluation's greedy summaries (vLLM's) are the exported policy's (model.generate's)
    rows = [json.loads(x) for x in (tmp_path / "vllm" / "per_article.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["step"] == 2]
    tok = load_tokenizer(TINY_H32)
    policy = load_causal_lm(str(tmp_path / "vllm" / "policy"))
    cfg = load_config(FeedbackLoopConfig, TINY, over)
    build = PromptBuilder(tok, cfg.policy)
    test = {e.id: e for e in load_splits(cfg, 1).test}
    prompts = [build(test[r["id"]].article) for r in last]
    with torch.no_grad():
        again = decode(tok, generate(policy, tok, prompts, cfg.generation, greedy=True))
    assert again == [r["summary"] for r in last]


class StandInEngine:
    """An engine that generates in this process (the hf path) and records each call: what a run's
    generation backend hands to vLLM, without vLLM."""

    def __init__(self):
        self.calls: list[tuple[bool, int]] = []  # (greedy, num_samples) of each call
        self.busy = False  # inside a call

    def generate(self, model, tokenizer, prompts, gen, num_samples=1, greedy=False, seed=None):
        self.calls.append((greedy, num_samples))
        self.busy = True
        try:
            return generate(model, tokenizer, prompts, gen, num_samples, greedy, seed)
        finally:
            self.busy = False


def test_the_backend_serves_the_policy_with_its_adapters_on_and_nothing_else():
    """A vllm GenerationBackend hands its engine the policy's calls only: a frozen reference, and the
    policy inside disable_adapter() (the LoRA reference), generate in this process, as every model does
    under the hf backend; keep_prefix is refused on the engine."""
    from peft import LoraConfig, get_peft_model

    from judgeloop.loop.rollout import IN_PROCESS, GenerationBackend

    policy = get_peft_model(
        load_causal_lm("judgeloop-tiny/causal-lm"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    frozen = load_causal_lm("judgeloop-tiny/causal-lm")
    engine = StandInEngine()
    backend = GenerationBackend(engine, policy)
    assert backend.engine_serving(policy) is engine
    with policy.disable_adapter():
        assert backend.engine_serving(policy) is None
    assert backend.engine_serving(policy) is engine  # adapters back on
    assert backend.engine_serving(frozen) is None
    assert IN_PROCESS.engine_serving(policy) is None
    tok = load_tokenizer("judgeloop-tiny/causal-lm")
    gen = GenerationConfig(max_new_tokens=3)
    assert generate(frozen, tok, [[5, 6, 7]], gen, greedy=True, backend=backend)  # in this process
    assert engine.calls == []
    generate(policy, tok, [[5, 6, 7]], gen, num_samples=2, seed=1, backend=backend)
    assert engine.calls == [(False, 2)]
    with pytest.raises(ValueError, match="keep_prefix needs the training model's own prompt pass"):
        generate(policy, tok, [[5, 6, 7]], gen, num_samples=2, seed=1, keep_prefix=[], backend=backend)


@pytest.mark.parametrize("lora", [False, True])
def test_the_policys_reference_never_reaches_the_engine(lora):
    """A Policy whose backend is a vllm engine sends the engine its own samples and greedy summaries, and
    keeps the reference in this process: the frozen copy under full fine-tuning, the policy with its
    adapters disabled under LoRA (then the engine's model itself)."""
    from accelerate import Accelerator

    from judgeloop.loop.policy import Policy, load_policy
    from judgeloop.loop.rollout import GenerationBackend

    cfg = load_config(
        FeedbackLoopConfig, TINY, [*FAST, "policy.sft_steps=0", f"policy.lora={str(lora).lower()}"]
    )
    model, tok, ref = load_policy(cfg.policy, 0)
    assert (ref is None) == lora
    engine = StandInEngine()
    policy = Policy(Accelerator(cpu=True), model, ref, tok, PromptBuilder(tok, cfg.policy))
    policy.backend = GenerationBackend(engine, policy.unwrapped)
    examples = load_splits(cfg, 1).test[:3]
    gen = cfg.generation
    assert len(policy.reference_greedy(examples, gen, 2)) == 3
    assert engine.calls == []  # the reference generated here
    policy.greedy(examples, gen, 2)
    policy.sample([e.article for e in examples], gen, seed=1)
    kls, _ = policy.sampled_kl(examples, gen, 2, seed=1)  # the sample on the engine, the log-probs here
    assert engine.calls == [(True, 1), (True, 1), (False, 2), (False, 1), (False, 1)]
    assert len(kls) == 3 and all(math.isfinite(k) for k in kls)
    assert policy.reference_greedy(examples, gen, 2) and len(engine.calls) == 5  # still here after


@pytest.mark.slow
def test_a_runs_backend_reaches_every_generation_of_the_policy(tmp_path, monkeypatch):
    """Under generation.backend: vllm every generation of the policy in a run (the rollouts, the
    calibration samples, the evaluations' greedy summaries and samples, the curve) goes to the engine
    the run's backend holds, and the reference's summaries (LoRA: the policy with its adapters disabled)
    stay in this process. A stand-in engine that generates in process takes vLLM's place."""
    import contextlib

    from judgeloop.loop import policy as policy_module
    from judgeloop.loop import rollout as rollout_module
    from judgeloop.loop import setup
    from judgeloop.recipes import train

    engine = StandInEngine()
    served: list = []  # the model the engine was started for
    bypassed: list[int] = []  # in-process generations of the policy, adapters on, outside the engine
    reference = 0

    @contextlib.contextmanager
    def stand_in(cfg, model, tokenizer, out_dir, optimizer=None):
        served.append(model)
        yield engine

    real = rollout_module._generate

    def watched(model, *args, **kwargs):
        nonlocal reference
        if rollout_module.adapters_disabled(model):
            reference += 1
        elif model is served[-1] and not engine.busy:
            bypassed.append(len(engine.calls))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(setup, "check_backend", lambda cfg: None)  # no vLLM environment needed
    monkeypatch.setattr(policy_module, "policy_engine", stand_in)
    monkeypatch.setattr(rollout_module, "_generate", watched)
    over = [*FAST, "max_steps=2", "policy.lora=true", "curve.every_n_steps=2", "generation.backend=vllm"]
    report = train(load_config(FeedbackLoopConfig, TINY, [*over, f"output_dir={tmp_path}"]))
    assert report["steps_run"] == 2
    assert len(served) == 1 and not bypassed
    assert reference > 0  # the reference summaries, in this process
    # rollouts and calibration samples, the evaluations' and the curve's samples, their greedy summaries
    assert {(False, 2), (False, 2 * 8), (False, 1), (True, 1)} <= set(engine.calls)


def test_backend_errors_are_one_line_before_any_work(tmp_path, monkeypatch):
    """Bad vLLM settings stop the run at the config check, each with the key and the fix."""
    from judgeloop.recipes import train

    base = [*FAST, f"output_dir={tmp_path}", "generation.backend=vllm", "policy.model=" + TINY_H32]
    cases = [
        (
            ["policy.model=judgeloop-tiny/causal-lm"],
            "policy.model='judgeloop-tiny/causal-lm' has attention heads of size 16, which vLLM's CPU "
            "attention does not take",
        )
    ] * (not torch.cuda.is_available())  # vLLM runs on the CPU where torch sees no GPU
    cases += [
        (
            ["generation.vllm.python=/no/such/python"],
            "generation.vllm.python='/no/such/python' is not a file",
        ),
        (
            ["generation.vllm.url=http://127.0.0.1:9"],
            "generation.vllm.url='http://127.0.0.1:9' does not answer",
        ),
        (["generation.vllm.mode=colocate"], "generation.vllm.mode=colocate"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            train(load_config(FeedbackLoopConfig, TINY, [*base, *extra]))
    import judgeloop.loop.vllm_backend as backend

    monkeypatch.setenv("JUDGELOOP_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(backend, "_REPO", tmp_path)  # no .venv-vllm in the checkout either
    with pytest.raises(ConfigError, match="no vLLM environment found .* run make vllm"):
        train(load_config(FeedbackLoopConfig, TINY, base))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="runs in one training process"):
        train(load_config(FeedbackLoopConfig, TINY, base))
    with pytest.raises(ValueError, match="is not an http"):
        load_config(FeedbackLoopConfig, TINY, [*base, "generation.vllm.url=localhost:8000"])
    assert not (tmp_path / "config.yaml").exists()  # nothing was written: the check came first
