from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Literal

import pytest

from judgeloop.config import (
    WAIT_S,
    ConfigError,
    bounded,
    check_at_least,
    check_fields,
    check_range,
    field_order,
    infinite_ok,
    load_config,
    replace,
    to_dict,
)


@dataclass
class Inner:
    position_debias: bool = True
    scale: float = 1.0
    kind: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"scale must be positive, got {self.scale}")


@dataclass
class Outer:
    judge: Inner = field(default_factory=Inner)
    steps: int = 3
    name: str | None = None


def test_defaults_and_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("judge:\n  scale: 2\nsteps: 5\n")
    cfg = load_config(Outer, path, ["judge.position_debias=false", "judge.tags=[x,y]", "name=run1"])
    assert cfg.judge.scale == 2.0 and isinstance(cfg.judge.scale, float)
    assert cfg.judge.position_debias is False
    assert cfg.steps == 5 and cfg.name == "run1" and cfg.judge.tags == ["x", "y"]
    assert to_dict(cfg)["judge"]["kind"] == "a"
    assert replace(cfg, ["steps=9"]).steps == 9


def test_unknown_key_names_closest():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'judge.positon_debias'.*did you mean 'judge.position_debias'"
    ):
        load_config(Outer, None, ["judge.positon_debias=false"])
    with pytest.raises(ConfigError, match=r"unknown config key 'stepz'.*'steps'"):
        load_config(Outer, None, ["stepz=1"])


def test_wrong_types():
    with pytest.raises(ConfigError, match="'steps' expects an integer"):
        load_config(Outer, None, ["steps=abc"])
    with pytest.raises(ConfigError, match="'judge.position_debias' expects true or false"):
        load_config(Outer, None, ["judge.position_debias=3"])
    with pytest.raises(ConfigError, match=r"'judge.kind' must be one of \['a', 'b'\]"):
        load_config(Outer, None, ["judge.kind=c"])
    with pytest.raises(ConfigError, match="'judge' expects a mapping"):
        load_config(Outer, None, ["judge=5"])


def test_value_validation_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="scale must be positive"):
        load_config(Outer, None, ["judge.scale=-1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Outer, bad)
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(Outer, None, ["steps"])


def test_bound_and_interval_checks_name_the_key_the_value_and_the_fix():
    cfg = SimpleNamespace(lr=0.0, steps=0, cap=None, frac=1.0, p=0.5)
    check_at_least("train", cfg, "steps", 0)
    with pytest.raises(ValueError, match=r"^train.lr=0.0 must be > 0 \(e.g. 1e-4\)$"):
        check_at_least("train", cfg, "lr", 0, " (e.g. 1e-4)", strict=True)
    with pytest.raises(ValueError, match=r"^steps=0 must be >= 1$"):
        check_at_least("", cfg, "steps", 1)
    check_at_least("", cfg, "cap", 1, optional=True)
    check_range("", cfg, "cap", 0.0, 1.0, optional=True)
    with pytest.raises(TypeError):  # a None where None is not a setting is a bug, not a config value
        check_at_least("", cfg, "cap", 1)
    with pytest.raises(ValueError, match=r"^data.frac=1.0 must be in \(0, 1\); e.g. 0.2$"):
        check_range("data", cfg, "frac", 0.0, 1.0, hint="; e.g. 0.2")
    check_range("data", cfg, "frac", 0.0, 1.0, "(]")
    check_range("data", cfg, "frac", 0, 1, "[]")
    with pytest.raises(ValueError, match=r"^loss.p=0.5 must be in \[0, 0.5\)$"):
        check_range("loss", cfg, "p", 0, 0.5, "[)")
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        check_range("", SimpleNamespace(x=float("nan")), "x", 0.0, 1.0)
    with pytest.raises(ConfigError, match=r"invalid config for 'judge': judge.scale=0.0 must be > 0$"):
        load_config(Checked, None, ["judge.scale=0"])


@dataclass
class CheckedInner:
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_at_least("judge", self, "scale", 0, strict=True)


@dataclass
class Checked:
    judge: CheckedInner = field(default_factory=CheckedInner)


def test_every_shipped_config_loads(repo):
    """Every YAML under configs/ loads into its command's (or recipe's) schema, and every accelerate
    launch file is one accelerate reads: the one test of the shipped configs."""
    from judgeloop.cli import COMMANDS, resolve_command

    by_folder = {
        "calibrate": "calibrate",
        "feedback_loop": "ablate",
        "retriever": "train-retriever",
        "raft": "build-raft",
        "conformal": "conformal",
        "gate": "gate",
        "routing": "route",
        "agent": "agent",
        "probe": "probe-judge",
        "label_pairs": "label-pairs",
    }
    # configs of recipes that are no judgeloop command (launched with accelerate launch recipes/...)
    from judgeloop.integrations.grpo import GrpoTrlConfig

    recipe_schemas = {"grpo_trl": GrpoTrlConfig}
    files = sorted((repo / "configs").rglob("*.yaml"))
    assert files, "no configs found"
    checked = 0
    for path in files:
        rel = path.relative_to(repo / "configs")
        folder = rel.parts[0]
        if folder == "accelerate":
            import yaml

            launch = yaml.safe_load(path.read_text())
            assert launch["distributed_type"] in {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP"}, rel
            assert launch["num_processes"] >= 1 and launch["num_machines"] == 1, rel
            if launch["distributed_type"] == "DEEPSPEED":
                assert launch["deepspeed_config"]["zero_stage"] in (2, 3), rel
            continue
        if folder in recipe_schemas:
            load_config(recipe_schemas[folder], path)
            checked += 1
            continue
        command = by_folder.get(folder)
        # a folder may hold configs for several commands: a "# command: NAME" first line picks one
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        if first.startswith("# command:"):
            command = first.split(":", 1)[1].strip()
        assert command in COMMANDS, f"{rel}: no command registered for configs/{folder}"
        schema, _ = resolve_command(command)
        cfg = load_config(schema, path)
        if folder == "feedback_loop":  # one file for judgeloop train and judgeloop ablate
            assert cfg.max_steps >= 1 and load_config(resolve_command("ablate")[0], path).ablation.arms, rel
        checked += 1
    assert checked >= 1


@dataclass
class Numbers:
    miss_rate: float = bounded(0.5, ge=0, le=1)
    kl_coef: float = bounded(0.1, ge=0)
    timeout_s: float = bounded(math.inf, WAIT_S, infinite=True)
    port: int = bounded(8000, ge=0, le=65535, hint=" (0: any free port)")
    levels: list[float] = field(default_factory=lambda: [0.5])
    width: float = bounded(1.0, ge=1.0, le=4.0, hint=" (a width)")
    nan_ok: float = infinite_ok(0.0)  # a field with no bound admits every number


@dataclass
class Declared:
    """Python and the loader check one declaration alike, in both message shapes, in order."""

    steps: int = bounded(1, ge=1, shape="section")
    wait_s: float = bounded(1.0, WAIT_S, gt=0, shape="section")
    size: int = bounded(16, ge=8, message="{key}={value} is too small; use at least 8")

    def __post_init__(self) -> None:
        check_fields("loop", self)


@pytest.mark.parametrize(
    "override, loaded, built",
    [
        ("steps=0", "invalid config for 'loop': loop.steps=0 must be >= 1", "loop.steps=0 must be >= 1"),
        ("wait_s=0", "invalid config for 'loop': loop.wait_s=0.0 must be > 0", "loop.wait_s=0.0 must be > 0"),
        (
            "wait_s=1e9",
            "config key 'loop.wait_s'=1000000000.0 must be in [0, 604800] (seconds; at most a week)",
            "config key 'loop.wait_s'=1000000000.0 must be in [0, 604800] (seconds; at most a week)",
        ),
        (
            "size=4",
            "invalid config for 'loop': loop.size=4 is too small; use at least 8",
            "loop.size=4 is too small",
        ),
    ],
)
def test_one_declaration_checks_a_loaded_and_a_built_config_alike(override, loaded, built):
    with pytest.raises(ConfigError, match=re.escape(loaded) + "$"):
        load_config(Wrap, None, [f"loop.{override}"])
    key, value = override.split("=")
    with pytest.raises(ValueError, match=re.escape(built)):
        Declared(**{key: type(getattr(Declared(), key))(float(value))})


@dataclass
class Wrap:
    loop: Declared = field(default_factory=Declared)


@pytest.mark.parametrize(
    "override, message",
    [
        ("kl_coef=nan", "'kl_coef'=nan is not a finite number"),
        ("kl_coef=.inf", "'kl_coef'=inf is not a finite number"),
        ("miss_rate=-inf", "'miss_rate'=-inf is not a finite number"),
        ("levels=[0.1, nan]", "'levels[1]'=nan is not a finite number"),
        ("timeout_s=nan", "'timeout_s'=nan is not a number (inf is allowed here)"),
        ("port=99999999999999999999", "'port'=99999999999999999999 does not fit in 64 bits"),
        ("miss_rate=1e400", "'miss_rate'=inf is not a finite number"),
        ("width=" + "9" * 400, "is too large for a number"),
        ("port=70000", "'port'=70000 must be in [0, 65535] (0: any free port)"),
        ("timeout_s=1e300", "'timeout_s'=1e+300 must be in [0, 604800] (seconds; at most a week)"),
        ("timeout_s=-inf", "'timeout_s'=-inf must be in [0, 604800]"),
        ("kl_coef=-0.5", "'kl_coef'=-0.5 must be >= 0"),
        ("miss_rate=1.5", "'miss_rate'=1.5 must be in [0, 1]"),
        ("width=0.5", "'width'=0.5 must be in [1, 4] (a width)"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(Numbers, None, [override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_infinity_where_it_means_something_and_ranges_at_their_ends():
    cfg = load_config(Numbers, None, ["timeout_s=inf", "port=0", "miss_rate=1", "kl_coef=0", "width=4"])
    assert cfg.timeout_s == math.inf and cfg.port == 0 and cfg.miss_rate == 1.0 and cfg.width == 4.0
    assert load_config(Numbers, None, ["timeout_s=604800"]).timeout_s == 604800  # a week: the longest wait


@pytest.mark.parametrize(
    "command, override, key",
    [
        ("train", "loss.kl_coef=nan", "loss.kl_coef"),
        ("train", "optim.learning_rate=inf", "optim.learning_rate"),
        ("train", "optim.learning_rate=0", "optim.learning_rate"),
        ("train-retriever", "loss.tau=nan", "loss.tau"),
        ("train-retriever", "loss.tau=-1", "loss.tau"),
        ("serve-judge", "server.port=70000", "server.port"),
        ("calibrate", "seed=-1", "seed"),
    ],
)
def test_every_command_checks_its_numbers(command, override, key):
    from judgeloop.cli import resolve_command

    schema, _ = resolve_command(command)
    with pytest.raises(ConfigError, match=re.escape(key) + "'?="):
        load_config(schema, None, [override])


def _schemas() -> dict[str, type]:
    """Every schema a command or recipe loads: the CLI's commands (sft and train-retriever are also their
    recipes' schemas) and the TRL GRPO recipe's."""
    from judgeloop.cli import COMMANDS, resolve_command
    from judgeloop.integrations.grpo import GrpoTrlConfig

    return {**{name: resolve_command(name)[0] for name in COMMANDS}, "recipes/grpo_trl.py": GrpoTrlConfig}


def _numeric_fields(cls: type, prefix: str = ""):
    """(the dataclass, its field name, the dotted key) of every int / float setting under ``cls``."""
    import dataclasses
    from typing import get_type_hints

    from judgeloop.config import _is_optional

    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _is_optional(hints[f.name])[1]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
        elif f.init and tp in (int, float):
            yield cls, f.name, prefix + f.name


def test_every_numeric_setting_of_every_command_refuses_nonsense():
    """-1 and 1e300 in any number of any command's schema are refused in one line naming the key, unless
    the field's declared bounds (``bounded``) explicitly admit the value; a
    setting in seconds or milliseconds (``*_s``, ``*_ms``) never admits 1e300 (the waits it reaches raise
    OverflowError)."""
    from judgeloop.config import _admits, _bounds_of

    # the settings a schema requires, so that each number is checked on a config that otherwise loads
    required = {"judge_path": "some/judge"}
    bases = {"label-pairs": {**required, "data": {"path": "pairs.jsonl"}}, "serve-judge": required}
    bases.update({"recipes/grpo_trl.py": required, "build-raft": {"data": {"path": "questions.jsonl"}}})
    loose, unclear, waits = [], [], []
    checked = 0
    for command, schema in _schemas().items():
        base = bases.get(command)
        load_config(schema, None, base=base)  # the defaults load
        for cls, name, key in _numeric_fields(schema):
            wait = name.endswith(("_s", "_ms"))
            waits += [key] if wait else []
            for value in ("-1", "1e300"):
                checked += 1
                try:
                    load_config(schema, None, [f"{key}={value}"], base=base)
                except ConfigError as err:
                    if name not in str(err) or "\n" in str(err):
                        unclear.append(f"{command} {key}={value}: {err}")
                    continue
                if (
                    not _bounds_of(cls, name)
                    or not _admits(cls, name, float(value))
                    or (wait and value == "1e300")
                ):
                    loose.append(f"{command} {key}={value}")
    assert not loose, f"accepted without a range that admits it: {loose}"
    assert len(set(waits)) >= 6, (
        waits
    )  # the server's, the client's, the loop's and verl's timeouts are walked
    assert not unclear, f"refused without naming the setting in one line: {unclear}"
    assert checked > 400


def test_a_truncated_yaml_file_is_one_line(tmp_path):
    path = tmp_path / "cut.yaml"
    path.write_text("judge:\n  scale: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(Outer, path)
    text = str(info.value)
    assert "\n" not in text and "cut.yaml' is not valid YAML" in text and "line 3" in text, text


def test_the_grpo_recipes_policy_shares_the_loops_checks_and_rejects_the_keys_it_does_not_use():
    """``GrpoPolicyConfig`` and the loop's ``PolicyConfig`` extend one ``PolicyBase``; GRPO takes no
    ``dtype`` / ``lora_dropout`` / ``use_chat_template`` / ``sft_*`` (it would silently ignore them)."""
    from judgeloop.integrations.grpo import GrpoPolicyConfig, GrpoTrlConfig
    from judgeloop.loop.config import PolicyBase, PolicyConfig

    assert issubclass(GrpoPolicyConfig, PolicyBase) and issubclass(PolicyConfig, PolicyBase)
    for key in ("dtype", "lora_dropout", "use_chat_template", "sft_steps"):
        with pytest.raises(ConfigError, match=rf"unknown config key 'policy.{key}'"):
            load_config(GrpoTrlConfig, None, ["judge_path=x", f"policy.{key}=1"])
    with pytest.raises(ConfigError, match=r"policy.max_article_tokens=4 is too small; use at least 8"):
        load_config(GrpoTrlConfig, None, ["judge_path=x", "policy.max_article_tokens=4"])
    assert GrpoPolicyConfig().model.startswith("HuggingFaceTB/SmolLM2") and GrpoPolicyConfig().lora
    # the loop's keys keep their order (the saved config.yaml and --print-config list them so)
    assert [f.name for f in fields(PolicyConfig)] == [
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
    ]
    assert repr(PolicyConfig()).startswith(
        "PolicyConfig(model='judgeloop-tiny/causal-lm', dtype='float32', lora=False"
    )


def test_field_order_names_every_field():
    with pytest.raises(TypeError, match="field_order names"):

        @field_order("a")
        @dataclass
        class Two:
            a: int = 0
            b: int = 0


def _sections(cls: type, seen: set) -> None:
    """Every dataclass under ``cls`` (itself included) into ``seen``."""
    import dataclasses
    from typing import get_type_hints

    from judgeloop.config import _is_optional

    if cls in seen:
        return
    seen.add(cls)
    for f in dataclasses.fields(cls):
        tp = _is_optional(get_type_hints(cls)[f.name])[1]
        if dataclasses.is_dataclass(tp):
            _sections(tp, seen)


def test_a_config_built_in_python_refuses_what_its_declared_bounds_refuse():
    """Every section of every command with a declared bound calls check_fields: built in Python with a value
    just outside the bound, it raises naming the key, as the loader would."""
    import dataclasses

    seen: set = set()
    for schema in _schemas().values():
        _sections(schema, seen)
    required = {"judge_path": "some/judge"}
    checked, unchecked = 0, []
    for cls in seen:
        for f in dataclasses.fields(cls):
            bounds = f.metadata.get("bounds", ())
            if not bounds or (bounds[0].low is None and bounds[0].high is None):
                continue
            b = bounds[0]
            step = 1 if isinstance(f.default, int) or f.default is None else 0.5
            if b.low is not None:
                bad = b.low if b.interval[0] == "(" else b.low - step
            else:
                bad = b.high if b.interval[-1] == ")" else b.high + step
            base = {k: v for k, v in required.items() if k in {g.name for g in dataclasses.fields(cls)}}
            try:
                cls(**base, **{f.name: bad})
                unchecked.append(f"{cls.__name__}.{f.name}={bad}")
            except ValueError as err:
                if f.name not in str(err):
                    unchecked.append(f"{cls.__name__}.{f.name}={bad}: {err}")
            checked += 1
    assert not unchecked, unchecked
    assert checked > 200
