"""Sampler picks and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from kvtier.computesvc.sampling import PenaltyState, Sampler, SamplingParams, apply_penalties

VOCAB = 50


def random_logits(num_seqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_seqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_argmax_of_each_row():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0)] * 4
    assert Sampler().sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    logits = random_logits(3)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draw(rows: torch.Tensor, n: int) -> list[list[int]]:
        generators = [params.make_generator() for _ in range(n)]
        return [Sampler().sample(rows, [params] * n, generators) for _ in range(20)]

    alone = [steps[0] for steps in draw(logits[:1], 1)]
    batched = [steps[0] for steps in draw(logits, 3)]
    assert alone == batched
    assert len(set(alone)) > 1  # the draws do vary from step to step
    assert draw(logits, 3) == draw(logits, 3)


def test_unseeded_rows_follow_torch_global_rng():
    logits = random_logits(2)
    params = [SamplingParams(temperature=1.0)] * 2
    torch.manual_seed(7)
    first = [Sampler().sample(logits, params, [None, None]) for _ in range(10)]
    torch.manual_seed(7)
    assert [Sampler().sample(logits, params, [None, None]) for _ in range(10)] == first


def test_top_k_one_equals_greedy():
    logits = random_logits(6, seed=1)
    params = [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(6)]
    got = Sampler().sample(logits, params, [p.make_generator() for p in params])
    assert got == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(6, seed=2)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(6)]
    got = Sampler().sample(logits, params, [p.make_generator() for p in params])
    assert got == logits.argmax(-1).tolist()


def test_top_k_draws_only_among_the_k_best():
    logits = random_logits(1, seed=3)
    best3 = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    generator = params.make_generator()
    draws = {Sampler().sample(logits, [params], [generator])[0] for _ in range(200)}
    assert draws == best3


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2 (and ~0 for the rest): top_p 0.7 keeps the first two.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, [4, 9, 2]] = torch.tensor([0.5, 0.3, 0.2]).log()
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    generator = params.make_generator()
    draws = {Sampler().sample(logits, [params], [generator])[0] for _ in range(200)}
    assert draws == {4, 9}


def test_logit_bias_moves_only_its_rows_tokens_and_leaves_the_raw_logits():
    logits = random_logits(3, seed=5)
    raw = logits.clone()
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={int(logits[2].argmax()): -100.0})]  # fmt: skip
    got = Sampler().sample(logits, params, [None] * 3)
    assert got[0] == 7 and got[1] == int(logits[1].argmax()) and got[2] != int(logits[2].argmax())
    assert torch.equal(logits, raw)  # logprobs still read the model's own


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(4, seed=4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2
    got = Sampler().sample(logits, params, [p.make_generator() for p in params])
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, r"max_tokens must be in \[1, 128\] \(max_model_len\), got 0"),
        ("max_tokens", 129, r"max_tokens must be in \[1, 128\] \(max_model_len\), got 129"),
        ("temperature", -0.5, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
        ("temperature", float("nan"), r"temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("top_k", -1, r"top_k must be >= 0 \(0 = off\), got -1"),
        ("seed", 1 << 64, r"seed must fit in 64 bits"),
        ("stop", ["x"] * 17, r"stop has 17 strings, at most 16 allowed"),
        ("stop", [""], r"stop strings must be non-empty"),
        ("stop_token_ids", [3, 50], r"stop_token_ids entry 50 is outside the vocabulary \[0, 50\)"),
        ("stop_token_ids", [-1], r"stop_token_ids entry -1 is outside the vocabulary"),
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ("frequency_penalty", -2.01, r"frequency_penalty must be in \[-2, 2\], got -2.01"),
        ("frequency_penalty", float("inf"), r"frequency_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
        ("repetition_penalty", float("nan"), r"repetition_penalty must be > 0"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
        ("min_p", -0.1, r"min_p must be in \[0, 1\], got -0.1"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
        ("logprobs", -1, r"logprobs must be in \[0, 20\], got -1"),
        ("logit_bias", {3: 100.5}, r"logit_bias values must be in \[-100, 100\], got 100.5 for token 3"),
        ("logit_bias", {50: 1.0}, r"logit_bias token 50 is outside the vocabulary \[0, 50\)"),
    ],
)
def test_validate_rejects_each_bad_field_naming_it(field, value, message):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=message):
        params.validate(vocab_size=VOCAB, max_model_len=128)


def test_validate_accepts_the_defaults_and_edge_values():
    SamplingParams().validate(vocab_size=VOCAB, max_model_len=128)
    SamplingParams(
        max_tokens=128, temperature=0, top_p=1.0, top_k=VOCAB, seed=0, stop=["a"] * 16, stop_token_ids=[0, 49]
    ).validate(vocab_size=VOCAB, max_model_len=128)


# --- penalties, min_p, logprobs -------------------------------------------------------------


def test_penalty_math_equals_a_hand_computed_tensor():
    # vocab 6; prompt holds tokens 0 and 1; the output so far is [2, 2, 3].
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]])
    state = PenaltyState([0, 1], [2, 2, 3], vocab_size=6, device="cpu")
    assert state.counts.tolist() == [0, 0, 2, 1, 0, 0]
    assert state.seen.tolist() == [True, True, True, True, False, False]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, [params], [state])
    # repetition over prompt + output (ids 0..3): positive / 2, negative * 2; then
    # output-only: id 2: -0.5*2 - 0.25, id 3: -0.5*1 - 0.25.
    expected = torch.tensor([[1.0, -2.0, 1.5 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, -2.0, 1.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert logits.tolist() == [[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]]  # the raw logits stay raw


def test_penalties_touch_only_the_rows_that_ask_and_counts_grow_incrementally():
    logits = random_logits(3, seed=5)
    plain = SamplingParams(temperature=0)
    penalized = SamplingParams(temperature=0, frequency_penalty=2.0)
    state = PenaltyState([1], [], VOCAB, "cpu")
    out = apply_penalties(logits, [plain, penalized, plain], [None, state, None])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.equal(out[1], logits[1])  # no output yet: the prompt does not count for frequency
    assert apply_penalties(logits, [plain] * 3, [None] * 3) is logits  # no copy on the common path
    top = int(logits[1].argmax())
    state.add(top)
    state.add(top)
    out = apply_penalties(logits, [plain, penalized, plain], [None, state, None])
    assert float(out[1, top]) == pytest.approx(float(logits[1, top]) - 4.0)


def test_greedy_with_a_repetition_penalty_takes_the_argmax_after_it():
    logits = torch.tensor([[3.0, 2.5, -1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    state = PenaltyState([0], [], 3, "cpu")
    assert Sampler().sample(logits, [params], [None], [state]) == [1]  # 3/1.5 = 2 < 2.5
    assert Sampler().sample(logits, [SamplingParams(temperature=0)], [None]) == [0]


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    # probabilities 0.5, 0.3, 0.2: min_p 0.5 keeps those >= 0.25, so 4 and 9.
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, [4, 9, 2]] = torch.tensor([0.5, 0.3, 0.2]).log()
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=0)
    generator = params.make_generator()
    draws = {Sampler().sample(logits, [params], [generator])[0] for _ in range(200)}
    assert draws == {4, 9}


def test_logprobs_are_of_the_raw_logits_with_rank_and_top_k():
    logits = random_logits(3, seed=6)
    expected = logits.log_softmax(-1)
    tokens = [int(logits[0].argsort(descending=True)[2]), 7, int(logits[2].argmax())]
    got = Sampler.logprobs(logits, [3, None, 0], tokens)
    assert got[1] is None
    first = got[0]
    assert first.rank == 3
    assert first.logprob == pytest.approx(float(expected[0, tokens[0]]), abs=1e-6)
    top = expected[0].topk(3)
    assert first.top_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert got[2].rank == 1 and got[2].top_ids == [] and got[2].top_logprobs == []
