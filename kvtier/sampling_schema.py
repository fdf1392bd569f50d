"""The sampling parameters of a Generate call, once: name, type, range, default and other names.

Every layer that handles sampling reads this table: the gateway's request schema and range
checks (gateway.protocol), the compute client's GenerateRequest builder
(kvtier.compute_client), the replica's servicer (which fills unset fields with the model's
defaults) and SamplingParams.validate (computesvc.sampling), and generation_config.json
handling (kvtier.generation_config). Adding a sampling field is one row here, the `optional`
proto field of the same name (proto/kvtier/v1/compute.proto) and its use in the sampler.

The fields here are the proto's `optional` scalars: unset means "the model's default". The
list fields (stop strings, stop token ids) have their limits below too.

`resolve_max_tokens` is the one rule for an unset `max_tokens` and the context limit, applied by
the gateway (before any replica works on a request) and by the replica (for gRPC clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
# The other strings of a Generate request, checked by the gateway and by the replica.
MAX_CACHE_SALT_BYTES = 256
PROMPT_BYTES_PER_TOKEN = 16  # a text prompt may have this many bytes per token of context
INT32_MAX = (1 << 31) - 1
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's


def _num(x: float) -> str:
    """A bound as a message writes it: ints whole, floats short (100.0 -> 100)."""
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Bound:
    """One range test of a field: `lo <= v` (`lo < v` when lo_open), `v <= hi`; None = no bound.
    `hi` may name a per-model limit (`"max_model_len"`), given to `SamplingField.error`."""

    lo: float | None = None
    hi: float | str | None = None
    lo_open: bool = False
    note: str = ""  # appended in parentheses: what the edge value means
    text: str = ""  # says the range in words instead (e.g. "must fit in 64 bits")

    def holds(self, value: float, hi: float | None) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return hi is None or value <= hi

    def says(self, hi: float | None) -> str:
        if self.text:
            return self.text
        out = "must be "
        if self.lo is not None and hi is not None:
            out += f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(hi)}]"
        elif self.lo is not None:
            out += f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            out += f"at most {_num(hi)}"
        return f"{out} ({self.note})" if self.note else out


@dataclass(frozen=True)
class SamplingField:
    """One optional sampling field. `name`: the SamplingParams attribute and proto field.
    `openai`: the request field of /v1/completions and /v1/chat/completions (None: the endpoints
    differ, e.g. logprobs). `hf`: the generation_config.json key (None: not a model default)."""

    name: str
    kind: type  # int or float
    default: int | float | None  # when neither the request nor the model sets it
    bounds: tuple[Bound, ...]
    openai: str | None = None
    hf: str | None = None
    doc: str = ""
    # Request values with another meaning on the wire (vLLM's top_k -1 = off = kvtier's 0).
    aliases: dict = field(default_factory=dict)

    def error(
        self, value: float, limits: dict[str, float] | None = None, name: str | None = None
    ) -> str | None:
        """The message naming `name` (default: this field), its range and `value` when `value` is
        out of range (a float must be finite), else None. `limits`: values of named bounds."""
        finite = not isinstance(value, float) or math.isfinite(value)
        for bound in self.bounds:
            hi = (limits or {})[bound.hi] if isinstance(bound.hi, str) else bound.hi
            if not (finite and bound.holds(value, hi)):
                return f"{name or self.name} {bound.says(hi)}, got {value}"
        return None

    def wire(self, value):
        """A request's value as the proto field takes it (aliases applied)."""
        return self.aliases.get(value, value)


_PENALTY = Bound(-2.0, 2.0)
FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens", int, 16, (Bound(1, "max_model_len", note="max_model_len"),),
        openai="max_tokens", hf="max_new_tokens", doc="tokens to generate at most",
    ),
    SamplingField(
        "temperature", float, 1.0, (Bound(0.0, note="0 = greedy"), Bound(hi=100.0)),
        openai="temperature", hf="temperature", doc="0 = greedy; at most 100 (logits / T stays finite)",
    ),
    SamplingField(
        "top_p", float, 1.0, (Bound(0.0, 1.0, lo_open=True),), openai="top_p", hf="top_p", doc="(0, 1]"
    ),
    SamplingField(
        "top_k", int, 0, (Bound(0, note="0 = off"), Bound(hi=INT32_MAX)),
        openai="top_k", hf="top_k", doc="vLLM extension; 0 or -1 = off", aliases={-1: 0},
    ),
    SamplingField(
        # torch.Generator.manual_seed accepts any 64-bit value, signed or unsigned.
        "seed", int, None, (Bound(-(1 << 63), (1 << 64) - 1, text="must fit in 64 bits"),), openai="seed",
    ),
    SamplingField(
        "presence_penalty", float, 0.0, (_PENALTY,), openai="presence_penalty", doc="[-2, 2], over the completion"
    ),
    SamplingField(
        "frequency_penalty", float, 0.0, (_PENALTY,),
        openai="frequency_penalty", doc="[-2, 2], over the completion",
    ),
    SamplingField(
        # Past [0.01, 100] logits under/overflow in fp32.
        "repetition_penalty", float, 1.0, (Bound(0.0, lo_open=True, note="1 = off"), Bound(1e-2, 100.0)),
        openai="repetition_penalty", hf="repetition_penalty",
        doc="vLLM extension: > 0, Hugging Face's, over prompt and completion",
    ),
    SamplingField(
        "min_p", float, 0.0, (Bound(0.0, 1.0),), openai="min_p", hf="min_p", doc="vLLM extension: [0, 1]"
    ),
    SamplingField(
        # Top alternatives per token, as OpenAI allows; completions' `logprobs`, chat's `top_logprobs`.
        "logprobs", int, None, (Bound(0, 20),), doc="top alternatives per token, [0, 20]",
    ),
)  # fmt: skip
BY_NAME = {f.name: f for f in FIELDS}
NAMES = tuple(BY_NAME)


def logit_bias_error(bias: dict[int, float], vocab_size: int) -> str | None:
    """The message naming what is wrong with a logit_bias map (its size, an id outside the
    vocabulary, a value out of LOGIT_BIAS_RANGE or not finite), else None."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS_ENTRIES} allowed"
    lo, hi = LOGIT_BIAS_RANGE
    for token_id, value in bias.items():
        if not 0 <= token_id < vocab_size:
            return f"logit_bias token {token_id} is outside the vocabulary [0, {vocab_size})"
        if not (math.isfinite(value) and lo <= value <= hi):
            return f"logit_bias values must be in [{lo:g}, {hi:g}], got {value} for token {token_id}"
    return None


def stop_error(stop: list[str], stop_token_ids: list[int], vocab_size: int | None = None) -> str | None:
    """The message naming what is wrong with a request's stop strings or stop token ids (their
    counts, sizes and, given `vocab_size`, the ids' range), else None."""
    if len(stop) > MAX_STOP_STRINGS:
        return f"stop has {len(stop)} strings, at most {MAX_STOP_STRINGS} allowed"
    if any(not s for s in stop):
        return "stop strings must be non-empty"
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        return f"a stop string has {max(map(len, stop))} characters, at most {MAX_STOP_STRING_CHARS} allowed"
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids has {len(stop_token_ids)} entries, at most {MAX_STOP_TOKEN_IDS} allowed"
    if vocab_size is not None:
        for token_id in stop_token_ids:
            if not 0 <= token_id < vocab_size:
                return f"stop_token_ids entry {token_id} is outside the vocabulary [0, {vocab_size})"
    return None


class ContextLengthError(ValueError):
    """A request that does not fit the model's context. `prompt_alone`: the prompt leaves no room
    for even one token, whatever max_tokens says."""

    def __init__(self, message: str, prompt_alone: bool):
        super().__init__(message)
        self.prompt_alone = prompt_alone


def resolve_max_tokens(
    requested: int | None,
    prompt_tokens: int,
    max_model_len: int,
    model_default: int | None,
    fallback: int | None,
) -> int:
    """The max_tokens a request runs with, checked against the context (tokens).

    `requested`: the client's (None: unset). Unset takes the model's default (generation_config's
    max_new_tokens), capped to the room after the prompt but at least 1 (a default yields to the
    context, a demand does not); without one `fallback`, or with that None too the whole room
    after the prompt. Raises ContextLengthError when prompt + max_tokens exceeds the context.
    """
    room = max_model_len - prompt_tokens
    want = requested
    if want is None and model_default is not None:
        want = max(1, min(model_default, room))
    if want is None:
        want = fallback
    if want is None:
        if room < 1:
            raise ContextLengthError(
                f"this model's context is {max_model_len} tokens and the prompt has {prompt_tokens}: "
                "no room for a completion",
                prompt_alone=True,
            )
        want = room
    if prompt_tokens + want > max_model_len:
        advice = (
            "the prompt alone fills it: shorten the prompt"
            if room < 1
            else "shorten the prompt or lower max_tokens"
        )
        raise ContextLengthError(
            f"this model's context is {max_model_len} tokens, but the request needs {prompt_tokens + want} "
            f"({prompt_tokens} prompt + {want} max_tokens); {advice}",
            prompt_alone=room < 1,
        )
    return want
