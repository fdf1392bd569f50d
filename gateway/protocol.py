"""The OpenAI HTTP schema the gateway speaks, as pydantic models (the JSON shapes of OpenAI and vLLM).

Requests accept unknown fields and ignore them, as OpenAI-compatible servers do (clients send
newer fields than a server knows). Fields kvtier cannot honour yet are declared, so that a
request setting one to a non-default value gets a clear 400 (`unsupported_fields`) instead of
being silently ignored. Sampling fields left out (None) stay unset on the Generate call: the
replica then applies the model's generation_config.json defaults, else the OpenAI defaults. In responses, the extensions (`token_ids`, `prompt_token_ids`) appear only
when set; every OpenAI field appears, null included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from kvtier import sampling_schema

# --- requests ------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


# The sampling fields both endpoints share, one per kvtier.sampling_schema row with an OpenAI name:
# None = unset (the replica applies the model's default).
_SamplingFields = create_model(
    "_SamplingFields",
    __base__=_Request,
    **{
        spec.openai: (spec.kind | None, Field(default=None, description=spec.doc))
        for spec in sampling_schema.FIELDS
        if spec.openai
    },
)


class _SamplingRequest(_SamplingFields):
    """Fields /v1/completions and /v1/chat/completions share (the sampling ones: _SamplingFields)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM extension")
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    include_stop_str_in_output: bool = Field(
        default=False, description="vLLM extension: the text ends after the stop string, not before"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        default=None, description="vLLM extension: tenant isolation of cached blocks"
    )
    return_token_ids: bool = Field(
        default=False, description="vLLM extension: token ids of the prompt and of each choice"
    )
    # OpenAI's: token id (a JSON object's keys are strings) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None

    def unsupported_fields(self) -> dict[str, Any]:
        """{field: value} of the fields set to something kvtier cannot do yet."""
        return {}

    def logit_bias_ids(self) -> dict[int, float]:
        """logit_bias with int keys; ValueError naming a key that is not a token id."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
            out[int(key)] = value
        return out

    def num_logprobs(self) -> int | None:
        """Top alternatives per token to return (SamplingParams.logprobs); None = no logprobs."""
        return None

    def sampling(self) -> dict[str, Any]:
        """{sampling_schema field: wire value} of the shared sampling fields the client set."""
        out = {}
        for spec in sampling_schema.FIELDS:
            value = getattr(self, spec.openai) if spec.openai else None
            if value is not None:
                out[spec.name] = spec.wire(value)
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, token ids, or a list of token-id lists (one completion each).
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echo_text(self, index: int, ids: list[int], decode: Callable[..., str]) -> str:
        """What `echo` puts before the completion of prompt `index` (token ids `ids`): the prompt
        as sent when it is text, else its ids decoded (without special tokens)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt[index], str):
            return prompt[index]
        return decode(ids, skip_special_tokens=True)

    def unsupported_fields(self) -> dict[str, Any]:
        out = super().unsupported_fields()
        if self.echo and self.logprobs is not None:  # the prompt's logprobs are not computed
            out["echo"] = "true with logprobs"
        if self.suffix:
            out["suffix"] = self.suffix
        if self.best_of not in (None, 1, self.n):
            out["best_of"] = self.best_of
        return out


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # gateway.tools
    tool_choice: str | dict[str, Any] | None = None  # None = "auto" with tools, "none" without
    response_format: dict[str, Any] | None = None  # gateway.structured_output (completions: an extra)
    add_generation_prompt: bool = Field(default=True, description="vLLM extension")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM extension")

    def num_logprobs(self) -> int | None:
        # OpenAI: top_logprobs (0..20) counts only with logprobs: true (checked by the app).
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses -----------------------------------------------------------------------------------


def _extension(description: str) -> Any:
    """An optional response field left out of the JSON when unset (None)."""
    return Field(default=None, exclude_if=lambda v: v is None, description=description)


class _Response(BaseModel):
    def json_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class CompletionLogprobs(_Response):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    # {token text: logprob} of the `logprobs` most likely tokens and the sampled one.
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # characters from the start of the completion text to each token's


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = _extension("vLLM extension (return_token_ids): this choice's token ids")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[list[int]] | None = _extension("vLLM extension (return_token_ids)")


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely tokens, most likely first


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = _extension("vLLM extension (return_token_ids): this choice's token ids")


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = _extension("vLLM extension (return_token_ids)")


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = _extension("vLLM extension (return_token_ids): this choice's token ids")


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvtier"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    """vLLM's /tokenize body for a completion prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """vLLM's /tokenize body for a conversation (rendered with the chat template, as chat is)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# --- fast stream chunks --------------------------------------------------------------------------


class ChunkTemplate:
    """One response model serialized once with placeholders, filled in per stream chunk.

    A stream sends one chunk per token; building and validating the pydantic model for each costs
    more than the rest of the gateway's work on it. The template is the model's own JSON (so the
    shape stays the schema's), made once per app and shape from a `model_construct`ed instance
    whose variable fields hold sentinel strings, cut at the sentinels; `fill` binds a request's
    own fields (id, created) once, and `render` joins the pieces with each value's JSON.
    """

    def __init__(self, build, fields: tuple[str, ...]):
        """build(**{field: sentinel}) -> the model, constructed (no validation) around the sentinels."""
        raw = build(**{name: f"\x00{name}\x00" for name in fields}).model_dump_json(warnings=False).encode()
        at = []
        for name in fields:
            placeholder = json.dumps(f"\x00{name}\x00").encode()
            if raw.count(placeholder) != 1:
                raise ValueError(f"field {name!r} appears {raw.count(placeholder)} times in {raw!r}")
            at.append((raw.index(placeholder), name, len(placeholder)))
        raw = b"data: " + raw + b"\n\n"
        self._names: tuple[str, ...] = ()
        self._parts: list[bytes] = []
        start = 0
        for pos, name, length in sorted(at):
            self._parts.append(raw[start : pos + 6])  # 6: the b"data: " before the JSON
            self._names += (name,)
            start = pos + 6 + length
        self._parts.append(raw[start:])

    def fill(self, **values: Any) -> ChunkTemplate:
        """A copy with these fields filled in for good (a request's id and creation time)."""
        out = ChunkTemplate.__new__(ChunkTemplate)
        out._names, out._parts = (), [self._parts[0]]
        for name, part in zip(self._names, self._parts[1:], strict=True):
            if name in values:
                out._parts[-1] += _json(values[name]) + part
            else:
                out._names += (name,)
                out._parts.append(part)
        return out

    def render(self, **values: Any) -> bytes:
        """The Server-Sent Event of the chunk with these values (`data: {json}\\n\\n`): every
        field not filled in."""
        parts = self._parts
        out = [parts[0]]
        for name, part in zip(self._names, parts[1:]):  # noqa: B905 - one part more than names
            out.append(_json(values[name]))
            out.append(part)
        return b"".join(out)


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_encode_str = json.encoder.encode_basestring  # = json.dumps(s, ensure_ascii=False), in C


def _json(value: Any) -> bytes:
    if value is None:
        return b"null"
    if isinstance(value, str):
        return _encode_str(value).encode()
    if type(value) is int:  # not a bool: the encoder writes those as true/false
        return str(value).encode()
    return _ENCODER.encode(value).encode()
