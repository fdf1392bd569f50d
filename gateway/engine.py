"""The engine-facing half of the gateway: an HTTP request's prompts and sampling -> Generate streams.

One completion (a prompt and a sample index) is one `Generate` call through `ComputeClient`,
which fails over to another replica on a retryable error. A request's calls are *primed* (their
first reply awaited) before any HTTP status is sent, so a replica's refusal (INVALID_ARGUMENT) or
no replica at all still answers as a 400 or a 503, not as a broken stream.

Samples of one prompt (`n` > 1) start in two waves: sample 0 of each prompt first, the others
once its first reply arrived. NOTE: a replica commits a prefilled prompt (publishing its full
blocks) before it streams the first token (computesvc.scheduler); calls started together would all miss
and prefill the same prompt n times, while calls started after the first token hit every full
block of it (the cost: the other samples' first token waits for sample 0's).

Sampling fields the client left out are left unset on the Generate call, so the replica applies
the model's generation_config.json defaults (and the proto's defaults after those).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier import auth, structured_output
from kvtier.api import compute_pb2
from kvtier.compute_client import RECONNECT, ComputeClient
from kvtier.gateway.errors import APIError, bad_request, from_grpc, no_replica
from kvtier.gateway.logprobs import LogprobFormatter
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import ChatCompletionRequest, Usage, _SamplingRequest
from kvtier.gateway.router import NodeState, NoNode, Router
from kvtier.sampling_schema import ContextLengthError, resolve_max_tokens
from kvtier.structured_output import Constraint

log = logging.getLogger("kvtier.gateway")

HEALTH_TIMEOUT_S = 1.0


@dataclass
class Job:
    """One Generate call: choice `index` of the response, sample `sample` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    sample: int
    prompt_ids: list[int]
    request: compute_pb2.GenerateRequest


@dataclass
class Choice:
    """What one Generate stream produced, accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: list[compute_pb2.TokenLogprobs] = field(default_factory=list)  # one per token, if asked

    def add(self, reply: compute_pb2.GenerateResponse) -> None:
        self.text += reply.text
        self.token_ids.extend(reply.token_ids)
        self.logprobs.extend(reply.logprobs)
        if reply.finish_reason:
            self.finish_reason = reply.finish_reason
            self.completion_tokens = reply.usage.completion_tokens
            self.cached_prompt_tokens = reply.usage.cached_prompt_tokens


def usage_of(jobs: list[Job], choices: list[Choice]) -> Usage:
    """Usage of a request: each prompt counted once; its cached tokens are the fewest any of its
    samples found cached (every sample is its own Generate call, later ones hit what earlier wrote)."""
    prompt = cached = 0
    by_prompt: dict[int, list[Choice]] = {}
    for job, choice in zip(jobs, choices, strict=True):
        by_prompt.setdefault(job.prompt_index, []).append(choice)
        if job.sample == 0:
            prompt += len(job.prompt_ids)
    cached = sum(min(c.cached_prompt_tokens for c in group) for group in by_prompt.values())
    return Usage.of(prompt, sum(c.completion_tokens for c in choices), cached)


def _as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, grpc.aio.AioRpcError):
        return from_grpc(error)
    if isinstance(error, StopAsyncIteration):
        return no_replica("a replica closed the stream without a reply")
    log.error("Generate failed: %r", error)
    return no_replica(f"{type(error).__name__}: {error}")


class Streams:
    """The primed Generate streams of one HTTP request; iterate for (job, reply) in arrival order."""

    def __init__(
        self,
        jobs: list[Job],
        gens: list[AsyncIterator],
        firsts: list[compute_pb2.GenerateResponse],
        on_done: Callable[[int | None], None] | None = None,
    ):
        """`on_done(cached)`: called once when the streams end or are closed, with the first job's
        cached prompt tokens from its usage (None if it did not finish)."""
        self.jobs, self._gens, self._firsts = jobs, gens, firsts
        # The replica's own time from a request's arrival to its first token (the earliest stream's).
        self.replica_ttft_s = min(f.time_to_first_token_s for f in firsts)
        self._tasks: list[asyncio.Task] = []
        self._on_done = on_done
        self._cached: int | None = None

    def _done(self) -> None:
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done(self._cached)

    async def __aiter__(self) -> AsyncIterator[tuple[Job, compute_pb2.GenerateResponse]]:
        try:
            for job, first in zip(self.jobs, self._firsts, strict=True):
                if first.finish_reason and job.index == 0:
                    self._cached = first.usage.cached_prompt_tokens
                yield job, first
            try:
                if len(self._gens) == 1:  # the common case: no tasks, no queue, no layer between
                    job = self.jobs[0]
                    async for reply in self._gens[0]:
                        if reply.finish_reason:
                            self._cached = reply.usage.cached_prompt_tokens
                        yield job, reply
                    return
                async for job, reply in self._merged():
                    if reply.finish_reason and job.index == 0:
                        self._cached = reply.usage.cached_prompt_tokens
                    yield job, reply
            except (grpc.aio.AioRpcError, RuntimeError) as e:
                raise _as_api_error(e) from e
        finally:
            self._done()

    async def _merged(self) -> AsyncIterator[tuple[Job, compute_pb2.GenerateResponse]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job, gen: AsyncIterator) -> None:
            try:
                async for reply in gen:
                    queue.put_nowait((job, reply, None))
                queue.put_nowait((job, None, None))
            except Exception as e:
                queue.put_nowait((job, None, e))

        self._tasks = [asyncio.create_task(pump(j, g)) for j, g in zip(self.jobs, self._gens, strict=True)]
        remaining = len(self._tasks)
        while remaining:
            job, reply, error = await queue.get()
            if reply is not None:
                yield job, reply
                continue
            remaining -= 1
            if error is not None:
                raise error

    async def collect(self) -> list[Choice]:
        """Run every stream to its end; the choices in index order."""
        choices = [Choice(job.index) for job in self.jobs]
        async for job, reply in self:
            choices[job.index].add(reply)
        return choices

    async def aclose(self) -> None:
        """Stop every stream that is still running: its Generate call is cancelled, so the replica
        aborts the sequence and frees its blocks."""
        for task in self._tasks:
            task.cancel()
        # Each cancelled pump ends its own stream, and so its call: wait for them. (aclose on a
        # stream a pump is still inside raises RuntimeError, which skipped the streams after it.)
        if self._tasks:
            await asyncio.wait(self._tasks)
        for gen in self._gens:
            await gen.aclose()
        self._done()


class Engine:
    def __init__(
        self,
        addresses: list[str],
        model: ServedModel,
        max_n: int,
        token: str | None = None,
        forward_keys: bool = False,
        router: Router | None = None,
    ):
        """`forward_keys`: each `open` names the caller's API key, sent to Generate in place of
        `token` (which is then not needed). `router`: route each request to a node (its replicas
        only) instead of to `addresses` as one pool; `addresses` are then every node's replicas."""
        self.addresses = list(addresses)
        self.model = model
        self.logprobs = LogprobFormatter(model.tokenizer)
        self.max_n = max_n
        self._token = token
        self._forward_keys = forward_keys
        self.router = router
        self.client: ComputeClient | None = None
        self._node_clients: dict[tuple[str, ...], ComputeClient] = {}
        self._health: list[health_pb2_grpc.HealthStub] = []
        self._channels: list[grpc.aio.Channel] = []
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Open the channels (on the running event loop: grpc.aio binds to it)."""
        if self.router is None:  # with a router, each node's replicas have a client of their own
            self.client = ComputeClient(self.addresses, self._token, per_call_credential=self._forward_keys)
        self._channels = [
            grpc.aio.insecure_channel(auth.grpc_target(a), options=RECONNECT) for a in self.addresses
        ]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        if self.router is not None:
            await self.router.start()

    async def close(self) -> None:
        if self.router is not None:
            await self.router.close()
        for client in [self.client, *self._node_clients.values()]:
            if client is not None:
                await client.close()
        for channel in self._channels:
            await channel.close()

    def _client_of(self, state: NodeState) -> ComputeClient:
        """The client over one node's replicas (made on first use; a node's list may change)."""
        key = tuple(state.node.compute)
        client = self._node_clients.get(key)
        if client is None:
            client = ComputeClient(list(key), self._token, per_call_credential=self._forward_keys)
            self._node_clients[key] = client
        return client

    async def healthy_replicas(self) -> list[str]:
        """The replicas whose gRPC health service answers SERVING within HEALTH_TIMEOUT_S."""

        async def serving(stub: health_pb2_grpc.HealthStub) -> bool:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        if not self.addresses and self.router is not None:  # DNS discovery: the nodes that answer now
            now = time.monotonic()
            return [c for s in self.router.states if s.up(now) and s.block_size for c in s.node.compute]
        ok = await asyncio.gather(*(serving(s) for s in self._health))
        return [a for a, good in zip(self.addresses, ok, strict=True) if good]

    def jobs(
        self,
        request_id: str,
        prompts: list[list[int]],
        req: _SamplingRequest,
        max_tokens: int | None,
        default_max_tokens: int | None,
        constraint: Constraint | None = None,
    ) -> list[Job]:
        """One Job per (prompt, sample), checked against the model's context. `constraint`: what
        every output must match (gateway.structured_output, gateway.tools).

        max_tokens: what the client asked for; when None, kvtier.sampling_schema.resolve_max_tokens
        picks the model's default, else `default_max_tokens`, else the rest of the context. A
        seeded request's sample i uses seed + i.
        """
        if not 1 <= req.n <= self.max_n:
            raise bad_request(f"n must be in [1, {self.max_n}], got {req.n}", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        limit = self.model.max_model_len
        jobs: list[Job] = []
        for p, ids in enumerate(prompts):
            if not ids:
                raise bad_request("the prompt is empty", param="prompt")
            try:
                want = resolve_max_tokens(
                    max_tokens, len(ids), limit, self.model.default_max_tokens, default_max_tokens
                )
            except ContextLengthError as e:
                # A prompt that fills the context alone is at fault, whatever max_tokens says.
                prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
                param = prompt_param if e.prompt_alone else "max_tokens"
                raise bad_request(str(e), param=param, code="context_length_exceeded") from None
            for i in range(req.n):
                rid = f"{request_id}-{len(jobs)}"
                request = self._generate_request(rid, ids, req, want, i, constraint)
                jobs.append(Job(len(jobs), p, i, ids, request))
        return jobs

    @staticmethod
    def _generate_request(
        request_id: str, ids: list[int], req: _SamplingRequest, max_tokens: int, sample: int,
        constraint: Constraint | None = None,
    ) -> compute_pb2.GenerateRequest:  # fmt: skip
        # Fields the client left out stay unset: the replica fills in the model's defaults.
        sampling = req.sampling() | {"max_tokens": max_tokens, "logprobs": req.num_logprobs()}
        if req.seed is not None:
            sampling["seed"] = req.seed + sample
        return ComputeClient.request(
            prompt_token_ids=ids,
            stop=req.stop_list(),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=req.logit_bias_ids(),
            request_id=request_id,
            cache_salt=req.cache_salt or "",
            structured_output=None if constraint is None else structured_output.to_proto(constraint),
            **sampling,
        )

    async def open(self, jobs: list[Job], credential: str | None = None, tenant: str = "") -> Streams:
        """Start every job's Generate stream and wait for each one's first reply: sample 0 of
        each prompt first, then the other samples (they hit the prompt's blocks; module doc).

        With a router, the request goes to the node it ranks first; a node none of whose
        replicas answers is marked down and the next one is tried. Raises APIError (400 for a
        request a replica refuses, 503 when no replica answers); every stream already started
        is then cancelled.
        """
        if self.router is None:
            assert self.client is not None, "Engine.start() first"
            return await self._open_on(self.client, jobs, credential)
        try:
            first = jobs[0].request
            route = await self.router.route(jobs[0].prompt_ids, first.cache_salt, tenant, first.request_id)
        except NoNode as e:
            raise no_replica(str(e)) from None
        failure: APIError | None = None
        work = sum(len(job.prompt_ids) if job.sample == 0 else 1 for job in jobs)  # samples > 0 hit
        for state, predicted in zip(route.nodes, route.predicted_tokens, strict=True):
            on_node = self.router.opened(state, predicted, work)  # counted now: routing meanwhile sees it
            try:
                streams = await self._open_on(self._client_of(state), jobs, credential)
            except BaseException as e:
                on_node.closed(None)
                if not isinstance(e, APIError) or e.status != 503:
                    raise
                log.warning("node %s: %s; trying the next node", state.name, e.info.message)
                self.router.mark_down(state)
                failure = e
                continue
            on_node.started()  # every job's first token is in
            streams._on_done = on_node.closed
            return streams
        assert failure is not None
        raise failure

    async def _open_on(self, client: ComputeClient, jobs: list[Job], credential: str | None) -> Streams:
        gens = [client.stream(job.request, credential=credential) for job in jobs]
        firsts: list = [None] * len(jobs)
        for wave in (True, False):
            rows = [i for i, job in enumerate(jobs) if (job.sample == 0) == wave]
            if not rows:
                continue
            if len(rows) == 1:  # one call (n = 1): await it here, no task of its own
                try:
                    got = [await anext(gens[rows[0]])]
                except Exception as e:
                    got = [e]
            else:
                got = await asyncio.gather(*(anext(gens[i]) for i in rows), return_exceptions=True)
            failed = next((r for r in got if isinstance(r, BaseException)), None)
            if failed is not None:
                for gen in gens:
                    await gen.aclose()
                raise _as_api_error(failed)
            for i, reply in zip(rows, got, strict=True):
                firsts[i] = reply
        return Streams(jobs, gens, firsts)

    def close_soon(self, streams: Streams) -> None:
        """Close `streams` from a task of its own (a cancelled HTTP handler cannot await anymore)."""
        task = asyncio.get_running_loop().create_task(streams.aclose())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
