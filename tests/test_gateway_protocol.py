"""The gateway's schema pieces without a server: stream chunks rendered from a template must be the
pydantic model's own JSON, and request checks name what they refuse."""

from __future__ import annotations

import json

import pytest

from kvtier.gateway.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    ChunkTemplate,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
)

TEXTS = [
    "",
    "plain",
    'quotes " and \\ backslash',
    "line\nbreak\ttab",
    "héllo wörld ✓ \ufffd",
    "\x00nul\x01",
    '"\x00text\x00"',
]


def completion(index, text, finish_reason, token_ids=None, construct=False, logprobs=None):
    make_choice = CompletionChoice.model_construct if construct else CompletionChoice
    make = CompletionResponse.model_construct if construct else CompletionResponse
    choice = make_choice(
        index=index, text=text, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids
    )
    return make(id="cmpl-1", object="text_completion", created=7, model="m", choices=[choice], usage=None)


def chat(index, text, finish_reason, token_ids=None, construct=False, logprobs=None):
    make_choice = ChatChunkChoice.model_construct if construct else ChatChunkChoice
    delta = (DeltaMessage.model_construct if construct else DeltaMessage)(content=text, role=None)
    choice = make_choice(
        index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs, token_ids=token_ids
    )
    make = ChatCompletionChunk.model_construct if construct else ChatCompletionChunk
    return make(
        id="chat-1", object="chat.completion.chunk", created=7, model="m", choices=[choice], usage=None
    )


@pytest.mark.parametrize("build", [completion, chat])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
@pytest.mark.parametrize("token_ids", [None, [], [1, 257, 4095]])
def test_template_chunks_equal_the_models_own_json(build, text, finish_reason, token_ids):
    fields = ("index", "text", "finish_reason") + (() if token_ids is None else ("token_ids",))
    template = ChunkTemplate(lambda **kw: build(construct=True, **kw), fields)
    values = {"index": 3, "text": text, "finish_reason": finish_reason}
    if token_ids is not None:
        values["token_ids"] = token_ids
    event = template.render(**values)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    expected = build(3, text, finish_reason, token_ids).model_dump_json()
    assert json.loads(event[6:-2]) == json.loads(expected)
    assert list(json.loads(event[6:-2])) == list(json.loads(expected))  # same keys in the same order


@pytest.mark.parametrize("build", [completion, chat])
def test_a_template_made_once_and_filled_per_request_renders_each_requests_own_json(build):
    """The gateway makes one template per shape and fills a request's id and created into it."""

    def make(index, text, finish_reason, id, created):  # noqa: A002 - the model's field names
        return build(index, text, finish_reason, construct=True).model_copy(
            update={"id": id, "created": created}
        )

    shared = ChunkTemplate(make, ("id", "created", "index", "text", "finish_reason"))
    for rid, created in (("cmpl-a", 1), ('odd "id"\n', 1_900_000_000)):
        event = shared.fill(id=rid, created=created).render(index=2, text="x\u00e9", finish_reason="stop")
        expected = build(2, "x\u00e9", "stop").model_copy(update={"id": rid, "created": created})
        assert json.loads(event[6:-2]) == json.loads(expected.model_dump_json())
    assert (
        shared.fill(id="r", created=1)
        .render(index=0, text="", finish_reason=True)
        .count(b'"finish_reason":true')
    )


def test_unsupported_fields_are_named_only_off_their_defaults():
    defaults = CompletionRequest(
        prompt="x", presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0
    )
    assert defaults.unsupported_fields() == {}
    bad = CompletionRequest(
        prompt="x", presence_penalty=0.5, logprobs=0, echo=True, best_of=3, logit_bias={"1": 2.0}
    )
    assert bad.unsupported_fields() == {"echo": "true with logprobs", "best_of": 3}  # logit_bias is served
    assert bad.logit_bias_ids() == {1: 2.0}
    assert bad.num_logprobs() == 0
    chat_req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    assert chat_req.unsupported_fields() == {}  # structured outputs are served (gateway.structured_output)
    assert chat_req.num_logprobs() == 2
    assert (
        ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], logprobs=False
        ).unsupported_fields()
        == {}
    )


def test_logprobs_mapping_of_both_endpoints():
    messages = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=messages).num_logprobs() is None
    assert ChatCompletionRequest(messages=messages, logprobs=True).num_logprobs() == 0
    assert ChatCompletionRequest(messages=messages, logprobs=False, top_logprobs=3).num_logprobs() is None
    assert CompletionRequest(prompt="x").num_logprobs() is None
    assert CompletionRequest(prompt="x", logprobs=5).num_logprobs() == 5


COMPLETION_LOGPROBS = CompletionLogprobs(
    tokens=["a", '\u00e9"'],
    token_logprobs=[-0.5, -1.25],
    top_logprobs=[{"a": -0.5, "b": -2.0}, {'\u00e9"': -1.25}],
    text_offset=[0, 1],
)
CHAT_LOGPROBS = ChatLogprobs(
    content=[
        ChatTokenLogprob(
            token="é",
            logprob=-0.75,
            bytes=[195, 169],
            top_logprobs=[TopLogprob(token="x", logprob=-0.5, bytes=[120])],
        )
    ]
)


@pytest.mark.parametrize(
    ("build", "logprobs"),
    [(completion, COMPLETION_LOGPROBS), (chat, CHAT_LOGPROBS)],
    ids=["completion", "chat"],
)
def test_template_chunks_with_logprobs_equal_the_models_own_json(build, logprobs):
    template = ChunkTemplate(
        lambda **kw: build(construct=True, **kw), ("index", "text", "finish_reason", "logprobs")
    )
    event = template.render(index=1, text="a\u00e9", finish_reason=None, logprobs=logprobs.model_dump())
    expected = build(1, "a\u00e9", None, logprobs=logprobs).model_dump_json()
    assert json.loads(event[6:-2]) == json.loads(expected)
    assert list(json.loads(event[6:-2])) == list(json.loads(expected))


def test_chat_max_tokens_prefers_max_completion_tokens():
    messages = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(messages=messages, max_tokens=5).requested_max_tokens == 5
    assert (
        ChatCompletionRequest(messages=messages, max_tokens=5, max_completion_tokens=9).requested_max_tokens
        == 9
    )
    assert ChatCompletionRequest(messages=messages).requested_max_tokens is None


@pytest.mark.parametrize(
    ("code", "details", "status"),
    [
        ("INVALID_ARGUMENT", "temperature must be >= 0", 400),
        ("UNAVAILABLE", "replica restarting", 503),
        ("RESOURCE_EXHAUSTED", "no free blocks", 503),
        ("RESOURCE_EXHAUSTED", "the request is 200000 bytes, over this method's limit of 92160 bytes", 413),
        ("RESOURCE_EXHAUSTED", "Received message larger than max (4194404 vs. 4194304)", 413),  # grpc's own
        ("UNAUTHENTICATED", "missing or wrong credential", 401),
        ("INTERNAL", "boom", 500),
    ],
)
def test_a_replica_status_becomes_the_http_status_a_client_can_act_on(code, details, status) -> None:
    import grpc
    from grpc.aio import AioRpcError, Metadata

    from kvtier.gateway.errors import from_grpc

    error = from_grpc(AioRpcError(getattr(grpc.StatusCode, code), Metadata(), Metadata(), details))
    assert error.status == status
    if status in (400, 413):
        assert details in error.info.message


@pytest.mark.parametrize(
    ("details", "param"),
    [
        ("temperature must be >= 0 (0 = greedy), got -1.0", "temperature"),
        ("stop_token_ids entry 70000 is outside the vocabulary [0, 258)", "stop_token_ids"),
        ("prompt_token_ids [99999] are outside the vocabulary [0, 258)", "prompt"),
        ("cache_salt is longer than 256 bytes", "cache_salt"),
        ("request r-1: refused by the cache", None),
    ],
)
def test_a_replica_refusal_names_the_request_field_at_fault(details, param) -> None:
    import grpc
    from grpc.aio import AioRpcError, Metadata

    from kvtier.gateway.errors import from_grpc

    error = from_grpc(AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, Metadata(), Metadata(), details))
    assert (error.status, error.info.param, error.info.message) == (400, param, details)
