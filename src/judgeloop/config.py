"""Typed, nested dataclass configs loaded from YAML with dotted command-line overrides.

Every command has one dataclass schema. ``load_config(Schema, path, ["judge.scale=10"])`` reads the
YAML file, applies the overrides, and builds the schema recursively, checking every key and type:

* an unknown or misspelled key raises :class:`ConfigError` naming it and the closest valid key
  (a silently dropped ``kl_coef`` costs GPU-days);
* a value of the wrong type raises :class:`ConfigError` naming the key, the value and the type;
* every number must be finite (NaN never; infinity only in a field marked :func:`infinite_ok`) and
  every integer must fit in 64 bits;
* a number must lie in the range its field declares, once, with :func:`bounded`
  (``max_steps: int = bounded(20, ge=1)``), all before the command does any work; the same checks run
  on a config built in Python, through :func:`check_fields`, which each schema's ``__post_init__`` calls;
* a ``Literal[...]`` field takes one of its choices;
* dataclasses check what depends on several keys in ``__post_init__`` (raise ``ValueError``); a bound that
  depends on another key is :func:`check_at_least` / :func:`check_range` there.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``X | None``,
``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any`` and nested dataclasses.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import numbers
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from judgeloop.errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A config file or override does not match the command's schema."""


# a range: (low, high, interval as in check_range, hint); None for an open end
Range = tuple[float | None, float | None, str, str]

INT64 = (-(2**63), 2**63 - 1)

# the longest wait a setting in seconds or milliseconds may ask for: past it a value is a typo (1e300
# would overflow the waits it reaches: threading, asyncio and socket timeouts raise OverflowError)
WEEK_S = 7 * 24 * 3600


def infinite_ok(default: float, **kwargs: Any) -> Any:
    """A float field for which infinity means something (``x: float = infinite_ok(math.inf)``): the
    loader accepts ``inf`` / ``-inf`` there; NaN stays an error (with a range: ``bounded(..., infinite=True)``)."""
    return dataclasses.field(default=default, metadata={"infinite_ok": True}, **kwargs)


@dataclasses.dataclass(frozen=True)
class Bound:
    """The declared range of one numeric setting, read by the loader and by :func:`check_fields` alike
    (:func:`bounded` makes the field that carries it).

    ``low`` / ``high``: the ends (``None``: open); ``interval``: which ends belong to it, as in maths
    (``"[)"``: ``low`` in, ``high`` out); ``hint``: appended to the message as written (``" (0 = off)"``,
    ``"; e.g. 0.2"``). ``shape``: the message's form, one of the two judgeloop has always given:
    ``"key"``, the loader's ``config key 'SECTION.NAME'=VALUE must be ...`` (a ``ConfigError``), or
    ``"section"``, ``SECTION.NAME=VALUE must be ...`` (a ``ValueError``, which the loader prefixes with
    ``invalid config for 'SECTION': ``). ``message``: a message of the field's own, a format string with
    ``{key}`` and ``{value}`` (raised as a section-shape one), for a bound whose words say more.
    """

    low: float | None = None
    high: float | None = None
    interval: str = "[]"
    hint: str = ""
    shape: Literal["key", "section"] = "key"
    message: str | None = None

    @property
    def range(self) -> Range:
        return (self.low, self.high, self.interval, self.hint)


# a bound that admits every finite number, for a field where any sign means something (a style weight, a
# logit offset): ``bounded(0.0, ANY_FINITE)`` says the field is checked on purpose, not forgotten
ANY_FINITE = Bound(None, None, "()")

# the range of every wait in seconds / milliseconds (``bounded(30.0, WAIT_S)``): past a week a value is a typo
WAIT_S = Bound(0, WEEK_S, "[]", " (seconds; at most a week)")
WAIT_MS = Bound(0, WEEK_S * 1000, "[]", " (milliseconds; at most a week)")


def bounded(
    default: Any = dataclasses.MISSING,
    *also: Bound,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    hint: str = "",
    shape: Literal["key", "section"] = "key",
    message: str | None = None,
    infinite: bool = False,
    **kwargs: Any,
) -> Any:
    """A numeric field with its range declared once (``max_steps: int = bounded(100, ge=0)``), checked
    by the loader for a value a config sets and by :func:`check_fields` for every value of a config built
    in Python: the one place a number's bounds are written.

    Args:
        default: the field's default (or pass ``default_factory=``).
        also: more bounds, checked after the one the keywords give (a shared one such as :data:`WAIT_S`,
            whose message names the unit, beside the field's own ``gt=0``).
        ge, gt: the lower end, included (``>=``) or not (``>``); le, lt: the upper end likewise.
        hint: appended to the message as written: what the value means or how to fix it.
        shape, message: the message's form (see :class:`Bound`).
        infinite: ``inf`` is a setting here ("no limit", :func:`infinite_ok`); it passes the upper end.
        kwargs: passed on to :func:`dataclasses.field`.
    """
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("bounded: give one lower end (ge or gt) and one upper end (le or lt)")
    interval = ("(" if gt is not None else "[") + (")" if lt is not None else "]")
    own = Bound(ge if gt is None else gt, le if lt is None else lt, interval, hint, shape, message)
    bounds = ((own,) if (ge, gt, le, lt) != (None,) * 4 else ()) + also
    metadata = {"bounds": bounds, **({"infinite_ok": True} if infinite else {})}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _bounds_of(cls: type, name: str) -> tuple[Bound, ...]:
    """The field's declared bounds (:func:`bounded`), in the order they are checked."""
    f = cls.__dataclass_fields__.get(name)  # type: ignore[attr-defined]
    return f.metadata.get("bounds", ()) if f is not None else ()


def _admits(cls: type, name: str, value: float) -> bool:
    """Whether every bound of the field admits ``value`` (a field with none admits every number)."""
    return all(_in_range(value, b.range) for b in _bounds_of(cls, name))


def _in_range(value: float, rng: Range) -> bool:
    low, high, interval, _ = rng
    above = low is None or ((low <= value) if interval[0] == "[" else (low < value))
    below = high is None or ((value <= high) if interval[-1] == "]" else (value < high))
    return above and below


def _range_text(rng: Range) -> str:
    low, high, interval, _ = rng
    if low is None and high is None:
        return "a finite number"
    if high is None:
        return f"{'>=' if interval[0] == '[' else '>'} {_bound(low or 0)}"
    if low is None:
        return f"{'<=' if interval[-1] == ']' else '<'} {_bound(high)}"
    return f"in {interval[0]}{_bound(low)}, {_bound(high)}{interval[-1]}"


def _check_ranges(cls: type, values: Mapping[str, Any], prefix: str, before: bool = False) -> None:
    """Each number in ``values`` lies in its field's range (:func:`bounded`); ``inf``, where the field is
    marked :func:`infinite_ok`, means "no limit" and passes the range's upper end (``-inf`` is checked like
    any value: a timeout of -inf is still refused). ``before``: only the key-shape bounds the fields
    declare (the loader checks these before the schema's ``__post_init__``; the section-shape ones are
    its :func:`check_fields`'s, named as the schema names them, and checked again here after it).

    Raises:
        ConfigError: a key-shape bound; ValueError: a section-shape one (see :class:`Bound`).
    """
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        f = fields.get(name)
        if f is None:
            continue
        if f.metadata.get("infinite_ok") and value == math.inf:
            continue
        for bound in _bounds_of(cls, name):
            if before and (bound.shape != "key" or bound.message is not None):
                break  # checked in order: a later key-shape bound waits for the section-shape one
            if not _in_range(value, bound.range):
                must = f"must be {_range_text(bound.range)}{bound.hint}"
                if bound.message is not None:
                    raise ValueError(bound.message.format(key=f"{prefix}{name}", value=value))
                if bound.shape == "section":
                    raise ValueError(f"{prefix}{name}={value} {must}")
                raise ConfigError(f"config key '{prefix}{name}'={value} {must}")


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)  # 0.0 -> "0", 0.5 -> "0.5"


def _value(section: str, cfg: Any, name: str) -> tuple[str, Any]:
    return (f"{section}.{name}" if section else name), getattr(cfg, name)


def field_order(*names: str) -> Callable[[type[T]], type[T]]:
    """Class decorator, above ``@dataclass``: a schema that extends a shared base lists its keys in
    ``names``'s order instead of the base's keys first.

    ``dataclasses.fields`` and the ``repr`` follow it, hence the loader's key list, :func:`to_yaml`,
    ``--print-config`` and a run's saved ``config.yaml``; ``__init__`` keeps the inherited order, so build
    such a schema by keyword (as the loader does). ``names`` must be exactly the schema's fields.
    """

    def wrap(cls: type[T]) -> type[T]:
        every: dict[str, dataclasses.Field] = cls.__dataclass_fields__  # type: ignore[attr-defined]
        fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if sorted(names) != sorted(fields):
            raise TypeError(
                f"{cls.__name__}: field_order names {sorted(names)}, the fields are {sorted(fields)}"
            )
        # the ClassVar entries (RENAMED, RETIRED, ...) stay, after the fields
        cls.__dataclass_fields__ = {  # type: ignore[attr-defined]
            **{name: every[name] for name in names},
            **{name: f for name, f in every.items() if name not in names},
        }

        def __repr__(self: Any) -> str:  # as dataclass writes it, in the new order
            shown = (f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
            return f"{type(self).__qualname__}({', '.join(shown)})"

        cls.__repr__ = __repr__  # type: ignore[method-assign]
        return cls

    return wrap


def check_at_least(
    section: str,
    cfg: Any,
    name: str,
    bound: float,
    hint: str = "",
    *,
    strict: bool = False,
    optional: bool = False,
) -> None:
    """The bound check of a ``__post_init__``: ``cfg.<name>`` must be ``>= bound`` (``> bound`` if ``strict``).

    Raises ``ValueError("SECTION.NAME=VALUE must be >= BOUND" + hint)``: one line naming the key and the
    value; ``hint`` is appended as written (``" (0 = off)"``, ``"; e.g. 8"``, ``" or null"``), so it says
    what the value means or how to fix it. ``section`` is the key's dotted prefix (``"train"``; ``""`` for
    a top-level key). ``optional``: ``None`` passes (a nullable field's "off" / "all").
    """
    key, value = _value(section, cfg, name)
    if optional and value is None:
        return
    if (value <= bound) if strict else (value < bound):
        raise ValueError(f"{key}={value} must be {'>' if strict else '>='} {_bound(bound)}{hint}")


def check_range(
    section: str,
    cfg: Any,
    name: str,
    low: float,
    high: float,
    interval: Literal["()", "[)", "(]", "[]"] = "()",
    hint: str = "",
    *,
    optional: bool = False,
) -> None:
    """The interval check of a ``__post_init__``: ``cfg.<name>`` must lie in ``low``..``high``.

    ``interval`` says which ends belong to it, as written in maths: ``"()"`` open (the default), ``"[)"``,
    ``"(]"``, ``"[]"`` closed. Raises ``ValueError("SECTION.NAME=VALUE must be in (LOW, HIGH)" + hint)``
    (a NaN is outside every interval); ``section``, ``hint`` and ``optional`` as in :func:`check_at_least`.
    """
    key, value = _value(section, cfg, name)
    if optional and value is None:
        return
    above = (low <= value) if interval[0] == "[" else (low < value)
    if not (above and ((value <= high) if interval[1] == "]" else (value < high))):
        raise ValueError(
            f"{key}={value} must be in {interval[0]}{_bound(low)}, {_bound(high)}{interval[1]}{hint}"
        )


def check_choices(key: str, values: Sequence[str], allowed: Iterable[str], hint: str = "") -> None:
    """Raise ``ValueError("KEY=VALUES: 'x' is not one of [...] (did you mean 'y'?)" + hint)`` when a value is
    unknown, and one line when ``values`` is empty or names one twice."""
    allowed = list(allowed)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        close = _closest(unknown[0], allowed)
        mean = f" (did you mean '{close}'?)" if close else ""
        raise ValueError(f"{key}={list(values)}: {unknown[0]!r} is not one of {allowed}{mean}{hint}")
    if not values:
        raise ValueError(f"{key} is empty; list at least one of {allowed}{hint}")
    if len(set(values)) != len(values):
        raise ValueError(f"{key}={list(values)} lists a value twice; list each once")


def check_fields(section: str, cfg: Any) -> None:
    """The loader's checks of each value, for a config built in Python (``RewardConfig(prior=inf)``), so the
    Python constructor refuses what the YAML file and the command line refuse: the type (a string is no
    number here; numpy scalars pass), NaN and infinity (except in an :func:`infinite_ok` field), integers
    past 64 bits, a ``Literal``'s choices, and the bounds each field declares (:func:`bounded`), every value
    (defaults too); a numpy scalar becomes the Python number the loader would give. Call it first in ``__post_init__``; a nested dataclass field is its own class's check.

    Raises ``ConfigError`` (a ``ValueError``) with the loader's one-line message, the key spelled
    ``SECTION.NAME`` as the command's config spells it (``section``: its dotted prefix, ``""`` at the top).
    Through the loader the values are already checked, so nothing changes there.
    """
    prefix = f"{section}." if section else ""
    hints = _hints(type(cfg))  # type: ignore[arg-type]
    numbers_set: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not f.init or dataclasses.is_dataclass(value):
            continue
        tp = _is_optional(hints[f.name])[1]
        if isinstance(value, (numbers.Integral, numbers.Real)) and not isinstance(value, (bool, int, float)):
            value = int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy's scalars
            object.__setattr__(cfg, f.name, value)  # a Python number, as the loader would give
        if tp is float and isinstance(
            value, str
        ):  # the loader reads YAML's "1e-5" as a number; Python needn't
            raise ConfigError(f"config key '{prefix}{f.name}' expects a number, got {value!r}")
        _coerce(value, hints[f.name], f"{prefix}{f.name}", bool(f.metadata.get("infinite_ok")))
        numbers_set[f.name] = value
    _check_ranges(type(cfg), numbers_set, prefix)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # once per schema: check_fields runs on every construction


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past 1.8e308
            raise ConfigError(
                f"config key '{key}'={value} is too large for a number; give a finite one"
            ) from None
    if isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"config key '{key}' expects a number, got {value!r}")


def _finite(value: float, key: str, infinite: bool) -> float:
    """NaN is never a setting; infinity only where the field says it means something."""
    if math.isnan(value) or (math.isinf(value) and not infinite):
        allowed = "a number (inf is allowed here)" if infinite else "a finite number"
        raise ConfigError(f"config key '{key}'={value} is not {allowed}; give {allowed}")
    return value


def _coerce(value: Any, tp: Any, key: str, infinite: bool = False) -> Any:
    """Check (and minimally convert) ``value`` against annotation ``tp``; ``key`` is for messages;
    ``infinite``: a float may be infinite (a field marked :func:`infinite_ok`)."""
    if tp is Any:
        return value
    optional, inner = _is_optional(tp)
    if optional:
        return None if value is None else _coerce(value, inner, key, infinite)
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # type: ignore[arg-type]
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}' expects a mapping of {_type_name(tp)} fields, got {value!r}"
            )
        return _build(tp, dict(value), prefix=f"{key}.")  # type: ignore[arg-type]
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            hint = _closest(str(value), [str(a) for a in allowed])
            extra = f"; did you mean '{hint}'?" if hint else ""
            raise ConfigError(f"config key '{key}' must be one of {list(allowed)}, got {value!r}{extra}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        args = get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]", infinite) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        args = get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_tp, f"{key}.{k}", infinite) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64[0] <= value <= INT64[1]:
                raise ConfigError(
                    f"config key '{key}'={value} does not fit in 64 bits; give a smaller integer"
                )
            return value
        raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
    if tp is float:
        return _finite(_to_float(value, key), key, infinite)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a numeric run name; never a silent structure change
        raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
    raise ConfigError(f"config key '{key}' has an unsupported annotation {tp!r}")


def _build(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    retired: dict[str, str] = getattr(cls, "RETIRED", {})
    shared: dict[str, str] = getattr(cls, "SHARED_SECTIONS", {})
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        if name in shared and name not in fields:
            continue  # another command's section of a shared file: that command's schema checks it
        if name in renamed and name not in fields:
            raise ConfigError(
                f"config key '{prefix}{name}' is now '{_new_name(prefix, renamed[name])}' (one name for one idea "
                "across judgeloop's configs); rename it in your config"
            )
        if name in retired and name not in fields:
            raise ConfigError(f"config key '{prefix}{name}' is retired; {retired[name]}")
        if name not in fields:
            close = _closest(name, fields)
            hint = f"; did you mean '{prefix}{close}'?" if close else ""
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{prefix}{name}'{hint} (valid keys here: {valid})")
        infinite = bool(fields[name].metadata.get("infinite_ok"))
        kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}", infinite)
    try:
        _check_ranges(cls, kwargs, prefix, before=True)  # each value alone, before any cross-field check
        built = cls(**kwargs)
        _check_ranges(cls, kwargs, prefix)  # the rest, should a schema's __post_init__ not call check_fields
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"invalid config for '{where}': {err}") from err
    return built


def _new_name(prefix: str, target: str) -> str:
    """The full new name of a renamed key: ``target`` beside the old key, or, when it is dotted, from the
    config's root (a key that moved to another section, e.g. ``loss.reward_scheme`` -> ``rewards.scheme``)."""
    return target if "." in target else f"{prefix}{target}"


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. judge.scale=10)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _yaml_error(err: yaml.YAMLError) -> str:
    """PyYAML's error (several lines, with a caret drawing) as one line: what, and where."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}; fix the file (a truncated copy?)"


def _read_yaml(path: str | Path, allow_empty: bool = False) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass --config PATH to an existing YAML file")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_error(err)}") from None
    if data is None:
        # an empty file is more often a truncated copy or the wrong path than a wish for every default
        if not allow_empty:
            raise ConfigError(
                f"config file '{path}' is empty, so every setting would be its default; fill it in, or pass "
                "--allow-empty-config to run on the defaults"
            )
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at top level, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
    allow_empty: bool = False,
) -> T:
    """Build ``cls`` from a YAML file and ``key=value`` overrides (later wins).

    Args:
        cls: the command's dataclass schema.
        path: YAML file, or ``None`` for the schema's defaults.
        overrides: dotted overrides such as ``judge.position_debias=false``; values are parsed as YAML.
        base: a mapping applied before the file (used by commands that derive configs).
        allow_empty: accept an empty file as "all defaults" (else it is an error).

    Returns:
        A fully typed, validated instance of ``cls``.

    Raises:
        ConfigError: unknown key (with the closest valid one), wrong type, invalid value, missing file.
    """
    tree: dict[str, Any] = copy.deepcopy(dict(base or {}))  # an override never edits the caller's base
    if path is not None:
        tree.update(_read_yaml(path, allow_empty))
    for text in overrides:
        parts, value = _parse_override(text)
        _set_dotted(tree, parts, value)
    return _build(cls, tree)


# config keys that name places a command writes: a folder, or a file
OUTPUT_DIR_KEYS = ("output_dir", "cache_dir", "start_cache", "sync_dir")
OUTPUT_FILE_KEYS = ("output_path",)


def check_output_places(cfg: Any, prefix: str = "") -> None:
    """Every output folder / file the config names can be written, checked before any work.

    A folder key (``output_dir``, ``cache_dir``) must not name a file; a file key (``output_path``) must
    not name a folder; the nearest existing parent must be writable. Walks nested sections.
    """
    import os

    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_output_places(value, f"{key}.")
            continue
        if not isinstance(value, str) or not value or f.name not in OUTPUT_DIR_KEYS + OUTPUT_FILE_KEYS:
            continue
        path = Path(value)
        if f.name == "cache_dir" and value == "auto":  # the judgeloop cache, not ./auto
            from judgeloop.io import cache_dir

            path = cache_dir()
            value = f"auto ({path})"
        if f.name in OUTPUT_DIR_KEYS and path.exists() and not path.is_dir():
            raise ConfigError(f"{key}={value} is a file; point {key} at a folder")
        if f.name in OUTPUT_FILE_KEYS and path.is_dir():
            raise ConfigError(f"{key}={value} is a folder; point {key} at a file inside it")
        probe = path
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise ConfigError(f"{key}={value} cannot be created: {probe} is a file, not a folder")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(
                f"{key}={value} cannot be written ({probe} is not writable); choose another place"
            )


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of a config (for saving the resolved config next to outputs)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The config as YAML (what runs save as ``config.yaml``)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_changes(
    saved: Mapping[str, Any],
    new: Mapping[str, Any],
    ignore: Iterable[str] = (),
    prefix: str = "",
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two config dicts
    (top-level keys in ``ignore`` are skipped).

    With ``defaults`` (the schema's default config as a dict), a key the saved config lacks, because it
    was added to the schema after the save, is no change when the new value is its default: an option's
    default keeps the behaviour from before the option existed.
    """
    skip = set(ignore)
    out = []
    for k in sorted((set(saved) | set(new)) - skip):
        a, b = saved.get(k), new.get(k)
        d = defaults.get(k) if isinstance(defaults, Mapping) else None
        if k not in saved and isinstance(defaults, Mapping) and k in defaults and b == d:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_changes(a, b, (), f"{prefix}{k}.", d if isinstance(d, Mapping) else None)
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def migrate(
    cls: type, tree: Mapping[str, Any], _moved: list[tuple[list[str], Any]] | None = None
) -> dict[str, Any]:
    """A saved config dict with keys renamed since it was saved moved to their new names (each schema
    lists its renames in a ``RENAMED`` class attribute, a dotted new name counting from the config's root;
    keys in ``RETIRED`` and another command's sections, ``SHARED_SECTIONS``, are dropped), so an old run
    or checkpoint still compares."""
    root = _moved is None
    moved: list[tuple[list[str], Any]] = [] if _moved is None else _moved
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    retired: dict[str, str] = getattr(cls, "RETIRED", {})
    shared: dict[str, str] = getattr(cls, "SHARED_SECTIONS", {})
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if (key in retired or key in shared) and key not in hints:
            continue  # a retired key has no new place: the setting that replaced it compares at its default
        if key not in hints and "." in renamed.get(key, ""):
            moved.append((renamed[key].split("."), value))  # placed from the root, below
            continue
        name = renamed.get(key, key)
        tp = _is_optional(hints[name])[1] if name in hints else None
        if isinstance(value, Mapping) and tp is not None and dataclasses.is_dataclass(tp):
            value = migrate(tp, value, moved)  # type: ignore[arg-type]
        out[name] = value
    if root:
        for parts, value in moved:
            node = out
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node.setdefault(parts[-1], value)  # a value saved under the new name wins
    return out


def default_dict(cls: type) -> dict[str, Any]:
    """The schema's defaults as the plain dict a saved ``config.yaml`` reads back as (also for a schema
    whose defaults alone do not pass its checks, e.g. an empty required ``judge_path``: the defaults are
    read from its fields, not validated)."""
    try:
        return yaml.safe_load(to_yaml(cls())) or {}
    except (ValueError, TypeError):  # ConfigError is a ValueError
        inst = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                object.__setattr__(inst, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                object.__setattr__(inst, f.name, f.default_factory())
        return yaml.safe_load(to_yaml(inst)) or {}


def replace(cfg: T, overrides: Iterable[str]) -> T:
    """A copy of ``cfg`` with dotted overrides applied, re-validated through the schema."""
    tree = to_dict(cfg)
    for text in overrides:
        parts, value = _parse_override(text)
        _set_dotted(tree, parts, value)
    return _build(type(cfg), tree)
