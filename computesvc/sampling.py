"""Turning logits into tokens: per-request sampling parameters and the batched sampler.

Stop strings are not handled here: matching them needs the detokenized text, which the
scheduler owns. The sampler only picks the next token id of each sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_STOP_STRINGS = 16
# torch.Generator.manual_seed accepts any 64-bit value, signed or unsigned.
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass
class SamplingParams:
    """How one request picks its tokens. `temperature == 0` is greedy; `top_k == 0` is off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """Raise ValueError naming the first field out of range, its value and the limit."""
        if not 1 <= self.max_tokens <= max_model_len:
            raise ValueError(
                f"max_tokens must be in [1, {max_model_len}] (max_model_len), got {self.max_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings, at most {MAX_STOP_STRINGS} allowed")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {token_id} is outside the vocabulary [0, {vocab_size})"
                )

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed` (None when unseeded: the sampler then uses torch's global RNG)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


class Sampler:
    """Picks one token per row of a logits batch, each row with its own parameters."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """Next token of each sequence.

        logits: [num_seqs, vocab_size], any float dtype (computed in fp32). Greedy rows take the
        argmax; the others apply temperature, then top-k, then top-p, then draw with their own
        generator (seeded -> reproducible regardless of the batch they are in).
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [num_seqs, vocab] with num_seqs == "
                f"len(params) ({len(params)}) == len(generators) ({len(generators)})"
            )
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        # NOTE: filtering is batched over the sampled rows; only the draw loops, since each row
        # draws from its own generator.
        vocab_size = logits.shape[1]
        temperature = logits.new_tensor([params[i].temperature for i in rows])
        top_k = torch.tensor([params[i].top_k or vocab_size for i in rows], device=logits.device)
        top_p = logits.new_tensor([params[i].top_p for i in rows])
        scaled = logits[rows] / temperature[:, None]
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
