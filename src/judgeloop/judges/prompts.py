"""Judge prompt templates, selected by name in config (``judge.prompt``).

A template states what a good summary is (``criteria``) and is rendered two ways:

* ``choice``: the article and two labelled summaries, asking which is better; the model's answer
  position comes right after the chat template's generation prompt (plus ``answer_prefix``);
* ``grade``: the article and one summary, asking for a grade from 1 to K (the served judge's pointwise
  ``graded`` extractor: the expected grade from the grade tokens' probabilities);
* ``summarize``: the article with an instruction to summarize it; the likelihood and reward-model
  judges read the summary as the assistant's reply to this.

``neutral`` is the default. ``extractive_bias`` and ``length_bias`` are biased *on purpose*: they
state a style preference, so experiments can check whether calibration (e.g. a feature-aware Platt
scaler) learns to discount it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a careful expert who evaluates summaries of news articles."

CHOICE_TEMPLATE = """{criteria}

Article:
{article}

Summary {label_a}:
{a}

Summary {label_b}:
{b}

Which summary is better, {label_a} or {label_b}? Answer with the single letter {label_a} or {label_b}."""

GRADE_TEMPLATE = """{criteria}

Article:
{article}

Summary:
{summary}

Rate the summary from 1 (worst) to {grades} (best). Answer with the single digit only."""

# the question a decision API (route decisions / systemone) asks after the article, which it is given as
# the state: the server renders the rest of the prompt and the answer labels itself
DECISION_TEMPLATE = """{criteria}

Summary {label_a}:
{a}

Summary {label_b}:
{b}

Which summary is better?"""

SUMMARIZE_TEMPLATE = """{criteria}

Summarize the following article.

Article:
{article}"""


@dataclass(frozen=True)
class JudgePrompt:
    """A named judge prompt.

    Attributes:
        name: the config name.
        criteria: what a good summary is; the only part that differs between templates.
        system: system message (used when the chat template accepts one).
        answer_prefix: text appended after the generation prompt, right before the verdict token.
    """

    name: str
    criteria: str
    system: str = SYSTEM
    answer_prefix: str = ""
    choice_template: str = CHOICE_TEMPLATE
    summarize_template: str = SUMMARIZE_TEMPLATE
    grade_template: str = GRADE_TEMPLATE

    def choice_text(self, article: str, a: str, b: str, labels: tuple[str, str]) -> str:
        return self.choice_template.format(
            criteria=self.criteria, article=article, a=a, b=b, label_a=labels[0], label_b=labels[1]
        )

    def decision_text(self, a: str, b: str, labels: tuple[str, str]) -> str:
        """The choice question without the article, for a server that renders its own prompt from the
        article (its state) and this question (the served judge's decision routes)."""
        return DECISION_TEMPLATE.format(
            criteria=self.criteria, a=a, b=b, label_a=labels[0], label_b=labels[1]
        )

    def grade_text(self, article: str, summary: str, grades: int) -> str:
        """The pointwise rubric prompt: one summary, a grade from 1 to ``grades`` (the served judge's
        ``graded`` extractor)."""
        return self.grade_template.format(
            criteria=self.criteria, article=article, summary=summary, grades=grades
        )

    def summarize_text(self, article: str) -> str:
        return self.summarize_template.format(criteria=self.criteria, article=article)


PROMPTS: dict[str, JudgePrompt] = {
    p.name: p
    for p in (
        JudgePrompt(
            name="neutral",
            criteria=(
                "A good summary is relevant: it keeps the most important information of the article, "
                "states only facts the article supports, and is fluent and concise."
            ),
        ),
        JudgePrompt(
            name="extractive_bias",
            criteria=(
                "The best summary copies the article's own sentences word for word. Prefer the summary "
                "that reuses the article's sentences most exactly; paraphrase is a flaw."
            ),
        ),
        JudgePrompt(
            name="length_bias",
            criteria=(
                "The best summary is the longest and most detailed one. Prefer the summary that says more "
                "and includes more details from the article; brevity is a flaw."
            ),
        ),
    )
}


def get_prompt(name: str) -> JudgePrompt:
    """The template called ``name``; raises ``ValueError`` naming the closest valid one."""
    if name not in PROMPTS:
        close = difflib.get_close_matches(name, list(PROMPTS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"judge.prompt={name!r} is not a known template{hint} (choose one of {sorted(PROMPTS)})"
        )
    return PROMPTS[name]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (instruct models do)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: Any, system: str, user: str, assistant: str | None = None, marker: str = "Answer:"
) -> str:
    """Render one exchange as text.

    With a chat template: system + user messages, then either the generation prompt
    (``assistant is None``) or the assistant reply. A template that refuses a system role gets the
    system text folded into the user message. Without a chat template: plain text ending in
    ``marker`` (verdict tokens then usually need a leading space, e.g. ``" A"``).
    """
    if has_chat_template(tokenizer):
        for messages in (
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            [{"role": "user", "content": f"{system}\n\n{user}"}],
        ):
            if assistant is not None:
                messages = [*messages, {"role": "assistant", "content": assistant}]
            try:
                return tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=assistant is None
                )
            except Exception as err:  # e.g. jinja "System role not supported"
                last = err
        raise ValueError(f"the tokenizer's chat template cannot render a judge prompt: {last}") from last
    text = f"{system}\n\n{user}\n\n{marker}"
    return text if assistant is None else f"{text}\n{assistant}"


def render_choice(
    tokenizer: Any, prompt: JudgePrompt, article: str, a: str, b: str, labels: tuple[str, str]
) -> str:
    """The full pairwise judge prompt for one order, up to the answer position: what the in-process
    ``choice`` judge and the served verdict judge both read the verdict tokens after."""
    return (
        render_chat(tokenizer, prompt.system, prompt.choice_text(article, a, b, labels))
        + prompt.answer_prefix
    )
