"""The language-model side of routing: a probe (provisional answer + confidence) and a RAG answer.

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
from dataclasses import dataclass
from typing import Any, Literal

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
    """Closed-book answers and confidences ``(Q,)`` (NaN = none)."""
    template = PROBE_LOGIT if kind == "logit" else PROBE_VERBAL
    prompts = [template.format(instruction=instruction, question=q) for q in questions]
    gens = generate(model, tokenizer, prompts, max_new_tokens, batch_size, desc="probe")
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
    """Greedy answers to ``questions`` given their retrieved passages (the RAG arm)."""
    prompts = [
        RAG.format(
            instruction=instruction,
            question=q,
            passages=render_passages(ps),
        )
        for q, ps in zip(questions, passages)
    ]
    gens = generate(model, tokenizer, prompts, max_new_tokens, batch_size, desc="answer with passages")
    return [g.text for g in gens], gens


def strip_answer_label(text: str) -> str:
    """The answer without a leading ``Answer:`` label (the worked example's format, which models copy)."""
    t = text.strip()
    return t[len("answer:") :].strip() if t.lower().startswith("answer:") else t
