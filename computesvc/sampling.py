"""Turning logits into tokens: per-request sampling parameters and the batched sampler.

Order of one step (each row with its own parameters): repetition penalty (Hugging Face: over the
prompt and the output), frequency and presence penalties (OpenAI: over the output only), then
for sampled rows temperature, min_p, top_k, top_p and the draw; greedy rows take the argmax
after the penalties. Rows without penalties skip that work entirely. Logprobs are reported from
the model's raw logits (before all of it), like vLLM's default `raw_logprobs`.

Stop strings are not handled here: matching them needs the detokenized text, which the
scheduler owns. The sampler only picks the next token id of each sequence.

One bad row never fails the batch: `Sampler.sample_isolated` falls back to sampling row by row
when the batch has a non-finite row or the batched pass raises, and reports the rows that fail
on their own (their requests fail; the others get their tokens). The common path pays one
`isfinite` over the value each row's argmax picked (argmax picks a NaN). A temperature in
(0, MIN_TEMPERATURE) is sampled as MIN_TEMPERATURE, as vLLM does: dividing logits by less
overflows them to inf and NaN.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from kvtier import sampling_schema

log = logging.getLogger("kvtier.compute")
_DEFAULT = {spec.name: spec.default for spec in sampling_schema.FIELDS}

MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are sampled as this (vLLM's _MAX_TEMP)


@dataclass
class SamplingParams:
    """How one request picks its tokens. `temperature == 0` is greedy; `top_k == 0`, `min_p == 0`,
    penalties of 0 (presence, frequency) or 1 (repetition) are off; `logprobs` None = none returned."""

    # The defaults and ranges of the optional fields are kvtier.sampling_schema's (tests check
    # that every row of it is a field here).
    max_tokens: int = _DEFAULT["max_tokens"]
    temperature: float = _DEFAULT["temperature"]
    top_p: float = _DEFAULT["top_p"]
    top_k: int = _DEFAULT["top_k"]
    seed: int | None = _DEFAULT["seed"]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    min_p: float = _DEFAULT["min_p"]
    logprobs: int | None = _DEFAULT["logprobs"]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits (it then needs a PenaltyState)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """Raise ValueError naming the first field out of range (kvtier.sampling_schema), its value
        and the limit. Every float must be finite; a temperature in (0, MIN_TEMPERATURE) is valid
        (sampled as MIN_TEMPERATURE)."""
        limits = {"max_model_len": max_model_len}
        for spec in sampling_schema.FIELDS:
            value = getattr(self, spec.name)
            if value is not None and (message := spec.error(value, limits)):
                raise ValueError(message)
        if message := sampling_schema.stop_error(self.stop, self.stop_token_ids, vocab_size):
            raise ValueError(message)
        if message := sampling_schema.logit_bias_error(self.logit_bias, vocab_size):
            raise ValueError(message)

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed` (None when unseeded: the sampler then uses torch's global RNG)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def position_seed(seed: int, position: int) -> int:
    """The seed of output position `position` of a request seeded with `seed` (a 64-bit mix:
    neighbouring positions and seeds get unrelated streams)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 29)


class NonFiniteLogits(ValueError):
    """Rows of a logits batch hold NaN or +inf (or nothing but -inf): they cannot be sampled."""

    def __init__(self, rows: list[int]):
        super().__init__(f"rows {rows} of the logits are not finite (NaN or inf)")
        self.rows = rows


class PenaltyState:
    """The token ids one request's penalties look at, kept up to date as its tokens are sampled
    (one `add` per token, not a recount per step).

    seen: [vocab] bool, tokens of the prompt or the output (repetition penalty).
    counts: [vocab] float32, how often each token is in the output (frequency/presence penalties).
    """

    def __init__(
        self, prompt_ids: list[int], output_ids: list[int], vocab_size: int, device: torch.device | str
    ):
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        for token in output_ids:
            self.add(token)

    def add(self, token: int) -> None:
        """`token` was just sampled for this request."""
        self.counts[token] += 1
        self.seen[token] = True


@dataclass
class TokenLogprob:
    """Log-probabilities (natural log, of the raw model distribution) around one sampled token."""

    logprob: float  # the sampled token's
    rank: int  # 1 = the most likely token
    top_ids: list[int]  # the k most likely, most likely first
    top_logprobs: list[float]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` [num_seqs, vocab] fp32 plus each row's logit_bias: a new tensor when some row
    has one (the input stays the raw logits, for logprobs), the same tensor when none does."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        bias = params[i].logit_bias
        ids = torch.tensor(list(bias), dtype=torch.long, device=out.device)
        out[i, ids] += out.new_tensor(list(bias.values()))
    return out


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], states: list[PenaltyState | None]
) -> torch.Tensor:
    """`logits` [num_seqs, vocab] fp32 with each row's penalties applied: a new tensor when some
    row has one (the input stays the raw logits, for logprobs), the same tensor when none does."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    missing = [i for i in rows if states[i] is None]
    if missing:
        raise ValueError(f"rows {missing} have penalties but no PenaltyState")
    x = logits[rows]
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1 for r in rep):
        seen = torch.stack([states[i].seen for i in rows])
        r = x.new_tensor(rep)[:, None]
        # Hugging Face's rule: a penalty > 1 always makes a seen token less likely, whatever
        # its logit's sign (dividing a negative logit would raise it).
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = [params[i].frequency_penalty for i in rows]
    pres = [params[i].presence_penalty for i in rows]
    if any(freq) or any(pres):
        counts = torch.stack([states[i].counts for i in rows])
        x = x - x.new_tensor(freq)[:, None] * counts - x.new_tensor(pres)[:, None] * (counts > 0)
    out = logits.clone()
    out[rows] = x
    return out


class Sampler:
    """Picks one token per row of a logits batch, each row with its own parameters."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        penalties: list[PenaltyState | None] | None = None,
    ) -> list[int]:
        """Next token of each sequence.

        logits: [num_seqs, vocab_size], any float dtype (computed in fp32; never modified).
        penalties: each row's PenaltyState (None for rows without penalties; the list may be None
        when no row has any). Logit biases first, then penalties; then greedy rows take the argmax, the others apply
        temperature, min_p, top-k, top-p, then draw with their own generator (seeded ->
        reproducible regardless of the batch they are in).
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [num_seqs, vocab] with num_seqs == "
                f"len(params) ({len(params)}) == len(generators) ({len(generators)})"
            )
        logits = apply_logit_bias(logits.float(), params)
        if penalties is not None:
            logits = apply_penalties(logits, params, penalties)
        greedy_ids = logits.argmax(dim=-1)
        # NOTE: the argmax guards the batch for free: argmax picks a NaN, so a row holding NaN or
        # +inf (or only -inf) has a non-finite value there; -inf entries alone (masked tokens)
        # are fine. One gather of num_seqs values, not another pass over the vocabulary.
        row_max = logits.gather(1, greedy_ids[:, None])[:, 0]
        if not bool(torch.isfinite(row_max).all()):
            raise NonFiniteLogits((~torch.isfinite(row_max)).nonzero().flatten().tolist())
        tokens = greedy_ids.tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        # NOTE: filtering is batched over the sampled rows; only the draw loops, since each row
        # draws from its own generator.
        vocab_size = logits.shape[1]
        temperature = logits.new_tensor([max(params[i].temperature, MIN_TEMPERATURE) for i in rows])
        top_k = torch.tensor([params[i].top_k or vocab_size for i in rows], device=logits.device)
        top_p = logits.new_tensor([params[i].top_p for i in rows])
        scaled = logits[rows] / temperature[:, None]
        min_p = [params[i].min_p for i in rows]
        if any(min_p):
            # Relative to the most likely token: p < min_p * p_max <=> logit < max + log(min_p).
            floor = scaled.max(dim=-1, keepdim=True).values + scaled.new_tensor(min_p)[:, None].log()
            scaled = scaled.masked_fill(scaled < floor, -math.inf)
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], -math.inf)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        for j, i in enumerate(rows):
            pick = torch.multinomial(probs[j], 1, generator=generators[i])
            tokens[i] = int(sorted_ids[j, pick])
        return tokens

    def sample_isolated(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        penalties: list[PenaltyState | None] | None = None,
    ) -> tuple[list[int], dict[int, str]]:
        """`sample`, with one bad row failing alone: (tokens, {row: why it failed}). A failed
        row's token is -1. When the batch has a non-finite row or the batched pass raises, each
        row is sampled on its own (rare: a row that would fail was checked before any draw, so
        seeded rows still draw once; only an error inside the draw loop redraws a seeded row)."""
        try:
            return self.sample(logits, params, generators, penalties), {}
        except Exception as e:
            log.warning("batched sampling failed (%s: %s): sampling row by row", type(e).__name__, e)
        tokens: list[int] = [-1] * len(params)
        failed: dict[int, str] = {}
        for i in range(len(params)):
            row_penalties = None if penalties is None else [penalties[i]]
            try:
                tokens[i] = self.sample(logits[i : i + 1], [params[i]], [generators[i]], row_penalties)[0]
            except NonFiniteLogits:
                failed[i] = "the model's logits for this request are not finite (NaN or inf)"
            except Exception as e:
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
        return tokens, failed

    @staticmethod
    def logprobs(logits: torch.Tensor, ks: list[int | None], tokens: list[int]) -> list[TokenLogprob | None]:
        """Logprobs of each row's sampled token (`tokens`) and its `ks[i]` most likely tokens,
        from the raw `logits` [num_seqs, vocab] (before penalties and temperature); None for rows
        whose k is None. Batched over the rows that ask."""
        out: list[TokenLogprob | None] = [None] * len(ks)
        rows = [i for i, k in enumerate(ks) if k is not None]
        if not rows:
            return out
        lp = logits[rows].float().log_softmax(dim=-1)
        picked = torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None]
        chosen = lp.gather(1, picked)
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        k_max = max(ks[i] for i in rows)
        top_lp, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], picked[:, :0])
        chosen, top_lp, top_ids = chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            k = ks[i]
            out[i] = TokenLogprob(chosen[j], ranks[j], top_ids[j][:k], top_lp[j][:k])
        return out
