"""Server-Sent Events of streamed completions: a chunk per Generate reply, then [DONE]."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel

from kvtier.gateway.engine import Choice, Engine, Job, Streams, usage_of
from kvtier.gateway.errors import APIError
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChunkTemplate,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)

log = logging.getLogger("kvtier.gateway")

DONE = b"data: [DONE]\n\n"
_TEMPLATES: dict[tuple, ChunkTemplate] = {}  # (Events class, fields, include_usage, model name) -> template


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class Events:
    """The SSE body of one streamed request: a chunk per Generate reply, a usage chunk when asked,
    then [DONE]. An error after the status was sent becomes an error event before [DONE]."""

    def __init__(
        self,
        streams: Streams,
        engine: Engine,
        metrics: GatewayMetrics,
        req,
        rid: str,
        created: int,
        name: str,
    ):
        self.streams, self.engine, self.metrics, self.req = streams, engine, metrics, req
        self.head = {"id": rid, "created": created, "model": name}
        if req.include_usage:
            self.head["usage"] = None  # every chunk says usage: null; the last one carries it
        self.with_logprobs = req.num_logprobs() is not None
        fields = ("index", "text", "finish_reason") + (("token_ids",) if req.return_token_ids else ())
        fields += ("logprobs",) if self.with_logprobs else ()
        # The template of this shape is made once (per app: the model's name is in the key).
        key = (type(self), fields, req.include_usage, name)
        template = _TEMPLATES.get(key)
        if template is None:
            template = _TEMPLATES[key] = ChunkTemplate(self.build_chunk, ("id", "created", *fields))
        self.template = template.fill(id=rid, created=created)
        self.text_offsets = [0] * len(streams.jobs)  # completions' text_offset, per choice

    def build_chunk(self, **values) -> BaseModel:
        """The chunk of one reply (model_construct: `values` may be ChunkTemplate's sentinels,
        `id` and `created` among them)."""
        raise NotImplementedError

    def first_chunks(self) -> list[bytes]:
        return []

    def usage_chunk(self, usage: Usage) -> bytes:
        raise NotImplementedError

    def chunk(self, job: Job, reply) -> bytes:
        values = {"index": job.index, "text": reply.text, "finish_reason": reply.finish_reason or None}
        if self.req.return_token_ids:
            values["token_ids"] = list(reply.token_ids)
        if self.with_logprobs:
            values["logprobs"] = self.chunk_logprobs(job, reply)
        return self.template.render(**values)

    def chunk_logprobs(self, job: Job, reply) -> dict:
        """The logprobs of one reply's tokens, as JSON-ready data of this endpoint's shape."""
        raise NotImplementedError

    async def __aiter__(self) -> AsyncIterator[bytes]:
        choices = [Choice(job.index) for job in self.streams.jobs]
        finished = False
        try:
            for event in self.first_chunks():
                yield event
            async for job, reply in self.streams:
                if reply.finish_reason:  # usage needs only the last reply's (no text kept per token)
                    choices[job.index].add(reply)
                yield self.chunk(job, reply)
            finished = True
            usage = usage_of(self.streams.jobs, choices)
            self.metrics.tokens(
                usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens
            )
            if self.req.include_usage:
                yield self.usage_chunk(usage)
            yield DONE
        except APIError as e:
            log.warning("a stream failed after its first token: %s", e.message)
            yield sse(e.body())
            yield DONE
        finally:
            if not finished:  # the client went away (or the stream failed): stop the Generate calls
                self.engine.close_soon(self.streams)


class CompletionEvents(Events):
    def first_chunks(self) -> list[bytes]:
        """With `echo`, each choice's prompt text first, as vLLM streams it."""
        if not self.req.echo:
            return []
        decode = self.engine.model.tokenizer.decode
        values = {"token_ids": []} if self.req.return_token_ids else {}
        return [
            self.template.render(
                index=job.index,
                text=self.req.echo_text(job.prompt_index, job.prompt_ids, decode),
                finish_reason=None,
                **values,
            )
            for job in self.streams.jobs
        ]

    def build_chunk(self, text, finish_reason, index, token_ids=None, logprobs=None, **head) -> BaseModel:
        choice = CompletionChoice.model_construct(
            index=index, text=text, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids
        )
        return CompletionResponse.model_construct(
            choices=[choice], object="text_completion", **(self.head | head)
        )

    def chunk_logprobs(self, job: Job, reply) -> dict:
        out, self.text_offsets[job.index] = self.engine.logprobs.completion(
            reply.token_ids, reply.logprobs, self.text_offsets[job.index]
        )
        return out.model_dump()

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse(CompletionResponse(choices=[], **(self.head | {"usage": usage})).json_bytes())


class ChatEvents(Events):
    def first_chunks(self) -> list[bytes]:
        """The assistant's role, once per choice, as OpenAI's streams begin."""
        return [
            sse(
                ChatCompletionChunk(
                    choices=[
                        ChatChunkChoice(
                            index=job.index,
                            delta=DeltaMessage(role="assistant", content=""),
                            finish_reason=None,
                            logprobs=None,
                        )
                    ],
                    **self.head,
                ).json_bytes()
            )
            for job in self.streams.jobs
        ]

    def build_chunk(self, text, finish_reason, index, token_ids=None, logprobs=None, **head) -> BaseModel:
        choice = ChatChunkChoice.model_construct(
            index=index,
            delta=DeltaMessage.model_construct(content=text, role=None),
            finish_reason=finish_reason,
            logprobs=logprobs,
            token_ids=token_ids,
        )
        return ChatCompletionChunk.model_construct(
            choices=[choice], object="chat.completion.chunk", **(self.head | head)
        )

    def chunk_logprobs(self, job: Job, reply) -> dict:
        return self.engine.logprobs.chat(reply.token_ids, reply.logprobs).model_dump()

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse(ChatCompletionChunk(choices=[], **(self.head | {"usage": usage})).json_bytes())
