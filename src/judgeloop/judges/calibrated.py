"""A calibrated judge that travels: a judge and the calibrator fitted to it, saved in one folder.

``judgeloop calibrate`` writes one per method (``OUTPUT_DIR/calibrated_judge/<method>/``) and the
feedback loop writes its final one (``OUTPUT_DIR/calibrated_judge/``); a trainer anywhere loads it::

    from judgeloop import CalibratedJudge

    judge = CalibratedJudge.from_pretrained("runs/summeval/calibrated_judge/platt")
    out = judge.compare(articles, summaries_a, summaries_b)
    out.p       # calibrated P(a better than b), NaN where the judgement failed
    out.logit   # the judge's raw logit (both orders combined when the judge debiases)
    out.status  # per item: ok, truncated, empty_summary, nonfinite, too_long

The folder holds ``judge.yaml`` (the judge's config: type, model, prompt, debiasing, style settings),
``calibrator.json`` (the fitted calibrator's state), ``calibrated_judge.json`` (the format version,
what it was fit on and its held-out figures) and a ``README.md`` card. A failed judgement stays a
status with ``p = nan``, never a number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from judgeloop.calibration.calibrators import CalibrationError, Calibrator, calibrator_from_state
from judgeloop.calibration.features import FEATURE_NAMES, features_for
from judgeloop.config import ConfigError, load_config, to_yaml
from judgeloop.io import DataError, atomic_dir, atomic_write_json, atomic_write_text, read_json
from judgeloop.judges import JudgeConfig, JudgeNeeds, build_judge, judge_needs
from judgeloop.judges.base import VALID_STATUSES, Judge, PointwiseJudge
from judgeloop.version import __version__

FORMAT = "judgeloop.calibrated_judge"
FORMAT_VERSION = 1
CARD_FILE = "calibrated_judge.json"


def check_judge_path(path: str, *, on_disk: bool = True) -> None:
    """One line when ``judge_path`` is empty or (``on_disk``) no calibrated judge folder: cheap, so configs
    and commands call it before any heavy work (a config's ``__post_init__`` checks only that it is set)."""
    fix = "a folder written by judgeloop calibrate (OUTPUT_DIR/calibrated_judge/<method>)"
    if not path:
        raise ConfigError(f"judge_path is empty; set judge_path=DIR, {fix}")
    if on_disk and not (Path(path) / CARD_FILE).is_file():
        raise ConfigError(f"judge_path={path} is not a calibrated judge (no {CARD_FILE}); pass {fix}")


# the texts of a batch of comparisons, and each one's reference summaries (None: the judge needs none)
Texts = Sequence[str]
References = Sequence[Sequence[str]] | None


class MissingReferences(ValueError):
    """A judge that reads references was called without them (the message names what to pass)."""


def items_without_references(references: References, n: int) -> list[int]:
    """The indices of the ``n`` items whose reference list is missing, empty or only blank texts."""
    if references is None:
        return list(range(n))
    return [i for i, refs in enumerate(references) if not any(str(r).strip() for r in refs)]


def check_references(
    needs: JudgeNeeds, references: References, n: int, fix: str, first: str = "item {i}"
) -> None:
    """Refuse ``n`` items some of which lack the references a judge that reads them needs, before any
    judging: one line naming the judge's setting, the first such item and ``fix`` (what to pass, in the
    caller's terms: ``references=``, ``reference_column=``, ``items[i].references``...); ``first`` names
    an item from its index ``i`` (``"row {i}"``, ``"items[{i}].references"``).

    Raises:
        MissingReferences: a judge that reads references and an item without any.
    """
    if not needs.reads_references or n == 0:
        return
    missing = items_without_references(references, n)
    if missing:
        raise MissingReferences(
            f"this judge reads references ({needs.setting}) but {len(missing)} of {n} have none (first: "
            f"{first.format(i=missing[0])}); {fix}, or calibrate a judge that reads none ({needs.alternative})"
        )


@dataclass
class Comparison:
    """What :meth:`CalibratedJudge.compare` returns for N pairs.

    Attributes:
        p: (N,) calibrated P(a better than b); NaN where the judgement failed.
        logit: (N,) the judge's raw logit (positive: a preferred); NaN where it failed.
        status: N statuses (``ok`` and ``truncated`` are valid judgements).
        forward: (N,) the logit of the (a, b) order alone; ``reverse`` that of (b, a), when the judge
            scored both orders (position debiasing), else None.
    """

    p: np.ndarray
    logit: np.ndarray
    status: list[str]
    forward: np.ndarray
    reverse: np.ndarray | None = None

    @property
    def valid(self) -> np.ndarray:
        """(N,) bool: the items judged (status ``ok`` or ``truncated``)."""
        return np.array([s in VALID_STATUSES for s in self.status], dtype=bool)

    def position_bias(self) -> float:
        """Mean ``s(a,b) + s(b,a)`` over valid items (0: order-invariant; positive: the first shown wins);
        NaN when only one order was scored."""
        if self.reverse is None:
            return float("nan")
        ok = self.valid & np.isfinite(self.forward) & np.isfinite(self.reverse)
        return float(np.mean(self.forward[ok] + self.reverse[ok])) if ok.any() else float("nan")


def is_pairwise(judge: Judge) -> bool:
    """Whether ``judge`` sees both summaries at once (and can favour a position); a pointwise judge values
    each summary alone, so one order says everything."""
    base = getattr(judge, "base", judge)  # a styled judge is as pairwise as its base
    return not isinstance(base, PointwiseJudge)


@dataclass
class CalibratedJudge:
    """A judge (built from ``config``) and its fitted ``calibrator``; ``card`` says what it was fit on and
    how it did on held-out pairs. Build one with :meth:`from_pretrained`, or from parts."""

    config: JudgeConfig
    calibrator: Calibrator
    card: dict[str, Any] = field(default_factory=dict)
    judge: Judge | None = None

    def __post_init__(self) -> None:
        if self.judge is None:
            self.judge = build_judge(self.config)
        check_served(self.judge, self.card)
        self.calls = 0  # compare() calls: a batched caller makes one per batch

    @property
    def method(self) -> str:
        """The calibration method (``raw`` is p = sigmoid(logit))."""
        return self.calibrator.method

    @property
    def pairwise(self) -> bool:
        assert self.judge is not None
        return is_pairwise(self.judge)

    @property
    def needs(self) -> JudgeNeeds:
        """What each call must carry (:class:`~judgeloop.judges.JudgeNeeds`), from the judge's config."""
        return judge_needs(self.config)

    @property
    def reads_references(self) -> bool:
        """Whether :meth:`compare` needs every item's ``references``."""
        return self.needs.reads_references

    @property
    def debiases(self) -> bool:
        """Whether :meth:`compare` scores both orders of every pair (position debiasing)."""
        assert self.judge is not None
        return bool(self.judge.position_debias)

    def compare(self, prompts: Texts, a: Texts, b: Texts, references: References = None) -> Comparison:
        """Calibrated P(``a[i]`` better than ``b[i]``) for the source text ``prompts[i]`` (the article the
        summaries are of), in one batched judge call; both orders when the judge debiases.

        Raises:
            ValueError: the three lists (and ``references``, when given) differ in length.
            MissingReferences: the judge reads references (:attr:`needs`) and an item has none.
        """
        assert self.judge is not None
        check_references(
            self.needs,
            references,
            len(prompts),
            "pass references= to compare, one list of reference summaries per item",
        )
        self.calls += 1
        out = self.judge(list(prompts), list(a), list(b), references)
        # a failed judgement's row stays zero: its logit is NaN and its probability NaN whatever the features
        features = features_for(self.calibrator, prompts, a, b, valid=out.valid)
        logit = np.where(out.valid, out.scores, np.nan)
        p = self.calibrator.predict_proba(logit, features)
        return Comparison(p=p, logit=logit, status=list(out.status), forward=out.forward, reverse=out.reverse)

    # --- the folder ----------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write the folder :meth:`from_pretrained` reads, atomically (a half-written one never appears)."""
        card = {
            **self.card,
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "judgeloop_version": __version__,
            "method": self.method,
            "feature_names": list(FEATURE_NAMES) if self.calibrator.uses_features else [],
            "needs": self.needs.as_dict(),
        }
        if hasattr(self.judge, "describe"):  # a served judge: the model, server and route it was fit on
            card["served"] = self.judge.describe()
        with atomic_dir(path) as tmp:
            atomic_write_text(tmp / "judge.yaml", to_yaml(self.config))
            atomic_write_json(tmp / "calibrator.json", self.calibrator.state_dict())
            atomic_write_json(tmp / CARD_FILE, card)
            atomic_write_text(tmp / "README.md", model_card(card, self.config))

    @classmethod
    def from_pretrained(cls, path: str | Path, overrides: Sequence[str] = ()) -> CalibratedJudge:
        """Load a saved calibrated judge; ``overrides`` change judge settings that do not change its
        judgements' meaning, e.g. ``["device=cuda", "batch_size=32", "model=/local/copy"]``.

        Raises:
            ConfigError: one line naming the file and the fix: not a calibrated judge folder, another
                format version, a truncated or invalid ``calibrated_judge.json`` / ``calibrator.json``, a
                calibrator parameter that is missing, of the wrong kind or not finite, a method that does
                not match its parameters (or the card's), a model that cannot be found here, a changed
                setting the calibrator depends on. Every file is checked before the judge is built.
        """
        config, calibrator, card = cls._read_folder(path, overrides)
        return cls(config=config, calibrator=calibrator, card=card)

    @classmethod
    def needs_of(cls, path: str | Path, overrides: Sequence[str] = ()) -> JudgeNeeds:
        """What the saved judge at ``path`` reads per call, with every check of :meth:`from_pretrained`
        but no model loaded: cheap, so a command checks its data against it before any heavy work.

        Raises:
            ConfigError: as :meth:`from_pretrained`.
        """
        return judge_needs(cls._read_folder(path, overrides)[0])

    @staticmethod
    def _read_folder(
        path: str | Path, overrides: Sequence[str]
    ) -> tuple[JudgeConfig, Calibrator, dict[str, Any]]:
        """The folder's judge config, calibrator and card, each file checked (no model loads)."""
        from judgeloop.devices import resolve_device
        from judgeloop.models import check_model

        folder = Path(path)
        card_path = folder / CARD_FILE
        if not card_path.is_file():
            raise ConfigError(
                f"{folder} is not a calibrated judge (no {CARD_FILE}); pass a folder written by judgeloop "
                "calibrate (OUTPUT_DIR/calibrated_judge/<method>) or by CalibratedJudge.save_pretrained"
            )
        again = "calibrate again (judgeloop calibrate) or restore the folder"
        try:
            card = read_json(card_path, "calibrated judge card", again)
        except DataError as err:
            raise ConfigError(str(err)) from None
        if card.get("format") != FORMAT or card.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{card_path}: format {card.get('format')!r} version {card.get('format_version')!r} (written by "
                f"judgeloop {card.get('judgeloop_version')}); judgeloop {__version__} reads {FORMAT!r} version "
                f"{FORMAT_VERSION}: install the judgeloop that wrote it, or calibrate again with this one"
            )
        for name in ("judge.yaml", "calibrator.json"):
            if not (folder / name).is_file():
                raise ConfigError(f"{folder / name} is missing; the folder is incomplete: calibrate again")
        cal_path = folder / "calibrator.json"
        try:
            calibrator = calibrator_from_state(read_json(cal_path, "calibrator file", again))
        except DataError as err:
            raise ConfigError(str(err)) from None
        except CalibrationError as err:
            raise ConfigError(f"calibrator file {cal_path}: {err}; {again}") from None
        if not calibrator.n_fit_:
            raise ConfigError(
                f"calibrator file {cal_path}: 'n_fit_' is 0, the calibrator was never fitted; {again}"
            )
        if card.get("method", calibrator.method) != calibrator.method:
            raise ConfigError(
                f"{card_path} says method {card.get('method')!r} but {cal_path} holds a {calibrator.method!r} "
                f"calibrator; the folder is mixed up: {again}"
            )
        if not all(isinstance(card.get(k, {}), dict) for k in ("fit", "held_out", "held_out_raw")):
            raise ConfigError(f"{card_path}: 'fit', 'held_out' and 'held_out_raw' must be objects; {again}")
        changed = [o.split("=", 1)[0] for o in overrides if o.split("=", 1)[0] in MEANING_KEYS]
        if changed:
            raise ConfigError(
                f"overrides change {changed} of {folder / 'judge.yaml'}: the calibrator was fit to the judge as "
                "saved; calibrate the changed judge instead"
            )
        config = load_config(JudgeConfig, folder / "judge.yaml", overrides)
        from judgeloop.judges import models_of

        for key, model, device in models_of(config):
            try:
                resolve_device(device, key.removesuffix(".model") + ".device")
                check_model(model, key)
            except ValueError as err:
                raise ConfigError(
                    f"{folder / 'judge.yaml'}: {err}; or load it with overrides=['model=LOCAL_DIR']"
                ) from None
        return config, calibrator, card


def check_served(judge: Judge, card: dict[str, Any]) -> None:
    """A served judge loaded from a folder must reach the model and verdict token ids it was fit on.

    Raises:
        ConfigError: one line naming the saved and the present model (or token ids).
    """
    saved = card.get("served")
    if not saved or not hasattr(judge, "describe"):
        return
    now = judge.describe()
    if saved.get("model") != now.get("model"):
        raise ConfigError(
            f"this served judge was calibrated on model {saved.get('model')!r} but the server serves "
            f"{now.get('model')!r}; point judge.server.base_url at a server of {saved.get('model')!r} or calibrate again"
        )
    if saved.get("verdict_token_ids") != now.get("verdict_token_ids"):
        raise ConfigError(
            f"this served judge was calibrated with verdict token ids {saved.get('verdict_token_ids')} but "
            f"judge.model's tokenizer gives {now.get('verdict_token_ids')}; use the served model's own tokenizer"
        )


# judge settings whose change changes what the logit means (so the fitted calibrator no longer applies)
MEANING_KEYS = (
    "type",
    "prompt",
    "position_debias",
    "embedding_target",
    "scale",
    "verdict_tokens",
    "style_weight",
    "style_feature",
    "signal",
    "panel",
    "server.model",
    "server.route",
    "extractor",
)


LABEL_NAMES = {
    "rouge": "ROUGE-L labels (the summary closer to the references wins)",
    "human": "human judgements",
}
METRIC_NAMES = (
    ("accuracy", "accuracy (higher is better)"),
    ("ece", "ECE (lower is better)"),
    ("brier", "Brier (lower is better)"),
    ("nll", "NLL (lower is better)"),
    ("auc", "AUC (higher is better)"),
)


def _labels_phrase(fit: dict[str, Any]) -> str:
    kind = fit.get("label_type")
    name = LABEL_NAMES.get(str(kind), f"`{kind}` labels" if kind else "its labels")
    if kind == "human" and fit.get("label_dimension"):
        name = f"human `{fit['label_dimension']}` judgements"
    source = ", ".join(str(fit[k]) for k in ("data_format", "data_path") if fit.get(k))
    return name + (f" ({source})" if source else "")


def _needs_lines(needs: JudgeNeeds) -> list[str]:
    if not needs.reads_references:
        return [
            f"**Each call needs** {needs.describe()}: `judge.compare(articles, summaries_a, summaries_b)`; every "
            "route of `judgeloop serve-judge` serves it."
        ]
    return [
        f"**Each call needs** {needs.describe()}: `judge.compare(articles, summaries_a, summaries_b, "
        "references=refs)` (one list per item), `JudgeReward(judge, ..., reference_column=COLUMN)`, "
        "`label-pairs` with `data.fields.references=FIELD`, and the server's `/v1/compare` and `/v1/rewards` "
        "with `references` in every item or group. The OpenRLHF and verl routes cannot carry references, so "
        "`serve-judge` serves this judge with `routes.openrlhf=false routes.verl=false`. A judge that reads "
        f"none is calibrated with `{needs.alternative}`."
    ]


def model_card(card: dict[str, Any], config: JudgeConfig) -> str:
    """The folder's ``README.md``. It opens with what a user asks first: what the judge agrees with, on how
    many held-out pairs, raw beside calibrated, and what each call must carry; then the details."""
    held = card.get("held_out", {})
    raw = card.get("held_out_raw", {})
    fit = card.get("fit", {})
    method = card["method"]
    needs = judge_needs(config)
    lines = [f"# Calibrated judge: `{config.type}` on `{config.model}`, `{method}`", ""]
    figures = [(k, name) for k, name in METRIC_NAMES if isinstance(held.get(k), float)]
    pairs = held.get("pairs")
    count = (
        f"{pairs} held-out pairs ({held.get('predictions')} predictions, both orders of each)"
        if pairs
        else (f"{held['predictions']} held-out predictions" if held.get("predictions") else "held-out pairs")
    )
    where = f" from {held['articles']} {held.get('split', 'test')} articles" if held.get("articles") else ""
    if figures:
        head = (
            f"**Agrees with** {_labels_phrase(fit)}: measured on {count}{where}, none of them used to fit it"
        )
        if isinstance(held.get("accuracy"), float):
            head += f"; it picks the labels' winner on {held['accuracy']:.1%} of them"
        lines += [head + ".", ""]
        cols = ["raw (sigmoid of the logit)", f"`{method}` (these probabilities)"] if raw else [f"`{method}`"]
        lines += [f"| held out | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
        for key, name in figures:
            row = ([f"{raw[key]:.4f}" if isinstance(raw.get(key), float) else "-"] if raw else []) + [
                f"{held[key]:.4f}"
            ]
            lines.append(f"| {name} | {' | '.join(row)} |")
        lines.append("")
    else:
        lines += [f"**Agrees with** {_labels_phrase(fit)}; no held-out figures were recorded.", ""]
    lines += [*_needs_lines(needs), ""]
    lines += [
        "Load it with `CalibratedJudge.from_pretrained(path)` (`from judgeloop import CalibratedJudge`).",
        "",
        f"- Prompt `{config.prompt}`, position debiasing {'on' if config.debias else 'off'}"
        + (f", style bias {config.style_weight} x {config.style_feature}" if config.style_weight else "")
        + ".",
    ]
    if fit:
        lines.append(
            "- Fit on " + ", ".join(f"{k}: {v}" for k, v in fit.items() if not isinstance(v, dict)) + "."
        )
    served = card.get("served")
    if served:
        extractor = served.get("extractor", "verdict")
        ids = served.get("verdict_token_ids")  # the grades' under the graded extractor, none for likelihood
        tokens = f", {'verdict' if extractor == 'verdict' else 'grade'} token ids {ids}" if ids else ""
        lines.append(
            f"- Served: model `{served.get('model')}` at `{config.server.base_url}`, route `{served.get('route')}`"
            f", extractor `{extractor}`{tokens}; the server reports version "
            f"{served.get('version', 'not reported')}, max logprobs {served.get('max_logprobs') or 'not reported'}"
            f" (top_logprobs asked: {served.get('top_logprobs')})."
        )
    if card.get("statuses"):
        lines.append(f"- Judge statuses seen: {card['statuses']}.")
    if isinstance(held.get("position_bias"), float):
        lines.append(f"- Held-out position bias (mean s(a,b) + s(b,a)): {held['position_bias']:.4f}.")
    return "\n".join([*lines, ""])


__all__ = [
    "CalibratedJudge",
    "Comparison",
    "MissingReferences",
    "check_judge_path",
    "check_references",
    "is_pairwise",
]
