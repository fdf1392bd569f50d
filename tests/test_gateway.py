"""The OpenAI-compatible gateway end to end: a real stack (cache service + 2 compute replicas), the
gateway as a real process on a free port, and the official `openai` package (or httpx) as client.

Greedy completions through HTTP are compared with the same prompt's tokens from gRPC Generate;
errors are checked for their status and OpenAI body; a client gone mid-stream must leave no
sequence held in the cache service.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import httpx
import openai
import pytest
from servers import TOKEN, ModuleLoop, cache_stats, child_env, greedy_request, wait_until

from kvtier.api import compute_pb2
from kvtier.cli.stack import LocalStack, start_gateway
from kvtier.compute_client import ComputeClient
from kvtier.gateway.engine import Job, Streams
from kvtier.model_spec import TINY_LLAMA_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOOP = ModuleLoop()
API_KEY = "sk-kvtier-gateway-test"
MODEL = "kvtier-tiny"
BOS = TINY_LLAMA_CONFIG["bos_token_id"]
MAX_MODEL_LEN = TINY_LLAMA_CONFIG["max_position_embeddings"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateway")
    with LocalStack(
        run_dir,
        cache_args=["--num-blocks", "1024", "--lease-ttl", "2"],
        compute_args=["--metrics-port", "0"],
        num_replicas=2,
        env=child_env(run_dir),
        gateway_args=["--api-key", API_KEY],
        gateway_port=0,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def url(stack) -> str:
    return stack.gateway.address


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def grpc_tokens(stack, prompt_ids: list[int], max_tokens: int) -> list[int]:
    async def run():
        c = ComputeClient(stack.compute_addresses, TOKEN)
        try:
            return (await c.complete(greedy_request(prompt_ids, max_tokens))).token_ids
        finally:
            await c.close()

    return LOOP.run(run())


def post(url: str, path: str, body, key: str | None = API_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        headers["content-type"] = "application/json"
        return httpx.post(url + path, content=body, headers=headers, timeout=120)
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def assert_error(reply: httpx.Response, status: int, param: str | None = None, says: str = "") -> dict:
    assert reply.status_code == status, (reply.status_code, reply.text)
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    assert says in error["message"], error
    assert TOKEN not in reply.text
    return error


# --- discovery ---------------------------------------------------------------------------------


def test_models_health_version_and_metrics(client, url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert len(health.json()["replicas"]) == 2
    assert httpx.get(f"{url}/version", timeout=30).json()["version"] == "0.1.0"
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'kvtier_gateway_requests_total{endpoint="/v1/models",status="200"}' in metrics
    assert "_created" not in metrics  # no _created series (vLLM turns them off)
    assert TOKEN not in metrics


# --- completions -------------------------------------------------------------------------------


def test_greedy_completion_equals_grpc_generate(client, stack):
    reply = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt_ids = reply.model_extra["prompt_token_ids"][0]
    assert prompt_ids == [BOS, *b"Once upon a time"]
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    tokens = choice.model_extra["token_ids"]
    assert tokens == grpc_tokens(stack, prompt_ids, 12)
    assert len(tokens) == 12
    assert reply.object == "text_completion" and reply.model == MODEL and reply.id.startswith("cmpl-")
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == len(prompt_ids) + 12
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(
        model=MODEL, prompt="The river", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens == 1 + len("The river")
    assert all(c.usage is None for c in text_chunks)


def test_prompt_forms_give_one_choice_each(client, stack):
    ids_a, ids_b = [BOS, *b"alpha"], [BOS, *b"beta beta"]
    common = dict(
        model=MODEL, max_tokens=4, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    by_text = client.completions.create(prompt=["alpha", "beta beta"], **common)
    by_ids = client.completions.create(prompt=[ids_a, ids_b], **common)
    single_ids = client.completions.create(prompt=ids_b, **common)
    assert by_text.model_extra["prompt_token_ids"] == [ids_a, ids_b] == by_ids.model_extra["prompt_token_ids"]
    assert [c.index for c in by_text.choices] == [0, 1]
    expected = [grpc_tokens(stack, ids_a, 4), grpc_tokens(stack, ids_b, 4)]
    assert [c.model_extra["token_ids"] for c in by_text.choices] == expected
    assert [c.model_extra["token_ids"] for c in by_ids.choices] == expected
    assert single_ids.choices[0].model_extra["token_ids"] == expected[1]
    assert by_text.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert by_text.usage.completion_tokens == 8


def test_n_with_a_seed_is_reproducible_and_sample_i_uses_seed_plus_i(client):
    kwargs = dict(model=MODEL, prompt="Pick a word:", max_tokens=8, temperature=1.0, seed=1234, n=3)
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    second = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1, texts  # three different samples, not one repeated
    alone = client.completions.create(**{**kwargs, "n": 1, "seed": 1235}, extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts[1]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == 1 + len("Pick a word:")
    # Streamed, the three choices interleave; each reassembles to its non-streamed text.
    streamed = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == texts and finished == {0, 1, 2}


def test_repeated_long_prompt_reports_cached_tokens_and_salts_isolate(client):
    prompt = f"{uuid.uuid4().hex} " + "A long shared system prompt that spans many blocks. " * 5
    n_tokens = 1 + len(prompt.encode())
    assert n_tokens > 8 * 16
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert (n_tokens - 1) // 16 * 16 - 16 <= cached < n_tokens, (cached, n_tokens)
    # cache_salt passes through to Generate: another tenant's salt shares nothing.
    salted = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    salted_again = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-b"})
    assert salted_again.usage.prompt_tokens_details.cached_tokens >= cached - 16


def test_stop_strings_and_stop_token_ids_end_the_completion(client, stack):
    ids = [BOS, *b"Stop here"]
    tokens = grpc_tokens(stack, ids, 12)
    # The third greedy token as a stop token: the completion ends with it, finish_reason "stop".
    by_token = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [tokens[2]], "return_token_ids": True, "ignore_eos": True},
    )
    cut = tokens.index(tokens[2]) + 1
    assert by_token.choices[0].model_extra["token_ids"] == tokens[:cut]
    assert by_token.choices[0].finish_reason == "stop"
    whole = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = whole.choices[0].text
    # A stop string: an ASCII character the greedy completion writes (bytes >= 128 decode in pairs).
    ascii_tokens = [t for t in tokens[2:] if 33 <= t < 127]
    if not ascii_tokens:
        print(f"the greedy completion {tokens} has no printable ASCII token; stop strings not checked")
        return
    stop = chr(ascii_tokens[0])
    by_string = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert by_string.choices[0].text == text[: text.index(stop)]
    assert by_string.choices[0].finish_reason == "stop"


# --- chat --------------------------------------------------------------------------------------


def test_chat_renders_the_template_and_equals_grpc_generate(client, stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt_ids = reply.model_extra["prompt_token_ids"]
    assert prompt_ids == [BOS, *b"<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"]
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == grpc_tokens(stack, prompt_ids, 10)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == 10
    # Content given as text parts renders the same.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    again = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].message.content == choice.message.content


def test_streamed_chat_starts_with_the_role_and_equals_the_whole_one(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], seed=3)
    u = reply.usage
    assert 1 <= u.completion_tokens <= MAX_MODEL_LEN - u.prompt_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")


# --- errors ------------------------------------------------------------------------------------


def test_openai_client_raises_the_documented_errors(client, url):
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI's and vLLM's status for an unknown model
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    assert e.value.body["code"] == "model_not_found" and "does not exist" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be in [1,"),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
            "max_tokens",
            "context is 1024 tokens",
        ),
        # The prompt alone fills the context: the prompt is at fault, not max_tokens.
        ("/v1/completions", {"prompt": "y" * MAX_MODEL_LEN, "max_tokens": 1}, "prompt", "1025 prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "z" * MAX_MODEL_LEN}]},
            "messages",
            "",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": "lots"}, "max_tokens", "integer"),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "required"),
        ("/v1/chat/completions", {"messages": []}, "messages", ""),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
        ("/v1/completions", {"prompt": []}, "prompt", "empty"),
        (
            "/v1/completions",
            {"prompt": "x", "temperature": -1},
            "temperature",
            "temperature must be >= 0",
        ),
        ("/v1/completions", {"prompt": [5, 99999]}, "prompt", "outside the vocabulary"),
        # Sampling fields out of range: refused at the gateway (the replica checks again), naming the range.
        (
            "/v1/completions",
            {"prompt": "x", "presence_penalty": 2.5},
            "presence_penalty",
            "presence_penalty must be in [-2, 2]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "frequency_penalty": -3},
            "frequency_penalty",
            "frequency_penalty must be in [-2, 2]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "repetition_penalty": 0},
            "repetition_penalty",
            "repetition_penalty must be > 0",
        ),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 25},
            "top_logprobs",
            "top_logprobs must be in [0, 20]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "top_logprobs",
            "needs logprobs: true",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        (
            "/v1/completions",
            {"prompt": "x", "logit_bias": {"99999": 1}},
            "logit_bias",
            "outside the vocabulary",
        ),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo", "not supported yet"),
    ],
)
def test_bad_requests_answer_400_in_openai_format(url, path, body, param, says):
    error = assert_error(post(url, path, body), 400, param, says)
    assert error["type"] == "invalid_request_error"


def test_neutral_values_of_the_penalties_are_accepted(client):
    reply = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=2,
        presence_penalty=0,
        frequency_penalty=0.0,
        logprobs=None,
        extra_body={"repetition_penalty": 1.0, "min_p": 0.0},
    )
    assert reply.usage.completion_tokens <= 2


def test_malformed_json_and_missing_or_wrong_keys(url):
    assert_error(post(url, "/v1/completions", b'{"prompt": "x",'), 400, says="not valid JSON")
    assert_error(post(url, "/v1/chat/completions", b"[1, 2]"), 400)
    assert_error(post(url, "/v1/completions", {"prompt": "x"}, key=None), 401, says="no API key")
    assert_error(post(url, "/v1/completions", {"prompt": "x"}, key="sk-wrong"), 401, says="incorrect API key")
    assert_error(httpx.get(f"{url}/v1/models", timeout=30), 401)
    assert_error(httpx.get(f"{url}/v1/nothing-here", timeout=30), 404)
    # Health, metrics and version are not behind the key.
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_no_replica_answers_503_and_no_key_means_no_auth(tmp_path):
    dead = [f"unix://{tmp_path}/no-such-replica.sock"]
    gateway = start_gateway(dead, [], tmp_path, child_env(tmp_path), ready_path="/version")
    try:
        health = httpx.get(f"{gateway.address}/health", timeout=30)
        assert health.status_code == 503 and health.json()["replicas"] == []
        reply = post(gateway.address, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None)
        error = assert_error(reply, 503, says="no compute replica is available")
        assert error["type"] == "service_unavailable_error"
        # One log line per failed request (written as the response ends: polled).
        wait_until(
            lambda: "POST /v1/completions -> 503: no compute replica" in gateway.log(), 30, "the 503 logged"
        )
    finally:
        gateway.stop()


# --- streams under load and disconnects ----------------------------------------------------------


def generated_tokens(stack) -> float:
    """Tokens the replicas generated so far (their own Prometheus counters)."""
    total = 0.0
    for replica in stack.replicas:
        port = re.search(r"Prometheus metrics on http://[^:]+:(\d+)/metrics", replica.log()).group(1)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        total += float(re.search(r"^kvtier_compute_generation_tokens_total (\S+)$", text, re.M).group(1))
    return total


def test_a_client_gone_mid_stream_cancels_generate_and_leaves_no_sequence_held(url, stack):
    max_tokens = MAX_MODEL_LEN - 64
    body = {
        "prompt": "A story that goes on and on",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {API_KEY}"}
    before = generated_tokens(stack)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200
        assert 0 < float(reply.headers["x-kvtier-replica-ttft-s"]) < 60  # the replica's own TTFT
        data = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                data.append(json.loads(line[len("data: ") :]))
                if len(data) == 3:
                    break
        assert all(d["choices"][0]["finish_reason"] is None for d in data)
    # The connection is closed: the gateway cancels Generate, the replica aborts the request and
    # frees its sequence before generating all it was asked for.
    wait_until(lambda: cache_stats(stack).num_sequences == 0, 60, "the aborted stream's sequence freed")
    generated = generated_tokens(stack) - before
    print(f"the replicas generated {generated:.0f} of the {max_tokens} tokens asked for before the abort")
    assert 3 <= generated < max_tokens, generated


def test_a_client_gone_before_a_whole_completion_cancels_generate_too(url, stack):
    max_tokens, n = MAX_MODEL_LEN - 64, 8
    body = {"prompt": "Wait for all of it", "max_tokens": max_tokens, "n": n, "ignore_eos": True, "seed": 1}
    headers = {"authorization": f"Bearer {API_KEY}"}
    before = generated_tokens(stack)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=0.5))
    wait_until(lambda: cache_stats(stack).num_sequences == 0, 60, "the abandoned request's sequences freed")
    generated = generated_tokens(stack) - before
    print(f"the replicas generated {generated:.0f} of the {n * max_tokens} tokens asked for before the abort")
    assert n <= generated < n * max_tokens, generated


def test_closing_a_requests_streams_while_they_are_collected_ends_every_one():
    """The HTTP client went away while the n streams of a request were being collected (one pump
    task each): aclose ends every stream, so each one's Generate call is cancelled, and raises
    nothing (a stream a pump is still inside cannot be closed with aclose itself)."""
    n = 4

    async def run() -> list[int]:
        ended: list[int] = []
        inside = [asyncio.Event() for _ in range(n)]

        async def stream(i: int):
            try:
                yield compute_pb2.GenerateResponse(text="a")
                inside[i].set()
                await asyncio.Event().wait()  # a replica that keeps the stream open
                yield compute_pb2.GenerateResponse(text="b")
            finally:
                ended.append(i)

        gens = [stream(i) for i in range(n)]
        firsts = [await anext(g) for g in gens]  # primed, as Engine.open leaves them
        jobs = [Job(i, 0, i, [BOS], compute_pb2.GenerateRequest()) for i in range(n)]
        streams = Streams(jobs, gens, firsts)
        collect = asyncio.ensure_future(streams.collect())
        for event in inside:  # every pump is inside its stream
            await event.wait()
        collect.cancel()
        await streams.aclose()
        return sorted(ended)

    assert LOOP.run(run(), timeout_s=30) == list(range(n))


def test_32_concurrent_streams_all_complete(url):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        text, finish = "", None
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request {i}: tell me something",
            max_tokens=16,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return text, usage.completion_tokens, finish

    async def run():
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = LOOP.run(run(), timeout_s=300)
    assert len(results) == 32
    assert all(finish == "length" and tokens == 16 for _, tokens, finish in results), results
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'kvtier_gateway_time_to_first_token_seconds_count{endpoint="/v1/completions"}' in metrics
