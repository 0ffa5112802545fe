"""Judges: the four logit extractors on tiny models, statuses, caching, position debiasing, config errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from judgeloop.config import ConfigError, load_config
from judgeloop.judges import JudgeConfig, Pair, build_judge
from judgeloop.judges.choice import ChoiceJudge
from judgeloop.judges.embedding import EmbeddingJudge, mean_pool
from judgeloop.judges.likelihood import LikelihoodJudge
from judgeloop.judges.prompts import PROMPTS, get_prompt
from judgeloop.judges.reward_model import RewardModelJudge
from judgeloop.judges.tokens import fit_article
from judgeloop.models import load_causal_lm, load_encoder, load_sequence_classifier, load_tokenizer

CAUSAL, ENCODER, REWARD = "judgeloop-tiny/causal-lm", "judgeloop-tiny/encoder", "judgeloop-tiny/reward-model"

ARTICLE = (
    "The city council approved a new budget on Tuesday. It raises spending on parks and schools. "
    "The mayor said the plan would be paid for by a small tax on hotel rooms. Critics said the tax "
    "would hurt tourism, but the vote passed seven to two."
)
PAIRS = [
    Pair(
        ARTICLE,
        "The council passed a budget that funds parks and schools.",
        "A vote happened.",
        ("The council approved a budget raising park and school spending.", "Budget passes 7-2."),
    ),
    Pair(
        ARTICLE,
        "Hotel tax pays for the new budget.",
        "The mayor likes parks and the vote passed seven to two.",
        ("A hotel tax will fund the council's new budget.",),
    ),
    Pair(
        "Rain fell all week in the valley. Farmers welcomed it after a dry spring.",
        "Farmers welcomed a week of rain.",
        "It rained.",
        ("A week of rain pleased farmers.",),
    ),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(CAUSAL)


@pytest.fixture(scope="module")
def causal():
    return load_causal_lm(CAUSAL)


@pytest.fixture(scope="module")
def encoder():
    return load_encoder(ENCODER)


@pytest.fixture(scope="module")
def reward():
    return load_sequence_classifier(REWARD)


def make(kind: str, tok, causal, encoder, reward, **kw):
    if kind == "choice":
        return ChoiceJudge(causal, tokenizer=tok, **kw)
    if kind == "likelihood":
        return LikelihoodJudge(causal, tokenizer=tok, **kw)
    if kind == "reward_model":
        return RewardModelJudge(reward, tokenizer=tok, **kw)
    return EmbeddingJudge(encoder, tokenizer=tok, target=kw.pop("target", "references"), **kw)


# --- every extractor --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["choice", "likelihood", "reward_model", "embedding"])
def test_build_judge_returns_finite_scores(kind):
    model = {"choice": CAUSAL, "likelihood": CAUSAL, "reward_model": REWARD, "embedding": ENCODER}[kind]
    judge = build_judge(JudgeConfig(type=kind, model=model, embedding_target="references", batch_size=2))
    out = judge.score(PAIRS)
    assert out.status == ["ok"] * len(PAIRS)
    assert np.all(np.isfinite(out.scores)) and out.scores.shape == (len(PAIRS),)
    assert judge.position_debias == (kind == "choice")  # position_debias=None resolves per type
    assert (out.reverse is not None) == (kind == "choice")


@pytest.mark.parametrize("kind", ["likelihood", "reward_model", "embedding"])
def test_pointwise_judges_are_exactly_antisymmetric(kind, tok, causal, encoder, reward):
    judge = make(kind, tok, causal, encoder, reward, batch_size=2)
    fwd = judge.score(PAIRS).scores
    rev = judge.score([p.swapped() for p in PAIRS]).scores
    assert np.all(np.isfinite(fwd)) and np.any(fwd != 0)
    np.testing.assert_array_equal(fwd, -rev)
    # with debiasing on, a pointwise judge has exactly zero position bias and unchanged scores
    judge.position_debias = True
    out = judge.score(PAIRS)
    np.testing.assert_array_equal(out.scores, fwd)
    assert out.position_bias() == 0.0


def test_choice_score_is_verdict_logprob_difference(tok, causal):
    """Batched, left-padded scores equal an unpadded forward pass computed by hand."""
    judge = ChoiceJudge(causal, tokenizer=tok, position_debias=False, batch_size=3)
    out = judge.score(PAIRS)
    id_a, id_b = tok.encode("A", add_special_tokens=False)[0], tok.encode("B", add_special_tokens=False)[0]
    for p, s in zip(PAIRS, out.scores):
        text = judge.render(p.article, p.a, p.b)
        assert text.endswith("<|im_start|>assistant\n")  # answer position right after the generation prompt
        assert "Summary A:" in text and "Summary B:" in text
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            logp = causal(input_ids=ids).logits[0, -1].log_softmax(-1)
        assert s == pytest.approx(float(logp[id_a] - logp[id_b]), abs=1e-5)


def test_choice_prefix_reuse_is_exact(tok, causal):
    """Reusing the article prefix's key/value cache gives the same scores as full forward passes."""
    many = [*PAIRS, Pair(ARTICLE, PAIRS[1].b, PAIRS[0].a)]  # three prompts on one article
    full = ChoiceJudge(causal, tokenizer=tok, prefix_cache_size=0, batch_size=4).score(many)
    judge = ChoiceJudge(causal, tokenizer=tok, prefix_cache_size=2, batch_size=4)
    reused = judge.score(many)
    np.testing.assert_allclose(reused.forward, full.forward, atol=1e-5)
    np.testing.assert_allclose(reused.reverse, full.reverse, atol=1e-5)
    assert judge.prefix_hits == 2  # the reverse order found both articles' prefixes


def test_likelihood_is_mean_token_logprob(tok, causal):
    judge = LikelihoodJudge(causal, tokenizer=tok, batch_size=4)
    out = judge.score(PAIRS[:2])
    values = []
    for summary in (PAIRS[0].a, PAIRS[0].b):
        ctx = tok.encode(judge.context(ARTICLE), add_special_tokens=False)
        target = tok.encode(summary, add_special_tokens=False)
        ids = torch.tensor([ctx + target])
        with torch.no_grad():
            logp = causal(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T-1, V), row t predicts token t+1
        token_lp = logp[len(ctx) - 1 :].gather(-1, ids[0, len(ctx) :, None]).squeeze(-1)
        values.append(float(token_lp.mean()))
    assert out.scores[0] == pytest.approx(values[0] - values[1], abs=1e-5)


def test_reward_model_is_scalar_head_difference(tok, reward):
    judge = RewardModelJudge(reward, tokenizer=tok, batch_size=4)
    out = judge.score(PAIRS[:1])
    r = []
    for summary in (PAIRS[0].a, PAIRS[0].b):
        ids = torch.tensor([judge._features(ARTICLE, summary)["input_ids"]])
        with torch.no_grad():
            r.append(float(reward(input_ids=ids).logits[0, 0]))
    assert out.scores[0] == pytest.approx(r[0] - r[1], abs=1e-5)


def test_embedding_matches_sentence_transformers(tmp_path, tok, encoder):
    """Mean pooling + normalization + cosine agree with sentence-transformers on the same encoder."""
    from sentence_transformers import SentenceTransformer, models

    plain_tok = load_tokenizer(ENCODER)
    # sentence-transformers wraps plain strings in a chat message when the tokenizer has a chat
    # template; a real encoder (MiniLM) has none, so save the tiny tokenizer without it
    plain_tok.chat_template = None
    encoder.save_pretrained(tmp_path / "enc")
    plain_tok.save_pretrained(tmp_path / "enc")
    word = models.Transformer(str(tmp_path / "enc"), max_seq_length=128)
    st = SentenceTransformer(
        modules=[word, models.Pooling(64, pooling_mode="mean"), models.Normalize()], device="cpu"
    )
    p = PAIRS[0]
    emb = st.encode([p.a, p.b, p.article], convert_to_tensor=True)
    scale = 7.0
    expected = scale * (float(emb[0] @ emb[2]) - float(emb[1] @ emb[2]))
    judge = EmbeddingJudge(encoder, tokenizer=tok, target="article", scale=scale)
    assert judge.score([p]).scores[0] == pytest.approx(expected, abs=1e-5)
    # references: mean cosine over references
    emb_r = st.encode(list(p.references), convert_to_tensor=True)
    exp_r = scale * float((emb_r @ emb[0]).mean() - (emb_r @ emb[1]).mean())
    judge_r = EmbeddingJudge(encoder, tokenizer=tok, target="references", scale=scale)
    assert judge_r.score([p]).scores[0] == pytest.approx(exp_r, abs=1e-5)


def test_mean_pool_hand_computed():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert mean_pool(h, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]


# --- position debiasing ------------------------------------------------------------------------------


class FirstShownBias(ChoiceJudge):
    """Planted order bias: +c on the verdict token for whichever summary is shown first."""

    c = 1.5

    def _answer_logits(self, seqs, prefix_lens):
        logits = super()._answer_logits(seqs, prefix_lens).clone()
        logits[:, self.verdict_ids[0]] += self.c
        return logits


def test_position_debiasing_cancels_a_planted_order_bias(tok, causal):
    plain = ChoiceJudge(causal, tokenizer=tok, position_debias=True)
    biased = FirstShownBias(causal, tokenizer=tok, position_debias=True)
    ref, out = plain.score(PAIRS), biased.score(PAIRS)
    # each order alone moves by c ...
    np.testing.assert_allclose(out.forward, ref.forward + FirstShownBias.c, atol=1e-4)
    np.testing.assert_allclose(out.reverse, ref.reverse + FirstShownBias.c, atol=1e-4)
    # ... the debiased score does not, and the reported bias grows by 2c
    np.testing.assert_allclose(out.scores, ref.scores, atol=1e-4)
    assert out.position_bias() - ref.position_bias() == pytest.approx(2 * FirstShownBias.c, abs=1e-4)
    # without debiasing the planted bias goes straight into the score and is not reported
    biased.position_debias = False
    one_order = biased.score(PAIRS)
    np.testing.assert_allclose(one_order.scores, ref.forward + FirstShownBias.c, atol=1e-4)
    assert math.isnan(one_order.position_bias())


# --- failures are counted, never scored --------------------------------------------------------------


class NanOnSecondRow(ChoiceJudge):
    def _answer_logits(self, seqs, prefix_lens):
        logits = super()._answer_logits(seqs, prefix_lens).clone()
        logits[1] = float("nan")
        return logits


def test_nan_logits_are_counted_not_scored(tok, causal):
    judge = NanOnSecondRow(causal, tokenizer=tok, position_debias=False, batch_size=3)
    out = judge.score(PAIRS)
    assert out.status == ["ok", "nonfinite", "ok"]
    assert math.isnan(out.scores[1]) and np.isfinite(out.scores[[0, 2]]).all()
    assert judge.stats.status["nonfinite"] == 1
    assert out.valid.tolist() == [True, False, True]


@pytest.mark.parametrize("kind", ["choice", "likelihood", "reward_model", "embedding"])
def test_empty_summary_status(kind, tok, causal, encoder, reward):
    judge = make(kind, tok, causal, encoder, reward)
    out = judge.score(
        [Pair(ARTICLE, "", "Budget passes."), Pair(ARTICLE, "Budget passes.", "  \n"), PAIRS[0]]
    )
    assert out.status == ["empty_summary", "empty_summary", "ok"]
    assert np.isnan(out.scores[:2]).all() and np.isfinite(out.scores[2])
    assert judge.stats.status["empty_summary"] == 2
    assert judge.stats.cache_misses == (2 if kind == "choice" else 1)  # only the valid pair reached the model


def test_cache_hits_are_counted(tok, causal):
    judge = ChoiceJudge(causal, tokenizer=tok, position_debias=True)
    first = judge.score(PAIRS)
    assert (judge.stats.cache_hits, judge.stats.cache_misses) == (0, 2 * len(PAIRS))
    again = judge.score(PAIRS)
    assert (judge.stats.cache_hits, judge.stats.cache_misses) == (2 * len(PAIRS), 2 * len(PAIRS))
    np.testing.assert_array_equal(first.scores, again.scores)
    # references are part of the key
    judge.score([dataclasses.replace(PAIRS[0], references=("another reference",))])
    assert judge.stats.cache_misses == 2 * len(PAIRS) + 2
    # cache_size=0 disables it
    nocache = ChoiceJudge(causal, tokenizer=tok, cache_size=0)
    nocache.score(PAIRS)
    nocache.score(PAIRS)
    assert nocache.stats.cache_hits == 0


def _input_length(judge, pair: Pair) -> int:
    """Tokens of the longest model input the judge builds for ``pair`` (untruncated)."""
    tok = judge.tokenizer
    if isinstance(judge, ChoiceJudge):
        return len(tok.encode(judge.render(pair.article, pair.a, pair.b), add_special_tokens=False))
    if isinstance(judge, LikelihoodJudge):
        ctx = len(tok.encode(judge.context(pair.article), add_special_tokens=False))
        return ctx + max(len(tok.encode(s, add_special_tokens=False)) for s in (pair.a, pair.b))
    return max(len(judge._features(pair.article, s)["input_ids"]) for s in (pair.a, pair.b))


@pytest.mark.parametrize("kind", ["choice", "likelihood", "reward_model"])
def test_overlong_article_is_truncated_and_overlong_summaries_are_too_long(
    kind, tok, causal, encoder, reward
):
    judge = make(kind, tok, causal, encoder, reward)
    long_article = Pair(" ".join([ARTICLE] * 12), PAIRS[0].a, PAIRS[0].b)
    huge = Pair("Short article.", " ".join(["The council approved a new budget on Tuesday."] * 40), "Short.")
    budget = max(
        _input_length(judge, PAIRS[2]),
        _input_length(judge, dataclasses.replace(long_article, article="")) + 5,
    )
    assert _input_length(judge, long_article) > budget
    assert _input_length(judge, dataclasses.replace(huge, article="")) > budget
    judge.max_length = budget
    out = judge.score([long_article, huge, PAIRS[2]])
    assert out.status == ["truncated", "too_long", "ok"]
    assert np.isfinite(out.scores[[0, 2]]).all() and math.isnan(out.scores[1])
    assert judge.stats.status["truncated"] == 1 and judge.stats.status["too_long"] == 1


def test_embedding_truncates_targets_and_refuses_long_summaries(tok, encoder):
    judge = EmbeddingJudge(encoder, tokenizer=tok, target="article", max_length=40)
    assert judge.max_length == 40
    long_article = " ".join([ARTICLE] * 3)
    huge = " ".join(["The council approved a budget."] * 20)
    out = judge.score(
        [Pair(long_article, "Budget passed.", "Rain fell."), Pair("Short article.", huge, "Ok.")]
    )
    assert out.status == ["truncated", "too_long"]
    assert np.isfinite(out.scores[0]) and math.isnan(out.scores[1])
    # the model's own limit caps max_length (tiny BERT: 512 positions)
    assert EmbeddingJudge(encoder, tokenizer=tok, max_length=100_000).max_length == 512


def test_fit_article_cuts_only_the_article(tok):
    def render(article: str) -> list[int]:
        return tok.encode(f"Article: {article}\nSummary: the budget passed.", add_special_tokens=False)

    ids, status, used = fit_article(render, tok, ARTICLE, 30)
    assert status == "truncated" and len(ids) <= 30 and ARTICLE.startswith(used.strip()) and used
    assert fit_article(render, tok, ARTICLE, 1000)[1] == "ok"
    assert fit_article(render, tok, ARTICLE, 5) == (None, "too_long", "")


# --- user-facing errors ------------------------------------------------------------------------------


def test_multi_token_verdict_raises(tok, causal):
    with pytest.raises(ValueError, match=r"'Summary A' is \d+ tokens .* must be a single token"):
        ChoiceJudge(causal, tokenizer=tok, verdict_tokens=("Summary A", "B"))


def test_verdicts_on_the_same_token_raise(tok, causal):
    with pytest.raises(ValueError, match="map to the same token id"):
        ChoiceJudge(causal, tokenizer=tok, verdict_tokens=("A", "A"))


def test_embedding_references_target_needs_references(tok, encoder):
    judge = EmbeddingJudge(encoder, tokenizer=tok, target="references")
    with pytest.raises(ValueError, match="1 of 2 pairs without references"):
        judge.score([PAIRS[0], Pair(ARTICLE, "x y", "z w")])


def test_loaded_model_without_tokenizer_raises(causal):
    with pytest.raises(ValueError, match="pass tokenizer="):
        ChoiceJudge(causal)


def test_reward_model_with_several_labels_raises(tok):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardModelJudge(LlamaForSequenceClassification(cfg), tokenizer=tok)


def test_call_with_mismatched_lengths_raises(tok, causal):
    judge = ChoiceJudge(causal, tokenizer=tok)
    with pytest.raises(ValueError, match="lengths must match"):
        judge([ARTICLE], ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="2 reference lists for 1 articles"):
        judge([ARTICLE], ["a"], ["c"], references=[["r"], ["s"]])


def test_unavailable_device_raises(tok, causal):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="judge.device=cuda but torch sees no CUDA GPU"):
        ChoiceJudge(causal, tokenizer=tok, device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type": "votes"}, "judge.type='votes' is not a judge"),
        ({"model": ""}, "judge.model is empty"),
        ({"prompt": "nuetral"}, "did you mean 'neutral'"),
        ({"batch_size": 0}, "judge.batch_size=0"),
        ({"max_length": 8}, "judge.max_length=8; it must be at least 16"),
        ({"embedding_target": "summary"}, "judge.embedding_target='summary'"),
        ({"scale": 0.0}, "judge.scale=0.0; it must be a positive finite number"),
        ({"scale": float("inf")}, "judge.scale=inf"),
        ({"dtype": "int8"}, "judge.dtype='int8' is not supported"),
        ({"verdict_tokens": ["A"]}, "give exactly two labels"),
        ({"verdict_tokens": ["A", " "]}, "cannot be empty or only spaces"),
        ({"verdict_tokens": ["A", " A"]}, "the two labels must differ"),
        ({"device": "gpu"}, "judge.device='gpu'; use auto, cpu, cuda, cuda:N or mps"),
        ({"cache_size": -1}, "judge.cache_size=-1"),
    ],
)
def test_judge_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        JudgeConfig(**kwargs)


@dataclasses.dataclass
class _Wrapper:
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)


def test_judge_config_loads_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("judge:\n  type: choice\n  verdict_tokens: ['1', '2']\n")
    cfg = load_config(_Wrapper, path, ["judge.position_debias=false", "judge.prompt=extractive_bias"])
    assert cfg.judge.verdict_tokens == ["1", "2"] and cfg.judge.debias is False
    assert cfg.judge.prompt == "extractive_bias"
    assert JudgeConfig().debias is True and JudgeConfig(type="embedding").debias is False
    with pytest.raises(ConfigError, match="position_debias"):
        load_config(_Wrapper, path, ["judge.position_debis=false"])
    with pytest.raises((ConfigError, ValueError), match="prompt"):
        load_config(_Wrapper, path, ["judge.prompt=extractive"])


def test_prompt_templates():
    assert {"neutral", "extractive_bias", "length_bias"} <= set(PROMPTS)
    assert "copies the article's own sentences" in get_prompt("extractive_bias").criteria
    text = get_prompt("length_bias").choice_text("ART", "x", "y", ("1", "2"))
    assert "Summary 1:\nx" in text and "Summary 2:\ny" in text and "ART" in text
    with pytest.raises(ValueError, match="did you mean 'length_bias'"):
        get_prompt("length_biased")


# --- the real judge ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_choice_judge_with_smollm2():
    judge = build_judge(
        JudgeConfig(type="choice", model="HuggingFaceTB/SmolLM2-135M-Instruct", max_length=512)
    )
    out = judge.score(PAIRS[:2])
    assert out.status == ["ok", "ok"]
    assert np.all(np.isfinite(out.scores)) and np.all(np.isfinite(out.reverse))
    assert math.isfinite(out.position_bias())
    assert 0.0 < judge.mean_verdict_mass <= 1.0


def test_embedding_cache_size_zero_keeps_nothing():
    from judgeloop.judges import JudgeConfig, build_judge

    judge = build_judge(JudgeConfig(type="embedding", model="judgeloop-tiny/encoder", cache_size=0))
    out = judge(["The council met."], ["The council met today."], ["Fans cheered."])
    assert out.valid.all()
    assert len(judge._embeddings) == 0


# --- prepare: summary-independent work ahead of time -------------------------------------------------


@pytest.mark.parametrize("target", ["article", "references"])
def test_prepare_moves_work_but_not_scores(tok, causal, encoder, target):
    import threading

    arts = [
        f"Article {i} about the council meeting on road repairs and the budget for {i} towns."
        for i in range(6)
    ]
    refs = [(f"The council discussed roads in {i} towns.",) for i in range(6)]
    a = [f"Council meets about roads {i}." for i in range(6)]
    b = [f"Budget for {i} towns was set." for i in range(6)]
    plain = EmbeddingJudge(encoder, tokenizer=tok, target=target)
    expected = plain(arts, a, b, refs).scores

    judge = EmbeddingJudge(encoder, tokenizer=tok, target=target)
    assert judge.can_prepare
    judge.prepare(arts[:3], refs[:3])
    targets = arts[:3] if target == "article" else [r[0] for r in refs[:3]]
    assert all((t, True) in judge._embeddings for t in targets)
    # a concurrent prepare of the other half while scoring: the lock serializes them. The targets are then
    # embedded in other batches than the plain judge's (3 + 3 instead of 6), so their padding differs and
    # the scores agree to float32 rounding (seen: 1.2e-6 absolute on an AVX-512 CPU), not bit for bit.
    th = threading.Thread(target=judge.prepare, args=(arts[3:], refs[3:]))
    th.start()
    got = judge(arts, a, b, refs).scores
    th.join()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # nothing to prepare when the cache is off; the base judge has no prepare step
    off = EmbeddingJudge(encoder, tokenizer=tok, target=target, cache_size=0)
    off.prepare(arts, refs)
    assert not off._embeddings
    assert not ChoiceJudge(causal, tokenizer=tok).can_prepare
    with pytest.raises(ValueError, match="reference lists"):
        judge.prepare(arts, refs[:2])
