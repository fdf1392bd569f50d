"""Sampler picks and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from computesvc.sampling import Sampler, SamplingParams

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
