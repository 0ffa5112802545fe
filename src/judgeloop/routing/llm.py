"""The language-model side of routing: a probe (provisional answer + confidence) and a RAG answer.

The routed model is a :class:`TextGenerator`: :class:`LocalLM` (an in-process Hugging Face model, greedy
batches) or :class:`ServedLM` (a model behind an OpenAI-compatible server: vLLM, llama.cpp, a hosted API,
through :class:`~judgeloop.judges.served_client.ChatClient`); :class:`CachedLM` keeps either's generations
on disk. Both send the same single-turn user message; the in-process one applies its tokenizer's chat
template, the server its own.

Two confidence kinds:

* ``"logit"``: the length-normalized probability of the greedy answer, ``exp(mean_t log p(y_t | y_<t, x))``
  over the answer tokens (the first line of the generation, before EOS);
* ``"verbalized"``: the model is asked for JSON ``{"answer": ..., "confidence": 0..1}``; a reply that
  does not parse, or whose confidence is missing or outside [0, 1], yields NaN, and NaN routes to
  retrieval (counted in the report, never scored as confident).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

ConfidenceKind = Literal["logit", "verbalized"]

SHORT_ANSWER = "Answer the question with a short phrase only, no explanation."
YES_NO_MAYBE = "Answer the question with one word: yes, no or maybe."
# The answer step's reader: a span, with one worked example (SmolLM2-135M otherwise answers in sentences)
EXTRACT_ANSWER = (
    "Answer with the exact words from the passages, at most five words, no sentence. "
    "Example: Question: Who wrote Hamlet? Answer: William Shakespeare"
)
PROBE_LOGIT = "{instruction}\nQuestion: {question}"
PROBE_VERBAL = (
    "{instruction} Also say how confident you are that the answer is correct, as a number between 0 and 1. "
    'Reply with JSON only, like {{"answer": "Paris", "confidence": 0.8}}.\nQuestion: {question}'
)
RAG = "Use the passages. {instruction}\n{passages}\nQuestion: {question}"
ANSWERABLE = (
    "Do the passages contain the answer to the question? Reply with one word: yes or no.\n{passages}\n"
    "Question: {question}"
)


@dataclass
class Generation:
    """One generated answer with its token counts, mean log-probability and time."""

    text: str  # the answer (first line)
    raw: str  # everything generated before EOS
    prompt_tokens: int
    new_tokens: int
    logprob_mean: float  # mean log-probability of the answer tokens (NaN if none)
    seconds: float  # wall time of the batch divided by its size


def chat_prompt(tokenizer: Any, text: str) -> str:
    """The chat-formatted prompt of one question (with passages when given)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 16,
    batch_size: int = 8,
    desc: str = "generate",
) -> list[Generation]:
    """Greedy generation for chat ``prompts`` with per-token log-probabilities (left-padded batches)."""
    import torch
    from tqdm.auto import tqdm

    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    out: list[Generation] = []
    model.eval()
    for start in tqdm(
        range(0, len(prompts), batch_size), desc=desc, unit="batch", disable=len(prompts) <= batch_size
    ):
        batch = [chat_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            res = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
            )
            # (B, T_new) log p of each chosen token under the (unprocessed) distribution
            logp = model.compute_transition_scores(res.sequences, res.scores, normalize_logits=True)
        seconds = (time.perf_counter() - t0) / len(batch)
        new = res.sequences[:, enc["input_ids"].shape[1] :]  # (B, T_new)
        for i in range(len(batch)):
            ids = new[i].tolist()
            n_new = ids.index(eos) if eos in ids else len(ids)
            # answer tokens: up to the first one that starts a new line
            n_ans = 0
            for j in range(n_new):
                if "\n" in tokenizer.decode(ids[: j + 1], skip_special_tokens=True).lstrip("\n "):
                    break
                n_ans = j + 1
            raw = tokenizer.decode(ids[:n_new], skip_special_tokens=True)
            text = tokenizer.decode(ids[:n_ans], skip_special_tokens=True).strip()
            lp = logp[i, :n_ans].float().numpy()
            out.append(
                Generation(
                    text=text,
                    raw=raw,
                    prompt_tokens=int(enc["attention_mask"][i].sum()),
                    new_tokens=n_new,
                    logprob_mean=float(lp.mean()) if n_ans else math.nan,
                    seconds=seconds,
                )
            )
    return out


class TextGenerator(Protocol):
    """A routed model: greedy replies to single-turn user messages, with token counts and times."""

    #: what makes two generators' outputs the same (the model and where it runs): the cache's key
    identity: str

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int, desc: str = "generate", logprobs: bool = False
    ) -> list[Generation]:
        """One :class:`Generation` per user message; ``logprobs``: fill ``logprob_mean``."""
        ...


class LocalLM:
    """An in-process causal LM and its tokenizer, generating greedily in left-padded batches (:func:`generate`;
    it always has the answer's log-probabilities)."""

    def __init__(self, model: Any, tokenizer: Any, name: str, batch_size: int = 8) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.identity = f"local:{name}"

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int, desc: str = "generate", logprobs: bool = False
    ) -> list[Generation]:
        return generate(self.model, self.tokenizer, prompts, max_new_tokens, self.batch_size, desc)


class ServedLM:
    """A model behind an OpenAI-compatible server: one chat completion per message (temperature 0) through
    :class:`~judgeloop.judges.served_client.ChatClient` (its timeouts, retries, rate limits).

    Token counts are the server's (``usage``); ``seconds`` is each call's own wall time (calls run
    concurrently, so it is a per-question latency, not a share of a batch). A call that fails after its
    retries stops the run (:class:`~judgeloop.errors.ServiceFailed`, one line): a missing answer is never
    scored."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.identity = f"served:{client.root}:{client.cfg.model}"

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int, desc: str = "generate", logprobs: bool = False
    ) -> list[Generation]:
        from judgeloop.errors import ServiceFailed

        replies = self.client.complete(prompts, max_new_tokens, logprobs)
        failed = [r for r in replies if r.error]
        if failed:
            raise ServiceFailed(
                f"{self.client.cfg.SECTION}: {len(failed)} of {len(replies)} calls ({desc}) to "
                f"{self.client.cfg.base_url} failed after their retries; first: {' '.join(failed[0].error.split())}"
            )
        out = []
        for r in replies:
            text = r.text.lstrip("\n ").split("\n")[0].strip()
            lp = math.nan
            if r.token_logprobs:
                # the answer's tokens: up to the first one that starts a new line (as :func:`generate`)
                seen, kept = "", []
                for tok, value in r.token_logprobs:
                    seen += tok
                    if "\n" in seen.lstrip("\n "):
                        break
                    kept.append(value)
                lp = float(np.mean(kept)) if kept else math.nan
            out.append(
                Generation(
                    text=text,
                    raw=r.text,
                    prompt_tokens=r.prompt_tokens if r.prompt_tokens is not None else -1,
                    new_tokens=r.completion_tokens if r.completion_tokens is not None else -1,
                    logprob_mean=lp,
                    seconds=r.seconds,
                )
            )
        return out


class CachedLM:
    """A :class:`TextGenerator` whose generations are kept in ``folder`` (one JSON file per call, keyed by
    the generator's ``identity``, the settings and every prompt's text): greedy decoding gives the same
    replies to the same prompts, so a rerun that changes only the router's settings generates nothing.
    The times kept are those of the run that generated."""

    def __init__(self, lm: TextGenerator, folder: Path) -> None:
        self.lm, self.folder = lm, Path(folder)
        self.identity = lm.identity

    def generate(
        self, prompts: Sequence[str], max_new_tokens: int, desc: str = "generate", logprobs: bool = False
    ) -> list[Generation]:
        from judgeloop.hashing import json_digest, texts_digest
        from judgeloop.io import atomic_write_json
        from judgeloop.logging import get_logger

        key = json_digest([self.identity, max_new_tokens, logprobs, texts_digest(prompts)])
        path = self.folder / f"route-{key}.json"
        if path.is_file():
            get_logger(__name__).info("reusing %d generations (%s) from %s", len(prompts), desc, path)
            rows = json.loads(path.read_text())
            return [Generation(**{**r, "logprob_mean": _nan(r["logprob_mean"])}) for r in rows]
        gens = self.lm.generate(prompts, max_new_tokens, desc, logprobs)
        atomic_write_json(
            path,
            [
                {**asdict(g), "logprob_mean": None if math.isnan(g.logprob_mean) else g.logprob_mean}
                for g in gens
            ],
        )
        return gens


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


_JSON = re.compile(r"\{.*?\}", re.S)


def parse_verbalized(raw: str) -> tuple[str, float]:
    """``(answer, confidence)`` from a JSON reply; confidence NaN when unparseable/missing/out of range.

    Accepts confidences written as 0..1 or as percentages (``"80%"``, ``80``).
    """
    m = _JSON.search(raw)
    if m is None:
        return raw.strip().split("\n")[0], math.nan
    try:
        obj = json.loads(m.group(0))
    except json.JSONDecodeError:
        return raw.strip().split("\n")[0], math.nan
    if not isinstance(obj, dict):
        return raw.strip(), math.nan
    answer = str(obj.get("answer", "")).strip()
    c = obj.get("confidence")
    if isinstance(c, str):
        c = c.strip().rstrip("%")
        try:
            c = float(c)
        except ValueError:
            return answer, math.nan
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c):
        return answer, math.nan
    c = float(c)
    if 1.0 < c <= 100.0:
        c /= 100.0
    return answer, (c if 0.0 <= c <= 1.0 else math.nan)


def probe(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    kind: ConfidenceKind = "logit",
    max_new_tokens: int = 16,
    batch_size: int = 8,
    instruction: str = SHORT_ANSWER,
) -> tuple[list[str], np.ndarray, list[Generation]]:
    """Closed-book answers and confidences ``(Q,)`` (NaN = none) of an in-process model
    (:func:`probe_with` a :class:`LocalLM`)."""
    lm = LocalLM(model, tokenizer, getattr(model, "name_or_path", "model"), batch_size)
    return probe_with(lm, questions, kind, max_new_tokens, instruction)


def probe_with(
    lm: TextGenerator,
    questions: Sequence[str],
    kind: ConfidenceKind = "logit",
    max_new_tokens: int = 16,
    instruction: str = SHORT_ANSWER,
) -> tuple[list[str], np.ndarray, list[Generation]]:
    """Closed-book answers and confidences ``(Q,)`` (NaN = none) of the routed model ``lm``."""
    template = PROBE_LOGIT if kind == "logit" else PROBE_VERBAL
    prompts = [template.format(instruction=instruction, question=q) for q in questions]
    gens = lm.generate(prompts, max_new_tokens, desc="probe", logprobs=kind == "logit")
    answers, conf = [], np.full(len(gens), math.nan)
    for i, g in enumerate(gens):
        if kind == "logit":
            answers.append(g.text)
            conf[i] = math.exp(g.logprob_mean) if math.isfinite(g.logprob_mean) else math.nan
        else:
            a, c = parse_verbalized(g.raw)
            answers.append(a)
            conf[i] = c
    return answers, conf, gens


def render_passages(passages: Sequence[str]) -> str:
    """The passages block of a prompt: ``Passage 1: ...`` one per line."""
    return "\n".join(f"Passage {j + 1}: {p}" for j, p in enumerate(passages))


def answerable_probability(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    passages: Sequence[Sequence[str]],
    batch_size: int = 8,
) -> np.ndarray:
    """``(Q,)`` the reader's P(yes) / (P(yes) + P(no)) that its passages answer each question, read from the
    first token of the reply (``yes`` / ``Yes`` against ``no`` / ``No``): one forward pass, no generation."""
    import torch

    from judgeloop.models.scoring import next_token_logprobs

    prompts = [
        chat_prompt(tokenizer, ANSWERABLE.format(passages=render_passages(ps), question=q))
        for q, ps in zip(questions, passages)
    ]
    if not prompts:
        return np.zeros(0)

    def first_ids(words: Sequence[str]) -> list[int]:
        return sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words})

    yes, no = first_ids(["yes", "Yes"]), first_ids(["no", "No"])
    logp = next_token_logprobs(model, tokenizer, prompts, batch_size)  # (Q, V)
    p_yes = torch.logsumexp(logp[:, yes], dim=1)
    p_no = torch.logsumexp(logp[:, no], dim=1)
    return torch.sigmoid(p_yes - p_no).numpy().astype(np.float64)


def answer_with_passages(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    passages: Sequence[Sequence[str]],
    max_new_tokens: int = 16,
    batch_size: int = 8,
    instruction: str = SHORT_ANSWER,
) -> tuple[list[str], list[Generation]]:
    """Greedy answers to ``questions`` given their retrieved passages (the RAG arm) by an in-process model
    (:func:`answer_with` a :class:`LocalLM`)."""
    lm = LocalLM(model, tokenizer, getattr(model, "name_or_path", "model"), batch_size)
    return answer_with(lm, questions, passages, max_new_tokens, instruction)


def answer_with(
    lm: TextGenerator,
    questions: Sequence[str],
    passages: Sequence[Sequence[str]],
    max_new_tokens: int = 16,
    instruction: str = SHORT_ANSWER,
    logprobs: bool = False,
) -> tuple[list[str], list[Generation]]:
    """Greedy answers of the routed model ``lm`` to ``questions`` given their retrieved passages."""
    prompts = [
        RAG.format(instruction=instruction, question=q, passages=render_passages(ps))
        for q, ps in zip(questions, passages)
    ]
    gens = lm.generate(prompts, max_new_tokens, desc="answer with passages", logprobs=logprobs)
    return [g.text for g in gens], gens


def strip_answer_label(text: str) -> str:
    """The answer without a leading ``Answer:`` label (the worked example's format, which models copy)."""
    t = text.strip()
    return t[len("answer:") :].strip() if t.lower().startswith("answer:") else t
