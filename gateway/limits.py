"""Bounded input at the gateway's edge: what a request may hold, checked before any work on it.

In order: the body's size before it is parsed (`BodyLimit`, 413), then every field's size and
range before the prompt is tokenized or anything reaches protobuf (`check_fields`: 413 for a
prompt over its byte limit, 400 naming the field for the rest), then tokenization and chat
rendering on worker threads (`off_loop`), so that one huge or slow request never holds the
event loop that /health and every other request share.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier import sampling_schema
from kvtier.gateway.errors import INVALID_REQUEST, APIError, bad_request
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import ChatCompletionRequest, _SamplingRequest
from kvtier.sampling_schema import BY_NAME, FIELDS, MAX_CACHE_SALT_BYTES, PROMPT_BYTES_PER_TOKEN

MIN_BODY_BYTES = 1 << 20  # the body limit is at least this (a batch of short prompts, a long chat)
# The most of a refused body read and dropped before answering 413 (the client may then see the
# connection close under it instead): a chunked body need not end.
MAX_DROPPED_BYTES = 256 << 20
# NOTE: tokenizers release the GIL while they encode: two threads keep a long prompt from
# delaying short ones, and the event loop never waits for either.
_TOKENIZE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


def too_large(message: str, param: str | None = None) -> APIError:
    return APIError(413, message, INVALID_REQUEST, param, code="request_too_large")


def max_prompt_bytes(model: ServedModel) -> int:
    """The most bytes of text prompt (or of all chat messages' content) a request may hold."""
    return PROMPT_BYTES_PER_TOKEN * model.max_model_len


def max_body_bytes(model: ServedModel) -> int:
    """The largest request body unless --max-body-bytes says: twice the prompt limit (JSON
    escapes, a batch of prompts) and room for the other fields, at least MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, 2 * max_prompt_bytes(model) + (64 << 10))


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 before anything parses it.

    A body that says its length (Content-Length) over the limit is read and dropped, unstored,
    and refused: answering before the client has sent it would reset a connection the client is
    still writing to, which clients report as a network error instead of the 413. A body
    without a length (chunked) is read here, up to the limit, before the app sees it; past the
    limit the rest is read and dropped the same way and the request refused with the same 413
    (raising from inside the app's body reading would become FastAPI's 400 "There was an error
    parsing the body").
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                await _drop_body(receive)
                return await too_large(self._message(int(length), "")).response()(scope, receive, send)
            return await self.app(scope, receive, send)  # the server stops a body at its length
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.max_bytes:
                dropped, more = await _drop_body(receive) if more else (0, False)
                message = self._message(seen + dropped, "at least " if more else "")
                return await too_large(message).response()(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    def _message(self, size: int, at_least: str) -> str:
        return (
            f"the request body is {at_least}{size} bytes; this gateway takes at most {self.max_bytes} "
            "(--max-body-bytes)"
        )


async def _drop_body(receive) -> tuple[int, bool]:
    """Read the rest of a request body, keeping none of it, up to MAX_DROPPED_BYTES: (its bytes
    read, whether more is left)."""
    dropped, more = 0, True
    while more and dropped < MAX_DROPPED_BYTES:
        message = await receive()
        dropped += len(message.get("body", b""))
        more = message["type"] == "http.request" and message.get("more_body", False)
    return dropped, more


def _replay(messages: list[dict], receive):
    """An ASGI `receive` that answers `messages` first, then the server's `receive`."""

    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


def _check_sampling(req: _SamplingRequest) -> None:
    """Every sampling field in its kvtier.sampling_schema range (max_tokens: the engine's
    context rule), named as the request names it."""
    for spec in FIELDS:
        if spec.openai in (None, "max_tokens"):
            continue
        value = getattr(req, spec.openai)
        if value is not None and (message := spec.error(spec.wire(value), name=spec.openai)):
            raise bad_request(message, param=spec.openai)
    name = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    value = getattr(req, name)
    if value is not None and (message := BY_NAME["logprobs"].error(value, name=name)):
        raise bad_request(message, param=name)
    if req.seed is not None and (message := BY_NAME["seed"].error(req.seed + req.n - 1)):
        raise bad_request(f"{message} (seed + n - 1: sample i runs with seed + i)", param="seed")


def _check_strings(req: _SamplingRequest, model: ServedModel) -> None:
    stop_ids = req.stop_token_ids or []
    if message := sampling_schema.stop_error(req.stop_list(), stop_ids, model.vocab_size):
        raise bad_request(message, param="stop_token_ids" if message.startswith("stop_token_ids") else "stop")
    try:
        bias = req.logit_bias_ids()
    except ValueError as e:
        raise bad_request(str(e), param="logit_bias") from None
    if message := sampling_schema.logit_bias_error(bias, model.vocab_size):
        raise bad_request(message, param="logit_bias")
    salt = req.cache_salt or ""
    if "\0" in salt:
        raise bad_request("cache_salt contains a NUL character, which is not allowed", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_BYTES or len(salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise bad_request(f"cache_salt is longer than {MAX_CACHE_SALT_BYTES} bytes", param="cache_salt")


def _check_prompt(req: _SamplingRequest, model: ServedModel) -> None:
    """A text prompt within max_prompt_bytes (413), token ids within the vocabulary (400)."""
    limit, vocab = max_prompt_bytes(model), model.vocab_size
    if isinstance(req, ChatCompletionRequest):
        texts = [m.content if isinstance(m.content, str) else "".join(p.text or "" for p in m.content or [])
                 for m in req.messages]  # fmt: skip
        param = "messages"
    else:
        prompt = req.prompt
        parts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        texts = [p for p in parts if isinstance(p, str)]
        param = "prompt"
        for ids in (p for p in parts if not isinstance(p, str)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param
                )
    # A character is at least one byte: counting characters first bounds the work.
    size = sum(map(len, texts))
    if size <= limit:
        size = sum(len(t.encode()) for t in texts)
    if size > limit:
        raise too_large(
            f"the {param} text is {size} bytes; this model ({model.max_model_len} tokens of context) "
            f"takes at most {limit}",
            param,
        )


def check_model(name: str | None, model: ServedModel) -> None:
    """404 model_not_found unless `name` (a request's `model`) is unset or the served model's."""
    if name is not None and name != model.name:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{model.name}'",
            param="model",
            code="model_not_found",
        )


def check_fields(req: _SamplingRequest, model: ServedModel) -> None:
    """Refuse a request whose fields are out of range or too large, naming the field; before any
    tokenizing and before anything reaches protobuf. Changes nothing."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    _check_sampling(req)
    _check_strings(req, model)
    _check_prompt(req, model)


async def off_loop(fn, *args: Any) -> Any:
    """`fn(*args)` (tokenizing, rendering a chat) on a tokenize thread, not on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, fn, *args)
