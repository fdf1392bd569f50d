"""Token emission: a step's logits become each request's next token, streamed to its caller.

`TokenEmitter.pick` samples one token per request (its penalties, its per-position seed, its
logprobs) on the forward thread, right after the forward; `deliver`, on the event loop, records
it, times it (time to first token, inter-token gaps), turns it into text (computesvc.output) and
puts the request's `StepOutput` on its queue, or its final one when it stops. A request whose sampling or output fails fails alone (`RequestFailed`); the rest of its
batch carries on. `finish` ends any request, with a finish reason or an error. Which requests
run, and when, is the scheduler's policy (computesvc.scheduler); this module never calls the
cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvtier.computesvc.observer import SchedulerObserver
from kvtier.computesvc.output import OutputProcessor
from kvtier.computesvc.request import Request, Status, StepOutput
from kvtier.computesvc.sampling import PenaltyState, Sampler, position_seed
from kvtier.computesvc.structured_output import advance, mask_logits

log = logging.getLogger("kvtier.compute")


@dataclass
class Picks:
    """What `TokenEmitter.pick` chose for a batch: one token per request (-1 where it failed),
    {row: why} for the rows that failed alone, and each row's logprobs (None unless asked)."""

    tokens: list[int]
    failed: dict[int, str]
    logprobs: list


class RequestFailed(Exception):
    """One request failed on its own (its sampling, its output): only it fails (INTERNAL)."""


class TokenEmitter:
    """Samples, records and streams the scheduler's tokens; ends requests (reporting to `observer`)."""

    def __init__(self, tokenizer, eos_token_ids: list[int], observer: SchedulerObserver):
        self.output = OutputProcessor(tokenizer, eos_token_ids)
        self.sampler = Sampler()
        self.observer = observer

    def resume(self, request: Request) -> None:
        """`request` resumes after a failover: its text continues, not restarts."""
        self.output.resume(request)

    def pick(self, reqs: list[Request], logits: torch.Tensor) -> Picks:
        """One token per request from its row of `logits` [len(reqs), vocab] (with its logprobs,
        from these raw logits, when the request asked for them); records nothing.

        NOTE: the torch half of emitting: the scheduler runs it on the forward thread, right after
        the forward that made `logits`, so every torch op of the replica runs in one OpenMP team
        (an argmax on the event loop's thread started a second team whose spinning threads took
        the cores from the next forward's)."""
        penalties = None
        if any(r.params.penalized for r in reqs):
            for r in reqs:
                if r.params.penalized and r.penalty is None:
                    r.penalty = PenaltyState(
                        r.prompt_token_ids, r.output_token_ids, logits.shape[-1], logits.device
                    )
            penalties = [r.penalty for r in reqs]
        params = [r.params for r in reqs]
        for r in reqs:
            if r.generator is not None:
                # Each output position draws from its own seed, so a request resumed on another
                # replica after k delivered tokens draws token k+1 as the first attempt would.
                r.generator.manual_seed(position_seed(r.params.seed, len(r.output_token_ids)))
        # Structured outputs: constrained rows sample from their grammar's masked logits (the
        # logprobs below stay the raw ones); a token the grammar refuses fails its request alone.
        grammars = [r.grammar for r in reqs]
        allowed = mask_logits(logits, grammars)
        tokens, failed = self.sampler.sample_isolated(allowed, params, [r.generator for r in reqs], penalties)
        if allowed is not logits:
            advance(grammars, tokens, failed)
        logprobs = [None] * len(reqs)
        if any(p.logprobs is not None for p in params):
            ks = [None if i in failed else p.logprobs for i, p in enumerate(params)]
            logprobs = self.sampler.logprobs(logits, ks, tokens)
        return Picks(tokens, failed, logprobs)

    def deliver(self, reqs: list[Request], picks: Picks, max_len: int) -> None:
        """Record each request's picked token, time it, turn it into text and stream it (or end
        the request: a stop, `max_len` the model's length limit, or its own failure)."""
        tokens, failed, logprobs = picks.tokens, picks.failed, picks.logprobs
        now = time.monotonic()
        for i, (req, token, lp) in enumerate(zip(reqs, tokens, logprobs, strict=True)):
            if i in failed:
                self.fail(req, failed[i])
                continue
            req.output_token_ids.append(token)
            if req.penalty is not None:
                req.penalty.add(token)
            ttft = 0.0
            if not req.first_token_at:
                req.first_token_at = now
                ttft = now - req.arrival
                self.observer.on_token(True, ttft)
            else:
                self.observer.on_token(False, now - req.last_token_at)
            req.last_token_at = now
            try:
                reason, text = self.output.process(req, token, max_len)
            except Exception as e:  # detokenizing this request's output: it alone fails
                self.fail(req, f"output processing failed: {type(e).__name__}: {e}")
                continue
            token_lps = None if lp is None else [lp]
            if reason:
                self.finish(req, reason, text=text, token_ids=[token], ttft=ttft, logprobs=token_lps)
            else:
                req.outputs.put_nowait(
                    StepOutput([token], text, time_to_first_token_s=ttft, logprobs=token_lps)
                )

    def fail(self, req: Request, why: str) -> None:
        """Fail `req` alone (the rest of its batch carries on); `why` names nothing of another request."""
        log.error("request %s failed: %s", req.request_id, why)
        self.finish(req, "", error=RequestFailed(why))

    def finish(
        self,
        req: Request,
        reason: str,
        *,
        text: str = "",
        token_ids: list[int] | None = None,
        ttft: float = 0.0,
        error: Exception | None = None,
        logprobs: list | None = None,
    ) -> None:
        """End `req`: its last StepOutput, with `reason` (or `error`) and its token counts."""
        req.status = Status.FINISHED
        out = StepOutput(
            token_ids=token_ids or [],
            text=text,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            cached_prompt_tokens=max(0, req.num_cached_prompt_tokens),
            time_to_first_token_s=ttft,
            error=error,
            logprobs=logprobs,
        )
        req.outputs.put_nowait(out)
        self.observer.on_finished(reason)
