"""One generation request as the scheduler tracks it, and what each step streams back for it."""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from kvtier.computesvc.output import TextState
from kvtier.computesvc.sampling import PenaltyState, SamplingParams, TokenLogprob
from kvtier.computesvc.structured_output import GrammarState
from kvtier.sequence_types import CommitItem


class Status(enum.Enum):
    WAITING = "waiting"  # not allocated (new, or preempted for recompute)
    RUNNING = "running"  # blocks on the device; prefilling or decoding
    SWAPPED = "swapped"  # blocks in the host tier
    FINISHED = "finished"


@dataclass
class StepOutput:
    """What one step produced for one request (the servicer turns it into a GenerateResponse)."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    error: Exception | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when the request asked


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The salt the cache hashes this request's blocks with: kvtier.api_keys.tenant_salt(tenant,
    # the client's cache_salt), so tenants never share blocks.
    tenant_salt: str = ""
    tenant: str = ""  # the client key's tenant ("" = node credential, or no keys configured)
    arrival: float = field(default_factory=time.monotonic)  # time.monotonic() seconds
    outputs: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    # The span context of the request's server span: batched prefill/decode spans link to it.
    span_context: trace.SpanContext | None = None

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    sequence_id: int = 0
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_recorded: int = 0  # leading tokens the cache's sequence record holds
    num_committed: int = 0  # num_computed last reported to the cache
    # Leading entries of block_table a sliding window left behind and the cache took back
    # (placeholders now; computesvc.window). 0 for a new sequence.
    num_released_blocks: int = 0
    num_cached_prompt_tokens: int = -1  # from the first Allocate; -1 = not allocated yet
    first_token_at: float = 0.0  # time.monotonic() seconds; 0 = no token yet
    last_token_at: float = 0.0
    text_state: TextState = field(default_factory=TextState)  # how far the output is detokenized
    # Token counts for the penalties (made at the first sample; None when the request has none).
    penalty: PenaltyState | None = None
    # Where the output is in its structured-output grammar (None: unconstrained).
    grammar: GrammarState | None = None
    aborted: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """The token at `position` of `token_ids`, without building that list."""
        prompt = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        # Decoding means: every token but the last sampled one is in the pool.
        return self.num_computed < self.num_tokens - 1


def commit_items(reqs: list[Request]) -> list[CommitItem]:
    """What `reqs` computed since their last commit, as commit items (none for those with nothing
    new): the tokens appended to the cache's record and the new count of written tokens."""
    return [
        CommitItem(req.sequence_id, req.token_ids[req.num_recorded : req.num_computed], req.num_computed)
        for req in reqs
        if req.num_computed > req.num_committed
    ]


def mark_committed(reqs: list[Request]) -> None:
    """After a cache call that carried `commit_items(reqs)` succeeded."""
    for req in reqs:
        req.num_recorded = max(req.num_recorded, req.num_computed)
        req.num_committed = req.num_computed


def new_request_id(counter=itertools.count(1)) -> str:
    """A request id for a request that came without one: `req-<ms clock, 9 digits>-<counter>`."""
    return f"req-{int(time.time() * 1000) % 10**9:09d}-{next(counter)}"
