"""The traffic of bench/serve.py, generated in code from a seed (token ids are bytes): the three
workloads' sessions at a Poisson arrival rate, and the burst that measures concurrency."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

WORKLOADS = ("shared-prefix", "multi-turn", "long-unique")


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """Requests sent one after another: turn k+1 once turn k completed, think_s later."""

    start_s: float  # offset from the run's start
    turns: list[RequestSpec]
    think_s: list[float]  # before each turn after the first


@dataclass(frozen=True)
class Workload:
    """One run's traffic. warmup: requests sent one at a time before the clock starts, not measured."""

    sessions: list[Session]
    warmup: list[RequestSpec] = field(default_factory=list)


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of the generated workloads, in tokens (max_tokens = output tokens per request)."""

    max_model_len: int
    max_tokens: int
    num_prefixes: int = 2
    chat_turns: int = 3
    think_mean_s: float = 0.1


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def poisson_starts(rng: random.Random, rate: float, n: int) -> list[float]:
    """n arrival offsets (s) of a Poisson process of `rate` per second; the first at 0."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_workload(kind: str, shape: WorkloadShape, rate: float, num_requests: int, seed: int) -> Workload:
    """The traffic of one run. Each (kind, seed) draws fresh prompts: no run hits another's cache.

    shared-prefix warms up with one request per system prompt (every system gets them; only a
    prefix cache profits): a server in steady state has its system prompts cached, and a run of
    a few requests would otherwise measure mostly the cold misses.
    """
    rng = random.Random(f"{kind}-{seed}")
    max_len, out = shape.max_model_len, shape.max_tokens
    if kind == "shared-prefix":
        prefixes = [_tokens(rng, int(0.85 * max_len)) for _ in range(shape.num_prefixes)]
        specs = [
            RequestSpec(prefixes[rng.randrange(len(prefixes))] + _tokens(rng, rng.randint(8, 40)), out)
            for _ in range(num_requests)
        ]
        starts = poisson_starts(rng, rate, num_requests)
        return Workload(
            [Session(t, [s], []) for t, s in zip(starts, specs, strict=True)],
            warmup=[RequestSpec(p + _tokens(rng, 8), out) for p in prefixes],
        )
    if kind == "long-unique":
        specs = [
            RequestSpec(_tokens(rng, rng.randint(int(0.6 * max_len), int(0.85 * max_len))), out)
            for _ in range(num_requests)
        ]
        starts = poisson_starts(rng, rate, num_requests)
        return Workload([Session(t, [s], []) for t, s in zip(starts, specs, strict=True)])
    if kind == "multi-turn":
        turns = shape.chat_turns
        num_conversations = max(1, math.ceil(num_requests / turns))
        first_len = (max_len // 8, max_len // 4)
        follow_len = (max_len // 32, max_len // 12)
        sessions = []
        for start in poisson_starts(rng, rate, num_conversations):
            history = _tokens(rng, rng.randint(*first_len))
            specs = [RequestSpec(list(history), out)]
            for _ in range(turns - 1):
                # The assistant's reply in the history is synthetic (fixed per seed), so every
                # system sees the same prompts whatever it generated.
                history += _tokens(rng, out) + _tokens(rng, rng.randint(*follow_len))
                specs.append(RequestSpec(list(history), out))
            think = [rng.expovariate(1 / shape.think_mean_s) for _ in range(turns - 1)]
            sessions.append(Session(start, specs, think))
        return Workload(sessions)
    raise ValueError(f"unknown workload {kind!r}; one of {WORKLOADS}")


def make_burst(shape: WorkloadShape, num_requests: int, seed: int) -> list[RequestSpec]:
    """Chat-sized requests (prompts 10-30% of max_model_len, 32 output tokens) sent all at once."""
    rng = random.Random(f"burst-{seed}")
    lo, hi = shape.max_model_len // 10, (3 * shape.max_model_len) // 10
    return [RequestSpec(_tokens(rng, rng.randint(lo, hi)), 32) for _ in range(num_requests)]
