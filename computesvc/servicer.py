"""gRPC servicer of the compute service: GenerateRequest -> scheduler Request -> streamed replies."""

from __future__ import annotations

import logging

import grpc
from opentelemetry import trace

from computesvc.cache_port import CacheUnavailable, NoFreeBlocks
from computesvc.replica import Replica
from computesvc.request import Request, StepOutput, new_request_id
from computesvc.sampling import SamplingParams
from computesvc.scheduler import StepFailed
from kvtier.api import compute_pb2, compute_pb2_grpc

log = logging.getLogger("kvtier.compute")


class ComputeServicer(compute_pb2_grpc.ComputeServiceServicer):
    def __init__(self, replica: Replica):
        self.replica = replica

    # Proto fields that are `optional`: unset ones take the model's default (its
    # generation_config.json's, else SamplingParams'); the dataclass's defaults are the fallback.
    _OPTIONAL = (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "logprobs",
    )

    def _defaults(self) -> dict:
        loaded = self.replica.loaded
        return loaded.sampling_defaults if loaded is not None else {}

    def _sampling(self, msg: compute_pb2.SamplingParams) -> SamplingParams:
        values = dict(self._defaults())
        values.update({name: getattr(msg, name) for name in self._OPTIONAL if msg.HasField(name)})
        return SamplingParams(
            **values,
            stop=list(msg.stop),
            stop_token_ids=list(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
        )

    def _prompt_token_ids(self, request: compute_pb2.GenerateRequest) -> list[int]:
        if request.prompt and request.prompt_token_ids:
            raise ValueError("give either prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            vocab = self.replica.shape.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return ids
        if not request.prompt:
            raise ValueError("the prompt is empty: give prompt text or prompt_token_ids")
        return self.replica.loaded.tokenizer.encode(request.prompt)

    def build_request(self, request: compute_pb2.GenerateRequest) -> Request:
        """Validate and translate; ValueError names the bad field and its limit."""
        shape = self.replica.shape
        params = self._sampling(request.sampling)
        ids = self._prompt_token_ids(request)
        if not request.sampling.HasField("max_tokens") and "max_tokens" in self._defaults():
            # The model's max_new_tokens is a default, not a demand: it yields to the context.
            params.max_tokens = max(1, min(params.max_tokens, shape.max_model_len - len(ids)))
        params.validate(vocab_size=shape.vocab_size, max_model_len=shape.max_model_len)
        if len(ids) + params.max_tokens > shape.max_model_len:
            raise ValueError(
                f"this model's context is {shape.max_model_len} tokens, but the request needs "
                f"{len(ids) + params.max_tokens} ({len(ids)} prompt + {params.max_tokens} max_tokens)"
            )
        return Request(
            request_id=request.request_id or new_request_id(),
            prompt_token_ids=ids,
            params=params,
            cache_salt=request.cache_salt,
            span_context=trace.get_current_span().get_span_context(),
        )

    async def Generate(self, request, context):
        if self.replica.loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica is still starting; retry")
        try:
            req = self.build_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span = trace.get_current_span()
        span.set_attribute("kvtier.request_id", req.request_id)
        span.set_attribute("kvtier.prompt_tokens", len(req.prompt_token_ids))
        try:
            self.replica.submit(req)
        except CacheUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finished = False
        try:
            while not finished:
                out: StepOutput = await req.outputs.get()
                if out.error is not None:
                    finished = True
                    code, advice = grpc.StatusCode.UNAVAILABLE, "; retry"
                    if isinstance(out.error, NoFreeBlocks):
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    elif isinstance(out.error, StepFailed):
                        code, advice = grpc.StatusCode.INTERNAL, " (see the replica's log)"
                    await context.abort(code, f"request {req.request_id}: {out.error}{advice}")
                finished = bool(out.finish_reason)
                yield self._reply(req, out)
            span.set_attribute("kvtier.cached_tokens", max(0, req.num_cached_prompt_tokens))
            span.set_attribute("kvtier.generated_tokens", len(req.output_token_ids))
        finally:
            if not finished:
                # The client went away (or the stream was cancelled): release its blocks.
                self.replica.scheduler.abort(req)

    @staticmethod
    def _reply(req: Request, out: StepOutput) -> compute_pb2.GenerateResponse:
        reply = compute_pb2.GenerateResponse(
            request_id=req.request_id,
            token_ids=out.token_ids,
            text=out.text,
            finish_reason=out.finish_reason,
            time_to_first_token_s=out.time_to_first_token_s,
        )
        if out.logprobs:
            reply.logprobs.extend(
                compute_pb2.TokenLogprobs(
                    logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs
                )
                for lp in out.logprobs
            )
        if out.finish_reason:
            reply.usage.CopyFrom(
                compute_pb2.Usage(
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    cached_prompt_tokens=out.cached_prompt_tokens,
                )
            )
        return reply
