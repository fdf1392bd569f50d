"""The FastAPI app: routes, API-key check, Server-Sent Events, per-request metrics and failure logs."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvtier
from kvtier.api_keys import ApiKeys
from kvtier.gateway import errors, limits
from kvtier.gateway.engine import Engine, Streams, usage_of
from kvtier.gateway.errors import APIError, bad_request, unsupported
from kvtier.gateway.limits import BodyLimit, check_fields, check_model, off_loop
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    _SamplingRequest,
)
from kvtier.gateway.router import Router
from kvtier.gateway.streaming import ChatEvents, CompletionEvents, Events
from kvtier.gateway.structured_output import constraint_of, with_param
from kvtier.gateway.tokenize import tokenize_routes
from kvtier.gateway.tools import (
    DEFAULT_PARSER,
    ToolChatEvents,
    ToolOutput,
    ToolPlan,
    calls_for_template,
    plan_tools,
)

log = logging.getLogger("kvtier.gateway")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = frozenset(
    {COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics", "/version", "/tokenize", "/detokenize"}
)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REPLICA_TTFT_HEADER = "x-kvtier-replica-ttft-s"  # on streamed responses: seconds, as the replica measured


class MetricsAndLogs:
    """ASGI middleware: counts and times every request to its last byte (a stream's end), and logs
    one line per failed request with the error message it answered."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status, body = 500, b""

        async def capture(message):
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < 4096:
                body += message.get("body", b"")
            await send(message)

        crash = None
        try:
            await self.app(scope, receive, capture)
        except Exception as e:  # answered with a 500 by Starlette's outermost middleware
            crash = e
            raise
        finally:
            self.metrics.observe(endpoint, status, time.monotonic() - start)
            if status >= 400 or crash is not None:
                try:
                    message = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = body[:200].decode(errors="replace") or repr(crash)
                log.warning("%s %s -> %d: %s", scope["method"], path, status, message)


def create_app(
    addresses: list[str],
    model: ServedModel,
    api_key: str | None = None,
    max_n: int = 16,
    token: str | None = None,
    keys: ApiKeys | None = None,
    router: Router | None = None,
    metrics: GatewayMetrics | None = None,
    tool_call_parser: str = DEFAULT_PARSER,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """`api_key`: the one key /v1 requests need (calls go on with the node `token`). `keys`:
    client API keys per tenant (kvtier.api_keys); each request's own key is checked here and
    forwarded to Generate, so the replica charges that key's tenant and no node token is needed.
    `router`: route each request to one node's replicas (gateway.router). `tool_call_parser`:
    how tool calls are read from the output under tool_choice auto (gateway.tools.PARSERS).
    `max_body_bytes`: the largest request body (None: gateway.limits.max_body_bytes of the model)."""
    engine = Engine(addresses, model, max_n, token, forward_keys=keys is not None, router=router)
    metrics = metrics if metrics is not None else GatewayMetrics()  # the router's counters live there too

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="kvtier gateway", version=kvtier.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    errors.install(app)
    body_limit = max_body_bytes or limits.max_body_bytes(model)
    app.add_middleware(BodyLimit, max_bytes=body_limit)  # inside MetricsAndLogs: counted
    app.add_middleware(MetricsAndLogs, metrics=metrics)

    api = OpenAIRoutes(engine, model, metrics, tool_call_parser)
    keyed = [Depends(ApiKeyCheck(api_key, keys))]
    app.include_router(tokenize_routes(model, chat_prompt), dependencies=keyed)
    app.get("/health")(api.health)
    app.get("/metrics")(api.prometheus)
    app.get("/version")(api.version)
    app.get("/v1/models", dependencies=keyed)(api.models)
    app.post(COMPLETIONS, dependencies=keyed)(api.completions)
    app.post(CHAT, dependencies=keyed)(api.chat_completions)
    return app


class ApiKeyCheck:
    """Who may call /v1: one shared `api_key`, client `keys` per tenant, or anyone (neither)."""

    def __init__(self, api_key: str | None, keys: ApiKeys | None) -> None:
        self.api_key, self.keys = api_key, keys

    async def __call__(self, request: Request) -> None:
        api_key, keys = self.api_key, self.keys
        if api_key is None and keys is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401, "no API key given: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        if keys is not None:
            tenant = keys.tenant_of(key)
            if tenant is None:
                raise APIError(401, "incorrect API key provided", code="invalid_api_key")
            request.state.api_key = key  # forwarded to Generate
            request.state.tenant = tenant  # the router names the tenant's blocks with it
        elif not hmac.compare_digest(key.encode(), api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")


class OpenAIRoutes:
    """The handlers of the gateway's routes (`create_app` registers each on its path)."""

    def __init__(
        self,
        engine: Engine,
        model: ServedModel,
        metrics: GatewayMetrics,
        tool_call_parser: str,
    ) -> None:
        self.engine, self.model, self.metrics = engine, model, metrics
        self.tool_call_parser = tool_call_parser

    def check_request(self, req: _SamplingRequest) -> None:
        check_model(req.model, self.model)
        check_fields(req, self.model)
        if bad := req.unsupported_fields():
            raise unsupported(bad)
        if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")

    async def health(self) -> Response:
        serving = await self.engine.healthy_replicas()
        body = {
            "status": "ok" if serving else "unavailable",
            "replicas": serving,
            "of": len(self.engine.addresses),
        }
        return Response(json.dumps(body), status_code=200 if serving else 503, media_type="application/json")

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> dict:
        return {"version": kvtier.__version__}

    async def models(self) -> Response:
        model = self.model
        card = ModelCard(id=model.name, root=model.root or model.name, max_model_len=model.max_model_len)
        return json_response(ModelList(data=[card]).json_bytes())

    async def generate(
        self, endpoint: str, req: _SamplingRequest, raw: Request, arrival: float, prompts: list[list[int]],
        rid: str, max_tokens: int | None, default_max_tokens: int | None, events: type[Events], respond,
        constraint=None,
    ) -> Response:  # fmt: skip
        """Run the request's Generate streams; answer with their events (stream) or `respond(...)`.
        `constraint`: what every output must match (kvtier.structured_output.Constraint)."""
        engine, metrics = self.engine, self.metrics
        jobs = engine.jobs(rid, prompts, req, max_tokens, default_max_tokens, constraint)
        try:
            streams = await engine.open(
                jobs, getattr(raw.state, "api_key", None), getattr(raw.state, "tenant", "")
            )
        except APIError as e:  # a constraint the replica could not compile: name its field
            raise with_param(e, constraint) from None
        metrics.time_to_first_token.labels(endpoint).observe(time.monotonic() - arrival)
        created = int(time.time())
        if req.stream:
            body = events(streams, engine, metrics, req, rid, created, self.model.name)
            # The replica's own TTFT: a client subtracts it from what it measured to see the path's share.
            headers = {REPLICA_TTFT_HEADER: f"{streams.replica_ttft_s:.6f}"}
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        choices = await until_done_or_gone(streams, raw, engine)
        usage = usage_of(jobs, choices)
        metrics.tokens(
            usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens
        )
        ids = {"token_ids"} if req.return_token_ids else set()
        return json_response(respond(rid, created, choices, usage, ids).json_bytes())

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_request(req)
        model, engine = self.model, self.engine
        prompts = await off_loop(completion_prompts, req.prompt, model)

        def echo(index: int) -> str:  # choice `index` is of prompt index // n
            p = index // req.n
            return req.echo_text(p, prompts[p], model.tokenizer.decode) if req.echo else ""

        def respond(rid, created, choices, usage, ids) -> CompletionResponse:
            return CompletionResponse(
                id=rid,
                created=created,
                model=model.name,
                choices=[
                    CompletionChoice(
                        index=c.index,
                        text=echo(c.index) + c.text,
                        finish_reason=c.finish_reason,
                        logprobs=engine.logprobs.completion(c.token_ids, c.logprobs)[0]
                        if req.logprobs is not None
                        else None,
                    ).model_copy(update={k: c.token_ids for k in ids})
                    for c in choices
                ],
                usage=usage,
                prompt_token_ids=prompts if ids else None,
            )

        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self.generate(
            COMPLETIONS, req, raw, arrival, prompts, rid, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
            CompletionEvents, respond, constraint_of(req),
        )  # fmt: skip

    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_request(req)
        model, engine = self.model, self.engine
        plan = plan_tools(req.tools, req.tool_choice, self.tool_call_parser)
        constraint = constraint_of(req)
        if plan.constraint is not None and constraint is not None:
            raise bad_request(f"tool_choice {plan.mode} constrains the output already; unset {constraint.param}",
                              param=constraint.param)  # fmt: skip
        prompt = await off_loop(chat_prompt, req, model, plan.tools)

        def respond(rid, created, choices, usage, ids) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=rid,
                created=created,
                model=model.name,
                choices=[
                    ChatChoice(
                        index=c.index,
                        **tool_message(plan, c.text, c.finish_reason),
                        logprobs=engine.logprobs.chat(c.token_ids, c.logprobs) if req.logprobs else None,
                    ).model_copy(update={k: c.token_ids for k in ids})
                    for c in choices
                ],
                usage=usage,
                prompt_token_ids=prompt if ids else None,
            )

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events = partial(ToolChatEvents, plan) if plan.active else ChatEvents
        return await self.generate(
            CHAT, req, raw, arrival, [prompt], rid, req.requested_max_tokens, None, events, respond,
            plan.constraint or constraint,
        )  # fmt: skip


def json_response(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def completion_prompts(prompt: str | list, model: ServedModel) -> list[list[int]]:
    """The prompts of a /v1/completions request as token-id lists (strings are tokenized here)."""
    if isinstance(prompt, str):
        return [model.encode(prompt)]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [model.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def tool_message(plan: ToolPlan, text: str, finish_reason: str | None) -> dict:
    """A chat choice's `message` and `finish_reason`: with tools, content and tool calls apart."""
    if not plan.active:
        return {"message": AssistantMessage(content=text), "finish_reason": finish_reason}
    content, calls, reason = ToolOutput(plan).whole(text, finish_reason)
    return {"message": AssistantMessage(content=content, tool_calls=calls), "finish_reason": reason}


def chat_prompt(req: ChatCompletionRequest, model: ServedModel, tools: list[dict] | None = None) -> list[int]:
    """The conversation's token ids; `tools` go to the chat template (and tool calls and results
    in the messages, as they came)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                kinds = sorted({part.type for part in content if part.type != "text"})
                raise bad_request(
                    f"message {i} has {', '.join(kinds)} content: only text is supported",
                    param=f"messages.{i}.content",
                    code="unsupported_parameter",
                )
            content = "\n".join(part.text or "" for part in content)
        messages.append({"role": m.role, "content": content or ""} | _tool_fields(m, i))
    kwargs = (req.chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
    try:
        return model.render_chat(messages, req.add_generation_prompt, kwargs)
    except Exception as e:  # jinja errors from the model's own template (raise_exception in it, ...)
        raise bad_request(f"the chat template cannot render these messages: {e}", param="messages") from e


def _tool_fields(message, i: int) -> dict:
    """An assistant message's `tool_calls` (arguments as objects) and a tool message's
    `tool_call_id` and `name`, for the template; `i`: the message's index, named in errors."""
    extra = {k: v for k, v in (message.model_extra or {}).items() if k in ("tool_calls", "tool_call_id")}
    if extra.get("tool_calls") is not None:
        extra["tool_calls"] = calls_for_template(extra["tool_calls"], f"messages.{i}.tool_calls")
    return extra | ({"name": message.name} if message.name else {})


async def until_done_or_gone(streams: Streams, raw: Request, engine: Engine):
    """Collect every choice; if the client disconnects first, or one stream fails, cancel the
    Generate calls still running."""
    collect = asyncio.ensure_future(streams.collect())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
        if collect.cancelled() or not collect.done() or collect.exception() is not None:
            engine.close_soon(streams)
    if not collect.done() or collect.cancelled():
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return collect.result()  # raises the failed stream's APIError


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
