"""The feedback loop's config schema (one typed, nested dataclass; YAML + dotted overrides).

``judgeloop train --config configs/feedback_loop/tiny.yaml loss.beta=0.2`` builds
:class:`FeedbackLoopConfig`; every value is validated here, at the boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from judgeloop.config import WAIT_S, bounded, check_fields, field_order
from judgeloop.data import DataConfig, SplitConfig
from judgeloop.devices import Device
from judgeloop.judges import JudgeConfig, PanelConfig
from judgeloop.rewards import RewardConfig
from judgeloop.signals import DEFAULT_STOP_SIGNALS, check_signal_names
from judgeloop.tracking import TRACKERS

# the arms' names, in the order of their table (judgeloop.loop.arms.ARM_TABLE; a test keeps the two equal)
Arm = Literal[
    "raw",
    "platt",
    "isotonic",
    "temperature",
    "feature_platt",
    "feature_platt_cw",
    "feature_platt_sharp",
    "style_residual",
    "bias_curve",
    "ceiling",
    "panel",
    "oracle",
]
ARMS: tuple[str, ...] = get_args(Arm)


@dataclass
class PolicyBase:
    """The policy settings and checks every recipe that trains one shares: the feedback loop's
    :class:`PolicyConfig` and the GRPO recipe's ``GrpoPolicyConfig`` extend it with their own keys and
    defaults (a recipe accepts only the keys it uses: GRPO has no ``dtype`` or ``sft_*``)."""

    model: str = "judgeloop-tiny/causal-lm"
    lora: bool = False
    lora_r: int = bounded(8, ge=1, hint=" (the LoRA rank)")
    lora_alpha: int = bounded(16, gt=0, hint=" (the LoRA scaling numerator)")
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    prompt_template: str = "Summarize the following text in one short sentence.\n\n{article}"
    max_article_tokens: int = bounded(128, ge=8, message="{key}={value} is too small; use at least 8")

    def __post_init__(self) -> None:
        check_fields("policy", self)
        if "{article}" not in self.prompt_template:
            raise ValueError(
                f"policy.prompt_template={self.prompt_template!r} has no '{{article}}' placeholder; add one"
            )


@field_order(
    "model",
    "dtype",
    "lora",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "prompt_template",
    "use_chat_template",
    "max_article_tokens",
    "sft_steps",
    "sft_learning_rate",
    "sft_batch_size",
    "sft_max_tokens",
    "sft_seed",
)
@dataclass
class PolicyConfig(PolicyBase):
    """The policy being trained and how prompts are built (the shared keys: :class:`PolicyBase`).

    ``lora: true`` trains LoRA adapters (peft); the reference model is then the same base with the
    adapters disabled, so no second copy of the weights is held. Otherwise the whole model is trained
    and a frozen copy is the reference. ``sft_steps > 0`` first warms the policy up by supervised
    fine-tuning on the training articles' neutral references (SFT, then preference tuning); a random
    tiny model needs it to say anything at all. The warm start uses ``sft_seed``, not the run seed,
    so every seed of an ablation starts from the same policy (as from one pretrained checkpoint).
    ``dtype: bfloat16`` stores the frozen weights (the LoRA base, or the reference copy) in bf16 and turns
    on bf16 autocast; the trained weights stay float32 master weights (not under FSDP: there the
    launch file's mixed precision casts and every weight is stored in float32).
    """

    dtype: Literal["float32", "bfloat16"] = "float32"
    lora_dropout: float = bounded(0.0, ge=0, lt=1)
    use_chat_template: bool = True
    sft_steps: int = bounded(0, ge=0, shape="section")
    RENAMED: ClassVar[dict[str, str]] = {"sft_lr": "sft_learning_rate"}
    sft_learning_rate: float = bounded(3e-3, gt=0)
    sft_batch_size: int = bounded(16, ge=1, shape="section")
    sft_max_tokens: int = bounded(32, ge=1, hint=" (tokens)")
    sft_seed: int = bounded(0, ge=0, le=2**32 - 1)

    def __post_init__(self) -> None:
        check_fields("policy", self)
        super().__post_init__()


@dataclass
class VllmConfig:
    """The vLLM engine of ``generation.backend: vllm`` (:mod:`judgeloop.loop.vllm_backend`, ``docs/vllm.md``).

    ``mode: server`` (TRL's server mode): rollouts and greedy evaluation are requests to vLLM's
    OpenAI-compatible server, started by judgeloop from the vLLM environment's ``python`` (null:
    ``$JUDGELOOP_VLLM_PYTHON``, else the ``.venv-vllm`` that ``make vllm`` builds), or already running at
    ``url`` (judgeloop then starts none). The policy's weights reach the engine through ``sync_dir``
    (null: a temporary folder, removed after the run; a server at ``url`` must be able to read it): after
    each optimizer step the policy's weights, LoRA adapters merged in, are written there and the engine
    reloads them, all of them: vLLM 0.32's in-place reload rebuilds a layer that gets part of its weights
    from those alone (``model_loader/reload/layerwise.py``; read, not run), so a fused ``qkv_proj`` sent
    only the q and v that LoRA targeted would lose k. ``mode: colocate`` (vLLM inside the
    training process) needs vLLM importable in the training environment.
    ``dtype``: the engine's weights and compute (``auto``: bfloat16 when ``policy.dtype=bfloat16``, else
    float32, where greedy output equals ``model.generate``'s). ``kv_cache_gib``: the engine's KV cache on
    a CPU (``VLLM_CPU_KVCACHE_SPACE``); ``max_model_len``: its longest prompt + summary (null: 2048).
    ``extra_args``: more ``vllm serve`` arguments (e.g. ``--gpu-memory-utilization=0.3`` on a GPU).
    """

    mode: Literal["server", "colocate"] = "server"
    python: str | None = None
    url: str | None = None
    sync_dir: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    port: int = bounded(0, ge=0, le=65535, hint=" (0: a free port)", shape="section")
    max_model_len: int | None = bounded(None, ge=16, shape="section")
    kv_cache_gib: int = bounded(1, ge=1, shape="section")
    startup_timeout_s: float = bounded(900.0, WAIT_S, gt=0, shape="section")
    request_timeout_s: float = bounded(600.0, WAIT_S, gt=0, shape="section")
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_fields("generation.vllm", self)
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"generation.vllm.url={self.url!r} is not an http(s) address; e.g. http://127.0.0.1:8000"
            )


@dataclass
class GenerationConfig:
    """Sampling for rollouts (two summaries per article; ``num_samples_per_article`` under
    ``loss.type: grpo``, where it is the group size k); evaluation decodes greedily.

    ``autocast``: generate under the run's mixed-precision autocast. Off by default: decoding reads every
    weight once per token, and autocast would re-cast each float32 weight at each step (measured: slower
    with it, docs/benchmarks.md "Figures behind config defaults").
    A LoRA base stored in bf16 (``policy.dtype=bfloat16``) decodes in bf16 either way.

    ``backend``: ``hf`` (default) samples with the training model's ``generate``; ``vllm`` sends the
    policy's rollouts and greedy evaluations to a vLLM engine (``vllm``: :class:`VllmConfig`) holding a
    copy of its weights, synced after every optimizer step. The KL and the update's log-probs still come
    from the training model. The sampling settings map one to one (temperature, top_p, top_k, max new
    tokens, the special tokens other than EOS suppressed), each sample with its own seed derived from
    the batch's, so a run is reproducible; the random draws are vLLM's, so samples differ from ``hf``'s
    while greedy output at float32 is the same.
    """

    max_new_tokens: int = bounded(24, ge=1, shape="section")
    temperature: float = bounded(1.0, gt=0, hint=" (evaluation is the greedy pass)", shape="section")
    top_p: float = bounded(1.0, gt=0, le=1, shape="section")
    top_k: int = bounded(0, ge=0, hint=" (0: off)")
    autocast: bool = False
    num_samples_per_article: int = bounded(2, ge=2, hint=" (a group needs two to compare)", shape="section")
    backend: Literal["hf", "vllm"] = "hf"
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        check_fields("generation", self)


@dataclass
class LossConfig:
    """The policy objective plus an explicit KL penalty ``kl_coef * KL(pi || pi_ref)``.

    ``type: dpo`` (default): soft-target DPO on one pair per article. ``margin``: pairs with
    ``|p - 0.5| < margin`` are skipped. With a judge panel, ``max_spread`` skips
    pairs whose members disagree more than that (the standard deviation of their calibrated p, at most
    0.5; the default 0.5 skips none), and ``spread_weighting`` weights each pair's DPO term by
    ``1 - 2 * spread`` (1 when the members agree, 0 at the widest disagreement).

    ``type: grpo``: group-relative policy gradient (:mod:`judgeloop.loop.grpo`) on
    ``generation.num_samples_per_article`` samples per article. Each sample's reward comes from the
    arm's calibrated p of comparisons inside its group (:func:`judgeloop.rewards.score_groups` with the
    run's ``rewards:`` section, :class:`~judgeloop.rewards.RewardConfig`); its advantage is
    ``r - mean(group)``, divided by the group's standard deviation under ``scale_rewards: group`` (TRL's
    GRPO) and not under ``none`` (Dr. GRPO); the loss is TRL's clipped surrogate with clip range ``epsilon``, averaged over the
    batch's completion tokens. ``beta``, ``target``, ``margin``, ``max_spread`` and ``spread_weighting``
    are DPO settings (an error under grpo); the KL weight is ``kl_coef`` under both.

    How strongly the calibrated p teaches (DPO): ``target_temperature`` T sharpens (T < 1) or softens
    (T > 1) every target, p' = sigmoid(logit(p) / T), which changes the signal's size and never its order
    (1: p as calibrated; a calibrator that shrinks p toward 0.5 gives back its size at T < 1, choose T on
    the validation split). ``pair_weighting: confidence`` weights each pair's DPO term by the calibrated
    confidence ``|2p - 1|`` (before sharpening; with ``target: hard`` this is confidence-weighted
    preference optimization), so a pair the calibrator calls a coin flip teaches nothing and a sure one
    teaches fully; ``none`` (default) weights every kept pair 1.
    """

    type: Literal["dpo", "grpo"] = "dpo"
    scale_rewards: Literal["group", "none"] = "group"
    RENAMED: ClassVar[dict[str, str]] = {
        "reward_scheme": "rewards.scheme",
        "reward_aggregate": "rewards.aggregate",
    }
    epsilon: float = bounded(0.2, gt=0, shape="section")
    beta: float = bounded(0.1, gt=0, shape="section")
    target: Literal["soft", "hard"] = "soft"
    target_temperature: float = bounded(
        1.0, gt=0, hint=" (1 keeps p as calibrated; < 1 sharpens)", shape="section"
    )
    pair_weighting: Literal["none", "confidence"] = "none"
    margin: float = bounded(
        0.0, ge=0, lt=0.5, hint="; pairs with |p - 0.5| < margin are skipped", shape="section"
    )
    max_spread: float = bounded(
        0.5,
        gt=0,
        le=0.5,
        hint=": a panel's spread is the standard deviation of probabilities (0.5 keeps every pair)",
        shape="section",
    )
    spread_weighting: bool = False
    kl_coef: float = bounded(0.05, ge=0, shape="section")
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_adaptive: bool = False
    kl_target: float = bounded(1.0, gt=0, hint=" (the adaptive KL controller's target, in nats)")
    kl_horizon: int = bounded(100, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("loss", self)
        if self.type == "grpo":
            dpo_only = [k for k in DPO_ONLY_KEYS if getattr(self, k) != getattr(LossConfig, k)]
            if dpo_only:
                key = dpo_only[0]
                why = " (the DPO temperature; grpo's KL weight is loss.kl_coef)" if key == "beta" else ""
                raise ValueError(
                    f"loss.{key}={getattr(self, key)!r} is a DPO setting{why}; loss.type=grpo does not read "
                    f"it: leave it at its default {getattr(LossConfig, key)!r}"
                )


DPO_ONLY_KEYS = (
    "beta",
    "target",
    "target_temperature",
    "pair_weighting",
    "margin",
    "max_spread",
    "spread_weighting",
)
GRPO_ONLY_KEYS = ("scale_rewards", "epsilon")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule of the loop (``optim.*``).

    ``update_chunk_size``: the update's forward and backward passes take this many articles at a time
    (their gradients accumulate into one optimizer step), trading a little speed for activation memory;
    null (default) runs the whole per-process batch at once. The update equals the unchunked one up to
    float summation order (measured in docs/benchmarks.md).

    ``share_prompt_pass`` (default on): the rollout's pass of the policy over the prompts runs with
    gradients and the update reuses it instead of running the prompts again
    (:class:`~judgeloop.loop.rollout.PromptPrefix`); values and gradients are those of a fresh pass up to
    float rounding (tested). It applies where the two passes compute the same: no active dropout, the
    update in one chunk, generation and update at one precision (no bf16 autocast: ``mixed_precision:
    no`` and a float32 frozen base; or ``generation.autocast``), no ZeRO-3 / FSDP sharding; elsewhere the
    update runs the prompts itself.
    It holds the prompts' activations from the rollout to the update (the update holds them anyway).
    """

    RENAMED: ClassVar[dict[str, str]] = {"lr": "learning_rate"}
    learning_rate: float = bounded(1e-4, gt=0, shape="section")
    weight_decay: float = bounded(0.0, ge=0)
    warmup_steps: int = bounded(0, ge=0, shape="section")
    scheduler: Literal["constant", "linear"] = "constant"
    max_grad_norm: float = bounded(1.0, ge=0)
    update_chunk_size: int | None = bounded(
        None, ge=1, hint=", or null (the whole batch at once)", shape="section"
    )
    share_prompt_pass: bool = True

    def __post_init__(self) -> None:
        check_fields("optim", self)


@dataclass
class LoopCalibrationConfig:
    """How the judge's raw logit becomes p, and when the calibrator is refit.

    ``method``: the arm, one row of :mod:`judgeloop.loop.arms` (which says what each needs and when to
    pick it). ``raw`` is p = sigmoid(raw logit); ``oracle`` replaces the judge by the
    neutral ROUGE labeler (logit = ``oracle_scale`` * (ROUGE-L(a) - ROUGE-L(b))), the upper bound;
    ``style_residual`` subtracts the style term its logit carries, fit without labels
    (:class:`~judgeloop.calibration.StyleResidualCalibrator`), and ``bias_curve`` a monotone curve of
    each style feature (:class:`~judgeloop.calibration.BiasCurveCalibrator`); ``feature_platt_cw`` is
    ``feature_platt`` with hard targets weighted by the calibrated confidence; ``ceiling`` is
    ``feature_platt`` fitted also on the oracle labels of every training pair of the run so far (a
    measurement of this judge's limit, not a setting for users: it reads labels of the training pairs);
    ``panel`` trains against a judge panel
    (:mod:`judgeloop.judges.panel`): the configured judge plus ``panel.members`` (or, with
    ``judge.type: panel``, that panel), each member calibrated by ``panel.member_calibration`` on the
    calibration pairs at every (re)fit and combined by ``panel.combine``. The evaluation's judge stays the
    configured one in every arm, so the arms are compared by one yardstick.
    The first fit happens before step 1; refits every ``recalibrate_every_n_steps`` (0 = never) and
    whenever the ECE monitored every ``monitor_every_n_steps`` on fresh policy samples exceeds
    ``ece_threshold``. Calibration pairs come only from the ``calibration`` split (checked):
    ``num_articles`` articles with ``pairs_per_article`` pairs each, and up to ``extra_rounds`` more
    batches of ``num_articles`` when ROUGE-L ties leave fewer than ``min_points`` pairs to fit on.

    Every refit measures ECE before and after on the held-out calibration articles, each with a 95%
    bootstrap interval over those pairs (``ece_bootstrap`` replicates, seeded). ``refit_accept``:
    ``better`` (default) keeps the previous calibrator when the new one is worse on the held-out pairs
    (the log and the refit record say so); ``always`` takes every successful refit.
    """

    method: Arm = "platt"
    panel: PanelConfig = field(default_factory=PanelConfig)
    labels: Literal["rouge"] = "rouge"
    recalibrate_every_n_steps: int = bounded(0, ge=0, hint=" (0 = off)")
    monitor_every_n_steps: int = bounded(0, ge=0, hint=" (0 = off)")
    ece_threshold: float = bounded(0.1, ge=0, le=1, hint=" (an ECE is a probability gap)")
    num_articles: int = bounded(32, ge=2, shape="section")
    extra_rounds: int = bounded(3, ge=0, hint=" (0: never draw more)", shape="section")
    pairs_per_article: int = bounded(2, ge=1, shape="section")
    holdout_fraction: float = bounded(0.3, gt=0, lt=1, shape="section")
    min_points: int = bounded(10, ge=1, hint=" (pairs a calibrator needs to be fitted)")
    RENAMED: ClassVar[dict[str, str]] = {"n_bins": "num_bins"}
    num_bins: int = bounded(10, ge=0)
    oracle_scale: float = bounded(20.0, gt=0)
    refit_accept: Literal["better", "always"] = "better"
    ece_bootstrap: int = bounded(1000, ge=0, hint=" (0: no interval)", shape="section")

    def __post_init__(self) -> None:
        check_fields("calibration", self)


ALARM_SIGNALS = ("rouge", "length", "copy_rate")


@dataclass
class CurveConfig:
    """The validation curve (:mod:`judgeloop.loop.curve`): every ``every_n_steps`` (0: off), at step 0
    and at the last step, one greedy summary and one sample per article of the first ``num_articles``
    validation articles (the same ones each time), with the neutral ROUGE-L gain from step 0 and its
    interval, the style metrics, KL and the judge's signal; into ``report.json`` (``curve``),
    ``curve.md``, ``curve.png`` and the trackers (``curve/*``)."""

    every_n_steps: int = bounded(0, ge=0, hint=" (0 disables)", shape="section")
    num_articles: int = bounded(16, ge=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("curve", self)


@dataclass
class AlarmConfig:
    """Divergence alarms: does the training judge still agree with objective signals, and a panel's
    members with each other? (:mod:`judgeloop.loop.alarms`)

    Every ``every_n_steps`` (0: off) the loop takes fresh calibration-split pairs of the current policy
    (the ones a monitor or refit at that step draws, else new ones) and measures, per signal in
    ``signals`` (``rouge``: ROUGE-L against the references, ``length``: shorter is better,
    ``copy_rate``: less copied is better), the share of pairs on which the training judge's calibrated
    p and the signal prefer the same summary (pairs the signal ties on are left out); with a panel and
    ``members: true``, also each pair of members. When the agreement pooled over the last ``window``
    checks, on at least ``min_pairs`` pairs, falls below ``threshold``, an alarm fires: it is logged
    (``alarm/*`` in the trackers, ``alarms`` in the report) and acted on by ``action``: ``log`` only;
    ``refit`` the calibrator at once; ``downweight``: the judge's weight is multiplied by
    ``downweight_factor`` (targets shrink toward 0.5, p' = 0.5 + w (p - 0.5)); ``stop`` training and keep
    the best validation checkpoint (needs a validation split).
    """

    signals: list[str] = field(default_factory=list)
    every_n_steps: int = bounded(0, ge=0, hint=" (0 disables)", shape="section")
    threshold: float = bounded(0.5, gt=0, lt=1, hint="; e.g. 0.5 (chance agreement)", shape="section")
    window: int = bounded(2, ge=1, shape="section")
    min_pairs: int = bounded(10, ge=1, shape="section")
    members: bool = True
    action: Literal["log", "refit", "downweight", "stop"] = "log"
    downweight_factor: float = bounded(0.5, ge=0, lt=1, shape="section")

    def __post_init__(self) -> None:
        check_fields("alarms", self)
        bad = [s for s in self.signals if s not in ALARM_SIGNALS]
        if bad:
            raise ValueError(f"alarms.signals has unknown signal(s) {bad}; choose from {list(ALARM_SIGNALS)}")

    @property
    def enabled(self) -> bool:
        """Whether any check runs."""
        return bool(self.every_n_steps)


@dataclass
class RoundsConfig:
    """Iterated batch DPO, the loop under ``mode: rounds`` (docs/rounds.md): a step of the run is a round
    (``max_steps`` rounds), each the loop's steps once over ``prompts_per_round`` training articles (per
    process, as ``batch_size``): the policy of the round's start samples two summaries per article (1),
    the judge scores the pairs (2), the calibrator fit on fresh calibration-split samples of that same policy maps them to p (3), p becomes the
    soft targets (4), and the update takes ``dpo_epochs`` passes over the round's pairs, one optimizer step
    per ``batch_size`` pairs in a seeded order (5); then the calibrator is refit on samples of the new
    policy for the next round (6). ``max_steps``, ``eval_every_n_steps``, ``save_every_n_steps``,
    ``stop_after_n_steps``, ``calibration.recalibrate_every_n_steps`` and ``curve.every_n_steps`` count
    rounds; the three schedules, left at their defaults, run every round (every round is evaluated, its
    calibrator refit, and a checkpoint written, so a killed run continues at its next unfinished round)."""

    prompts_per_round: int = bounded(64, ge=1, hint=" (training articles per round, per process)")
    dpo_epochs: int = bounded(1, ge=1, hint=" (passes over a round's pairs)", shape="section")

    def __post_init__(self) -> None:
        check_fields("rounds", self)


# Keys a resumed run may change: they cannot change what the run computes (``max_steps`` extends it).
RESUME_FREE_KEYS = (
    "output_dir",
    "progress_bar",
    "log_with",
    "resume_from",
    "stop_after_n_steps",
    "max_steps",
    "start_cache",
    "save_every_n_steps",
    "keep_checkpoints",
    "project_name",
    "run_name",
    "run_group",
    "save_final_policy",
    "judge_prefetch",
    "judge_prefetch_threads",
    "ablation",
    "threads",  # float rounding only; a resume at another count says so in the log
    "stop_signals",
    "overwrite",
)


@dataclass
class FeedbackLoopConfig:
    """Everything one run of the calibrated feedback loop needs.

    ``mode``: ``online`` (default), one optimizer step per batch of fresh samples; ``rounds``, iterated
    batch DPO (:class:`RoundsConfig`, the ``rounds:`` section): a step is a round, the same steps once over
    a round's samples with several optimizer steps (``max_steps``: the number of rounds).

    ``device``: ``auto`` (a GPU when accelerate sees one, honouring the launch file's DDP / FSDP /
    DeepSpeed; else the CPU), ``cpu`` (gloo on CPU even on a GPU machine) or ``cuda`` (an error before any
    work where there is no GPU).
    ``batch_size`` is the number of train articles *per process* per step (two samples each).
    ``log_with``: trackers (:mod:`judgeloop.tracking`: ``jsonl``, always on, plus any accelerate
    supports); ``project_name``, ``run_name`` (default ``METHOD-seedSEED``) and ``run_group`` (an
    ablation's output folder) name the run on a dashboard.
    ``keep_checkpoints``: only the newest k ``checkpoints/step_N`` are kept (null: all); the best
    validation policy lives apart, in ``best_policy/``.
    ``judge_prefetch`` lets the judge do the next batch's summary-independent work (an embedding
    judge's article embeddings) on a background thread during the policy update; scores are the same.
    Unset (auto), it is on only when the judge runs on a GPU. On CPU, set to true, the cores are split
    while the judge thread works: ``judge_prefetch_threads`` intra-op threads for the judge (default
    half), the rest for the policy. That pays when the policy's step is small (the tiny config), not
    when its matrix products need every core.
    ``save_final_policy`` writes the kept policy to ``output_dir/policy`` (``from_pretrained`` layout).
    ``start_cache``: a folder where the work done before step 1 is shared with other runs (set by the
    ablation; see :mod:`judgeloop.loop.start_cache`); one process only, ignored under several.
    ``threads``: torch's intra-op CPU thread count for the run (null: as the process has it, e.g. from
    ``OMP_NUM_THREADS``). Results agree bit for bit only between runs at one count: checkpoints record
    the count (and the kernels and precision) they ran with, and a resume at another says so in the log.
    ``resume_from``: a checkpoint folder, or ``auto``: the newest checkpoint under
    ``output_dir/checkpoints``, or a fresh start when there is none (the log says which).
    ``stop_signals``: signals that stop the run like a scheduler's preemption (:mod:`judgeloop.signals`):
    the step in progress finishes, a checkpoint is written, one line names it and how to continue, and
    the exit status is 128 + the signal's number (143 for SIGTERM). Ctrl-C (SIGINT) stops at once unless
    listed here.
    """

    output_dir: str = "runs/feedback_loop"
    mode: Literal["online", "rounds"] = "online"
    overwrite: bool = False  # true: clear an output_dir that holds another run (judgeloop.rundir)
    seed: int = bounded(0, ge=0, le=2**32 - 1)
    RETIRED: ClassVar[dict[str, str]] = {
        "cpu": "set device: cpu (or auto, the default: a GPU when accelerate sees one, else the CPU)"
    }
    device: Device = "auto"
    mixed_precision: Literal["no", "bf16"] = "no"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    data: DataConfig = field(
        default_factory=lambda: DataConfig(split=SplitConfig(calibration=0.2, test=0.1, validation=0.1))
    )
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)  # read under loss.type=grpo
    optim: OptimConfig = field(default_factory=OptimConfig)
    calibration: LoopCalibrationConfig = field(default_factory=LoopCalibrationConfig)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    curve: CurveConfig = field(default_factory=CurveConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)  # read under mode=rounds
    batch_size: int = bounded(4, ge=1, shape="section")
    RENAMED: ClassVar[dict[str, str]] = {"num_steps": "max_steps"}
    # a section of the same file that another command reads: accepted here unread, checked by that
    # command's schema (judgeloop ablate: judgeloop.studies.ablation_config.AblateConfig)
    SHARED_SECTIONS: ClassVar[dict[str, str]] = {"ablation": "judgeloop ablate"}
    RUN_FREE_KEYS: ClassVar[tuple[str, ...]] = RESUME_FREE_KEYS  # judgeloop.rundir: a resume may change these
    max_steps: int = bounded(20, ge=1, shape="section")
    eval_every_n_steps: int = bounded(10, ge=0, hint=" (0 = off)")
    save_every_n_steps: int = bounded(0, ge=0, hint=" (0 = off)")
    keep_checkpoints: int | None = bounded(None, ge=1, hint=", or null to keep every one", shape="section")
    early_stopping_patience: int = bounded(0, ge=0, hint=" (0 = off)", shape="section")
    judge_prefetch: bool | None = None
    judge_prefetch_threads: int | None = bounded(
        None, ge=1, hint=", or null for half the cores", shape="section"
    )
    save_final_policy: bool = True
    num_eval_articles: int = bounded(32, ge=0)
    num_validation_articles: int = bounded(16, ge=0, shape="section")
    eval_batch_size: int = bounded(16, ge=0)
    resume_from: str | None = None
    stop_after_n_steps: int | None = bounded(None, ge=1, hint=" or null", shape="section")
    start_cache: str | None = None
    log_with: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    project_name: str = "judgeloop"
    run_name: str | None = None
    run_group: str | None = None
    progress_bar: bool = True
    threads: int | None = bounded(None, ge=1, hint=", or null for the process's own count", shape="section")
    stop_signals: list[str] = field(default_factory=lambda: list(DEFAULT_STOP_SIGNALS))

    def __post_init__(self) -> None:
        check_fields("", self)
        if self.early_stopping_patience and not self.eval_every_n_steps:
            raise ValueError(
                "early_stopping_patience needs eval_every_n_steps > 0 (stopping is decided at evaluations)"
            )
        if self.early_stopping_patience and self.data.split.validation <= 0:
            raise ValueError(
                f"early_stopping_patience={self.early_stopping_patience} needs a validation split; set "
                "data.split.validation=0.1 (the test split never chooses a checkpoint)"
            )
        if self.curve.every_n_steps and self.num_validation_articles == 0:
            raise ValueError(
                f"curve.every_n_steps={self.curve.every_n_steps} draws its curve on validation articles but "
                "num_validation_articles=0; set num_validation_articles=16 (or curve.every_n_steps=0)"
            )
        keeps_best = self.early_stopping_patience or (self.alarms.action == "stop" and self.alarms.enabled)
        if keeps_best and self.num_validation_articles == 0:
            what = (
                f"early_stopping_patience={self.early_stopping_patience}"
                if self.early_stopping_patience
                else "alarms.action=stop"
            )
            raise ValueError(
                f"{what} chooses the best validation checkpoint but num_validation_articles=0; set "
                "num_validation_articles=16 (or turn it off)"
            )
        if self.alarms.action == "stop" and self.alarms.enabled and self.data.split.validation <= 0:
            raise ValueError(
                "alarms.action=stop keeps the best validation checkpoint and needs a validation split; set "
                "data.split.validation=0.1"
            )
        panel = self.judge.type == "panel" or self.calibration.method == "panel"  # the panel arm's row
        if self.alarms.enabled and not self.alarms.signals and not (panel and self.alarms.members):
            raise ValueError(
                f"alarms.every_n_steps={self.alarms.every_n_steps} but there is nothing to check: list "
                "alarms.signals (rouge, length, copy_rate), or train against a panel with alarms.members=true"
            )
        if (
            self.calibration.method == "panel"
            and self.judge.type != "panel"
            and not self.calibration.panel.members
        ):
            raise ValueError(
                "calibration.method=panel needs other judges beside the configured one: list them in "
                "calibration.panel.members (e.g. an objective signal), or set judge.type=panel"
            )
        self._apply_arm_loss()
        self._check_loss_type()
        self._apply_mode()
        check_signal_names(self.stop_signals)
        bad = [t for t in self.log_with if t != "jsonl" and t not in TRACKERS]
        if bad:
            raise ValueError(f"log_with has unknown tracker(s) {bad}; choose from {['jsonl', *TRACKERS]}")
        if "jsonl" not in self.log_with:  # the loop's resume and the ablation's report read it
            self.log_with = ["jsonl", *self.log_with]

    def _apply_arm_loss(self) -> None:
        """The loss settings the arm implies (:mod:`judgeloop.loop.arms`), set where the config left the
        default; a config that sets one otherwise is refused, naming the key and the arm."""
        from judgeloop.loop.arms import arm

        spec = arm(self.calibration.method)
        if spec.loss and self.loss.type == "grpo":
            raise ValueError(
                f"calibration.method={spec.name} is a DPO arm (it sets loss.{spec.loss[0][0]}); use loss.type=dpo, "
                f"or the arm it builds on, calibration.method={spec.calibrator}"
            )
        for key, value in spec.loss:
            now, default = getattr(self.loss, key), getattr(LossConfig, key)
            if now not in (value, default):
                raise ValueError(
                    f"loss.{key}={now!r} conflicts with calibration.method={spec.name}, which trains with "
                    f"loss.{key}={value!r}; leave loss.{key} unset, or use calibration.method={spec.calibrator}"
                )
            setattr(self.loss, key, value)

    @property
    def articles_per_step(self) -> int:
        """Training articles per process in one step of the run: ``batch_size`` online, a round's
        ``rounds.prompts_per_round`` under ``mode: rounds``."""
        return self.rounds.prompts_per_round if self.mode == "rounds" else self.batch_size

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps (the learning-rate schedule's length): ``max_steps`` online; under
        ``mode: rounds`` each round's ``dpo_epochs`` passes of ``ceil(prompts_per_round / batch_size)``."""
        if self.mode == "online":
            return self.max_steps
        r = self.rounds
        return self.max_steps * r.dpo_epochs * math.ceil(r.prompts_per_round / self.batch_size)

    def _apply_mode(self) -> None:
        """``mode: rounds``: a step is a round, and the schedules left at their defaults run every round;
        settings that do not apply are refused, naming the key."""
        changed = [k for k, v in vars(self.rounds).items() if v != getattr(RoundsConfig, k)]
        if self.mode == "online":
            if changed:
                key = changed[0]
                raise ValueError(
                    f"rounds.{key}={getattr(self.rounds, key)!r} is read under mode=rounds only (iterated batch "
                    f"DPO); set mode=rounds or leave rounds.{key} unset"
                )
            return
        if self.loss.type != "dpo":
            raise ValueError(
                f"mode=rounds is iterated batch DPO; loss.type={self.loss.type} is online only: set loss.type=dpo "
                "or mode=online"
            )
        for key, every_round in (("eval_every_n_steps", 1), ("save_every_n_steps", 1)):
            if getattr(self, key) == getattr(FeedbackLoopConfig, key):
                setattr(self, key, every_round)
        if self.calibration.recalibrate_every_n_steps == LoopCalibrationConfig.recalibrate_every_n_steps:
            self.calibration.recalibrate_every_n_steps = 1

    def _check_loss_type(self) -> None:
        """Settings of the other objective are errors, not silently dropped."""
        if self.loss.type == "grpo":
            return
        k = self.generation.num_samples_per_article
        if k != 2:
            raise ValueError(
                f"generation.num_samples_per_article={k} is read under loss.type=grpo only (DPO samples one "
                "pair per article); set loss.type=grpo or leave it at 2"
            )
        grpo_only = [key for key in GRPO_ONLY_KEYS if getattr(self.loss, key) != getattr(LossConfig, key)]
        if grpo_only:
            key = grpo_only[0]
            raise ValueError(
                f"loss.{key}={getattr(self.loss, key)!r} is a GRPO setting; loss.type=dpo does not read it: "
                f"set loss.type=grpo or leave it at its default {getattr(LossConfig, key)!r}"
            )
        changed = [k for k, v in vars(self.rewards).items() if v != getattr(RewardConfig, k)]
        if changed:
            key = changed[0]
            raise ValueError(
                f"rewards.{key}={getattr(self.rewards, key)!r} is a GRPO setting; loss.type=dpo does not read "
                f"it: set loss.type=grpo or leave it at its default {getattr(RewardConfig, key)!r}"
            )
