"""Client of the compute replicas, with failover.

Replicas are stateless: when the replica serving a stream dies (or its cache connection drops),
the client sends the request to the next replica with the tokens already delivered
(`resume_token_ids`): that replica continues after them, so it decodes only the rest, the
prompt's and the delivered tokens' committed blocks are prefix hits there, and the stream the
caller sees (tokens, text, logprobs) is the one an uninterrupted run gives for greedy or seeded
sampling (each output position draws from its own seed).

A replica that stops answering without dying (frozen: SIGSTOP, a hung host, a stuck scheduler)
is failed over too: keepalive pings close a connection whose replica does not answer them
(`KEEPALIVE`), and each attempt has a first-token and an inter-token deadline
(`first_token_timeout_s`, `progress_timeout_s`). A replica that failed is passed over by new
requests for `AVOID_S`, while others serve.

    client = ComputeClient(["unix:///tmp/kvtier-0/compute-0.sock", "unix:///tmp/kvtier-0/compute-1.sock"])
    async for reply in client.generate(prompt="Hello", max_tokens=32, temperature=0):
        print(reply.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvtier import auth, sampling_schema, telemetry
from kvtier.api import compute_pb2, compute_pb2_grpc

log = logging.getLogger("kvtier.client")

# NOTE: gRPC's default reconnect backoff (1 s growing to 120 s) keeps a restarted replica looking
# dead for seconds; during a rolling restart the client would then run out of live replicas.
# Not grpc.min_reconnect_backoff_ms: gRPC reads it as the minimum connect timeout (20 s by
# default), and 100 ms there failed a fresh client's first requests to a busy replica
# ("connection attempt timed out before receiving SETTINGS frame").
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# A ping every 5 s on each connection, also between calls. grpc's own threads answer pings, so a
# replica whose Python loop is busy (a long prefill, the garbage collector) still answers; one
# that does not answer within 5 s is frozen, and its connection is closed: its streams fail with
# UNAVAILABLE and are retried elsewhere, and new calls fail over at once instead of waiting.
# NOTE: grpc waits `ping_timeout_ms` (60 s by default) for a ping's answer, whatever
# keepalive_timeout_ms says; both are set. Servers permit these pings (grpc_server.server_options).
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that is waiting for data
]
# Per-attempt deadlines, in seconds (None: no deadline). The first token includes queueing behind
# other requests and the prompt's prefill under load; 30 s is far above what a healthy replica
# takes on a busy 2-core machine with the tiny model (well under a second) and leaves room for
# long prompts on a real one. Between two replies a healthy replica runs one decode step of its
# batch (milliseconds to a few hundred); 10 s covers a preempted sequence's swap-in and a loaded
# host. A replica past either deadline is treated as failed: the call is cancelled and retried on
# the next replica, which resumes from the committed blocks.
FIRST_TOKEN_TIMEOUT_S = 30.0
PROGRESS_TIMEOUT_S = 10.0
# How long a replica that failed a call is passed over by new requests (unless every replica
# failed): long enough for keepalive to close a frozen replica's connection (10 s at most).
AVOID_S = 10.0
# How long a finished stream waits for its status before the call is let go (it comes at once).
FINISH_TIMEOUT_S = 5.0
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    # One per token_ids entry when the request set SamplingParams.logprobs; else empty.
    logprobs: list[compute_pb2.TokenLogprobs] = field(default_factory=list)


class ComputeClient:
    def __init__(
        self,
        addresses: list[str],
        token: str | None = None,
        *,
        per_call_credential: bool = False,
        first_token_timeout_s: float | None = FIRST_TOKEN_TIMEOUT_S,
        progress_timeout_s: float | None = PROGRESS_TIMEOUT_S,
    ):
        """`token`: what calls carry (the node token, or a client API key); default $KVTIER_TOKEN /
        the token file. `per_call_credential`: hold none; every `stream` names its `credential`
        (the gateway forwarding each HTTP caller's API key). `first_token_timeout_s`: how long
        an attempt waits for its replica's first reply; `progress_timeout_s`: for each later
        one (None: no deadline); past either, the request fails over to the next replica."""
        if not addresses:
            raise ValueError("give at least one compute replica address")
        for name, value in (
            ("first_token_timeout_s", first_token_timeout_s),
            ("progress_timeout_s", progress_timeout_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds or None, not {value!r}")
        self.first_token_timeout_s = first_token_timeout_s
        self.progress_timeout_s = progress_timeout_s
        token = token if token is not None or per_call_credential else auth.load_token()
        if token is None and not per_call_credential:
            raise RuntimeError("no token: set $KVTIER_TOKEN or $KVTIER_TOKEN_FILE")
        self.addresses = list(addresses)
        self.metadata = auth.bearer(token) if token is not None else ()
        self._channels = [
            telemetry.aio_channel(auth.grpc_target(a), options=RECONNECT + KEEPALIVE) for a in self.addresses
        ]
        self._stubs = [compute_pb2_grpc.ComputeServiceStub(c) for c in self._channels]
        self._next = itertools.count()
        self._avoid_until = [0.0] * len(self.addresses)

    def _pick(self) -> int:
        """The next replica in turn, passing over those that failed within AVOID_S (unless all did)."""
        start, now, n = next(self._next), time.monotonic(), len(self._stubs)
        return next(
            (i for i in ((start + k) % n for k in range(n)) if self._avoid_until[i] <= now), start % n
        )

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    @staticmethod
    def request(
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        *,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        logit_bias: dict[int, float] | None = None,
        request_id: str = "",
        cache_salt: str = "",
        structured_output: compute_pb2.StructuredOutput | None = None,
        final_only: bool = False,
        **sampling: int | float | None,
    ) -> compute_pb2.GenerateRequest:
        """A GenerateRequest. `sampling`: the optional fields of kvtier.sampling_schema
        (max_tokens=, temperature=, ...); one left None or out stays unset, and the replica then
        uses the model's default (its generation_config.json's, else the schema's). `final_only`:
        the whole completion in one reply, when it finishes (as `stream: false` returns it)."""
        unknown = sorted(set(sampling) - set(sampling_schema.NAMES))
        if unknown:
            raise TypeError(f"unknown sampling fields {unknown}; known: {', '.join(sampling_schema.NAMES)}")
        params = compute_pb2.SamplingParams(
            stop=stop or [],
            stop_token_ids=stop_token_ids or [],
            ignore_eos=ignore_eos,
            include_stop_str_in_output=include_stop_str_in_output,
            logit_bias=logit_bias or {},
        )
        for name, value in sampling.items():
            if value is not None:
                setattr(params, name, value)
        if structured_output is not None:  # kvtier.structured_output.to_proto
            params.structured_output.CopyFrom(structured_output)
        return compute_pb2.GenerateRequest(
            request_id=request_id,
            prompt=prompt or "",
            prompt_token_ids=prompt_token_ids or [],
            sampling=params,
            cache_salt=cache_salt,
            final_only=final_only,
        )

    async def stream(
        self,
        request: compute_pb2.GenerateRequest,
        max_attempts: int | None = None,
        *,
        credential: str | None = None,
    ) -> AsyncIterator[compute_pb2.GenerateResponse]:
        """Stream replies, failing over to the next replica on a retryable error. `credential`
        (a client API key) is sent in place of the client's own token."""
        metadata = self.metadata if credential is None else auth.bearer(credential)
        attempts = max_attempts or 2 * len(self.addresses) + 2
        delivered: list[int] = []
        last_error: grpc.RpcError | None = None
        for attempt in range(attempts):
            if attempt:
                # Back off a little: a replica that is restarting needs a moment to be reachable.
                await asyncio.sleep(min(0.1 * attempt, 0.5))
            i = self._pick()
            attempt_request = request
            if delivered:
                # Continue after what was delivered: the replica decodes only the rest.
                attempt_request = compute_pb2.GenerateRequest()
                attempt_request.CopyFrom(request)
                attempt_request.resume_token_ids.extend(delivered)
            call = self._stubs[i].Generate(attempt_request, metadata=metadata)
            timeout, awaited = self._first_reply_timeout(request), "its first reply"
            try:
                while True:
                    try:
                        async with asyncio.timeout(timeout):
                            reply = await call.read()
                    except TimeoutError:  # frozen or stuck: fail over (below) as for a dead replica
                        raise _stalled(self.addresses[i], timeout, awaited) from None
                    if reply is grpc.aio.EOF:
                        break
                    timeout, awaited = self.progress_timeout_s, "its next reply"
                    delivered += reply.token_ids
                    yield reply
                    if reply.finish_reason:
                        # Let the call end with its status (sent right after the last reply):
                        # cancelling it first (the finally below) would end a delivered stream
                        # as CANCELLED on the replica, in its logs and metrics.
                        with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                            async with asyncio.timeout(FINISH_TIMEOUT_S):
                                await call.code()
                        return
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                last_error = e
                self._avoid_until[i] = time.monotonic() + AVOID_S
                log.warning(
                    "replica %s failed (%s: %s); retrying on another (attempt %d/%d)",
                    self.addresses[i],
                    e.code().name,
                    e.details(),
                    attempt + 1,
                    attempts,
                )
            finally:
                # A caller that stops reading early (an HTTP client gone) must not leave the
                # replica generating: cancelling makes it abort the sequence and free its blocks.
                call.cancel()  # a no-op once the call has finished
        raise last_error if last_error else RuntimeError("no replica answered")

    def _first_reply_timeout(self, request: compute_pb2.GenerateRequest) -> float | None:
        """How long an attempt waits for its first reply. A final_only request's is its only one,
        sent when it finishes: it gets the streamed deadlines added up over its max_tokens (none
        when max_tokens is unset); keepalive still fails over a frozen replica within seconds."""
        if not request.final_only:
            return self.first_token_timeout_s
        first, each = self.first_token_timeout_s, self.progress_timeout_s
        if first is None or each is None or not request.sampling.HasField("max_tokens"):
            return None
        return first + each * request.sampling.max_tokens

    async def complete(
        self, request: compute_pb2.GenerateRequest, max_attempts: int | None = None
    ) -> Completion:
        """The whole completion of one request (with failover)."""
        out = Completion(request_id=request.request_id)
        async for reply in self.stream(request, max_attempts):
            out.request_id = reply.request_id
            out.text += reply.text
            out.token_ids += list(reply.token_ids)
            out.logprobs += list(reply.logprobs)
            if reply.time_to_first_token_s and not out.time_to_first_token_s:
                out.time_to_first_token_s = reply.time_to_first_token_s
            if reply.finish_reason:
                out.finish_reason = reply.finish_reason
                out.prompt_tokens = reply.usage.prompt_tokens
                out.completion_tokens = reply.usage.completion_tokens
                out.cached_prompt_tokens = reply.usage.cached_prompt_tokens
        return out


def _stalled(address: str, timeout_s: float, what: str) -> grpc.aio.AioRpcError:
    """The DEADLINE_EXCEEDED an attempt ends with when its replica sent nothing for `timeout_s`
    (retryable: the request fails over, as for a dead replica)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"replica {address} sent nothing for {timeout_s:g}s while the client waited for {what} "
        "(frozen or stuck); the request fails over to the next replica",
    )
