"""gRPC servicer of the compute service: GenerateRequest -> scheduler Request -> streamed replies."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from kvtier import sampling_schema, status, structured_output
from kvtier.api import compute_pb2, compute_pb2_grpc
from kvtier.api_keys import tenant_salt
from kvtier.call_guard import caller
from kvtier.computesvc.admission import RequestRefused
from kvtier.computesvc.cache_port import CacheUnavailable, ExceedsLimit, NoFreeBlocks
from kvtier.computesvc.replica import Replica
from kvtier.computesvc.request import Request, StepOutput, new_request_id
from kvtier.computesvc.sampling import SamplingParams
from kvtier.computesvc.scheduler import StepFailed
from kvtier.computesvc.structured_output import Grammars, GrammarState
from kvtier.computesvc.token_emitter import RequestFailed
from kvtier.sampling_schema import MAX_CACHE_SALT_BYTES, PROMPT_BYTES_PER_TOKEN, resolve_max_tokens

log = logging.getLogger("kvtier.compute")

MAX_REQUEST_ID_BYTES = 256


class ComputeServicer(compute_pb2_grpc.ComputeServiceServicer):
    def __init__(self, replica: Replica):
        self.replica = replica
        # NOTE: text prompts are tokenized here, off the event loop (which serves every stream
        # and the scheduler) and off the default executor (which runs the model's forwards).
        self._tokenize = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._grammars: Grammars | None = None  # made at the first structured-output request

    def _defaults(self) -> dict:
        loaded = self.replica.loaded
        return loaded.sampling_defaults if loaded is not None else {}

    def _sampling(self, msg: compute_pb2.SamplingParams) -> SamplingParams:
        values = dict(self._defaults())
        # The schema's fields are the proto's `optional` ones: unset ones take the model's default
        # (its generation_config.json's), else SamplingParams' (the schema's).
        values.update({name: getattr(msg, name) for name in sampling_schema.NAMES if msg.HasField(name)})
        return SamplingParams(
            **values,
            stop=list(msg.stop),
            stop_token_ids=list(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            logit_bias=dict(msg.logit_bias),
        )

    @property
    def max_prompt_bytes(self) -> int:
        limit = self.replica.cfg.max_prompt_bytes
        return limit if limit else PROMPT_BYTES_PER_TOKEN * self.replica.shape.max_model_len

    def _prompt_token_ids(self, request: compute_pb2.GenerateRequest) -> list[int] | None:
        """The checked token ids of a `prompt_token_ids` request; None for a text prompt whose
        size is within --max-prompt-bytes (the caller tokenizes it). Sizes are checked before
        any per-token work."""
        if request.prompt and request.prompt_token_ids:
            raise ValueError("give either prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            max_len = self.replica.shape.max_model_len
            if len(request.prompt_token_ids) >= max_len:
                raise ValueError(
                    f"this model's context is {max_len} tokens, but prompt_token_ids alone has "
                    f"{len(request.prompt_token_ids)} (at least 1 more is generated)"
                )
            ids = list(request.prompt_token_ids)
            vocab = self.replica.shape.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return ids
        if not request.prompt:
            raise ValueError("the prompt is empty: give prompt text or prompt_token_ids")
        limit, text = self.max_prompt_bytes, request.prompt
        # A character is at least one byte: a long string fails before it is encoded.
        size = len(text) if len(text) > limit else len(text.encode())
        if size > limit:
            raise ValueError(
                f"the prompt is {size} bytes of text; this replica takes at most {limit} (--max-prompt-bytes)"
            )
        return None

    @staticmethod
    def _check_strings(request: compute_pb2.GenerateRequest) -> None:
        salt = request.cache_salt
        if "\0" in salt:
            raise ValueError("cache_salt contains a NUL character, which is not allowed")
        if len(salt) > MAX_CACHE_SALT_BYTES or len(salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise ValueError(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes")
        rid = request.request_id
        if len(rid) > MAX_REQUEST_ID_BYTES or len(rid.encode()) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")

    async def build_request(self, request: compute_pb2.GenerateRequest, tenant: str = "") -> Request:
        """Validate and translate; ValueError names the bad field and its limit. The request's
        blocks are hashed with the tenant's salt (tenant_salt) and charged to `tenant`."""
        shape = self.replica.shape
        self._check_strings(request)
        params = self._sampling(request.sampling)
        ids = self._prompt_token_ids(request)
        if ids is None:
            tokenizer = self.replica.loaded.tokenizer
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._tokenize, tokenizer.encode, request.prompt)
        limit = shape.max_model_len
        if not request.sampling.HasField("max_tokens"):  # a default yields to the context
            params.max_tokens = resolve_max_tokens(
                None, len(ids), limit, self._defaults().get("max_tokens"), params.max_tokens
            )
        params.validate(vocab_size=shape.vocab_size, max_model_len=limit)
        # The context check (ContextLengthError is a ValueError), as the gateway's.
        resolve_max_tokens(params.max_tokens, len(ids), limit, None, None)
        resumed = self._resumed(request, params.max_tokens)
        return Request(
            request_id=request.request_id or new_request_id(),
            prompt_token_ids=ids,
            params=params,
            tenant_salt=tenant_salt(tenant, request.cache_salt),
            tenant=tenant,
            span_context=trace.get_current_span().get_span_context(),
            output_token_ids=resumed,
            grammar=await self._grammar(request.sampling, resumed),
        )

    async def _grammar(self, msg: compute_pb2.SamplingParams, resumed: list[int]) -> GrammarState | None:
        """The request's structured-output state, compiled on the tokenize threads (off the event
        loop and the step loop; computesvc.structured_output); None when it sets no constraint."""
        constraint = structured_output.from_proto(msg.structured_output)
        if constraint is None:
            return None
        if self._grammars is None:
            loaded = self.replica.loaded
            self._grammars = Grammars(loaded.tokenizer, self.replica.shape.vocab_size, loaded.eos_token_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize, self._grammars.start, constraint, resumed)

    def _resumed(self, request: compute_pb2.GenerateRequest, max_tokens: int) -> list[int]:
        """The checked `resume_token_ids` (output delivered by an earlier attempt), [] if none."""
        resume = request.resume_token_ids
        if not resume:
            return []
        if len(resume) >= max_tokens:
            raise ValueError(
                f"resume_token_ids has {len(resume)} tokens, max_tokens is {max_tokens}: nothing is left to generate"
            )
        ids = list(resume)
        vocab = self.replica.shape.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"resume_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    async def Generate(self, request, context):
        if self.replica.loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica is still starting; retry")
        try:
            req = await self.build_request(request, caller())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span = trace.get_current_span()
        span.set_attribute("kvtier.request_id", req.request_id)
        span.set_attribute("kvtier.prompt_tokens", len(req.prompt_token_ids))
        try:
            self.replica.submit(req)
        except CacheUnavailable as e:
            await _abort_cache_unavailable(context, str(e))
        finished = False

        def on_done(_context=None) -> None:
            # The client went away (or the stream was cancelled): release its blocks. Called by
            # grpc when the call ends however it ends, also when the client cancels while grpc
            # is writing a reply (outside this generator, whose `finally` then waits for the
            # generator to be finalized), and from that `finally` (add_done_callback is
            # experimental in grpc.aio). Aborting twice is harmless.
            if not finished:
                self.replica.scheduler.abort(req)

        context.add_done_callback(on_done)
        held: list[StepOutput] = []  # a final_only request's outputs, sent as one when it finishes
        try:
            while not finished:
                out: StepOutput = await req.outputs.get()
                if out.error is not None:
                    finished = True
                    code, advice = grpc.StatusCode.UNAVAILABLE, "; retry"
                    if isinstance(out.error, ExceedsLimit):  # over its tenant's quota or the pool
                        code, advice = grpc.StatusCode.RESOURCE_EXHAUSTED, ""
                    elif isinstance(out.error, NoFreeBlocks):
                        code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    elif isinstance(out.error, RequestRefused):
                        code, advice = grpc.StatusCode.INVALID_ARGUMENT, ""
                    elif isinstance(out.error, (StepFailed, RequestFailed)):
                        code, advice = grpc.StatusCode.INTERNAL, " (see the replica's log)"
                    elif isinstance(out.error, CacheUnavailable):  # the stream was cut: say why
                        await _abort_cache_unavailable(
                            context, f"request {req.request_id}: {out.error}{advice}"
                        )
                    message = f"request {req.request_id}: {out.error}{advice}"
                    # It can never fit: the reason tells a gateway it is the client's to fix (a 4xx).
                    never = isinstance(out.error, ExceedsLimit)
                    trailer = status.details_trailer(code, message, status.EXCEEDS_LIMIT) if never else ()
                    await context.abort(code, message, trailing_metadata=trailer)
                finished = bool(out.finish_reason)
                if request.final_only:
                    held.append(out)
                    if not finished:
                        continue
                    out = _merged(held)
                yield self._reply(req, out)
            span.set_attribute("kvtier.cached_tokens", max(0, req.num_cached_prompt_tokens))
            span.set_attribute("kvtier.generated_tokens", len(req.output_token_ids))
        finally:
            on_done()

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


def _merged(outs: list[StepOutput]) -> StepOutput:
    """A request's step outputs as one: every token, text and logprob in order, the last one's
    finish reason and usage, the first one's time to first token."""
    logprobs = [lp for out in outs for lp in out.logprobs or ()]
    return dataclasses.replace(
        outs[-1],
        token_ids=[token for out in outs for token in out.token_ids],
        text="".join(out.text for out in outs),
        time_to_first_token_s=outs[0].time_to_first_token_s,
        logprobs=logprobs or None,
    )


async def _abort_cache_unavailable(context, message: str) -> None:
    """End the call UNAVAILABLE with reason CACHE_UNAVAILABLE (kvtier.status): the node's cache
    service went away, so a gateway can name that cause and retry elsewhere."""
    code = grpc.StatusCode.UNAVAILABLE
    await context.abort(
        code, message, trailing_metadata=status.details_trailer(code, message, status.CACHE_UNAVAILABLE)
    )
