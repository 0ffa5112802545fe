"""Deterministic train / calibration / validation / test splits by a stable hash of the article id.

The hash (SHA-256 of ``salt + id``) does not depend on file order, process, or Python's hash seed,
so an article keeps its split when the data set grows. Articles whose text is identical share the
split of the first id that carries that text, so a duplicate can never leak across splits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from judgeloop.data.summarization import SplitConfig, SummExample
from judgeloop.text import text_key

SPLITS = ("train", "calibration", "validation", "test")


class LeakageError(ValueError):
    """An article id or article text appears in two splits that must be disjoint."""


def hash_unit(key: str, salt: str = "judgeloop") -> float:
    """Map ``key`` to a stable number in [0, 1)."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(key: str, cfg: SplitConfig) -> str:
    """The split of one key by stable hash: the first split whose cumulative fraction exceeds it."""
    u = hash_unit(key, cfg.salt)
    if u < cfg.test:
        return "test"
    if u < cfg.test + cfg.calibration:
        return "calibration"
    if u < cfg.test + cfg.calibration + cfg.validation:
        return "validation"
    return "train"


def split_examples(examples: Sequence[SummExample], cfg: SplitConfig) -> dict[str, list[SummExample]]:
    """Partition ``examples`` into the four splits (some may be empty) and check they are disjoint."""
    first_id_for_text: dict[str, str] = {}
    out: dict[str, list[SummExample]] = {name: [] for name in SPLITS}
    for ex in examples:
        key = first_id_for_text.setdefault(text_key(ex.article), ex.id)
        out[assign_split(key, cfg)].append(ex)
    check_disjoint(out)
    return out


def check_disjoint(splits: Mapping[str, Sequence[SummExample]]) -> None:
    """Raise :class:`LeakageError` if any id or identical article text is in two splits."""
    owner_id: dict[str, str] = {}
    owner_text: dict[str, tuple[str, str]] = {}
    for name, items in splits.items():
        for ex in items:
            prev = owner_id.setdefault(ex.id, name)
            if prev != name:
                raise LeakageError(f"article id '{ex.id}' is in both the '{prev}' and '{name}' splits")
            key = text_key(ex.article)
            prev_text = owner_text.setdefault(key, (name, ex.id))
            if prev_text[0] != name:
                raise LeakageError(
                    f"identical article text is in both '{prev_text[0]}' (id '{prev_text[1]}') and '{name}' "
                    f"(id '{ex.id}'); de-duplicate the data or split with judgeloop.data.split_examples"
                )
