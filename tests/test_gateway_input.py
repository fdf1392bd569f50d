"""The gateway's edge (issue 26): stop strings that never leak, bounded input, exact errors,
/tokenize and /detokenize. A real stack (cache service + 1 compute replica; conftest's
`edge_gateway`, shared with tests/test_structured_output.py), the gateway as a real process, the
official `openai` client (or httpx for raw bodies)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from servers import EDGE_API_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = EDGE_API_KEY
MODEL = "kvtier-tiny"


@pytest.fixture(scope="module")
def url(edge_gateway) -> str:
    return edge_gateway.gateway.address


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body, timeout: float = 120) -> httpx.Response:
    headers = {"authorization": f"Bearer {API_KEY}"}
    if isinstance(body, bytes):
        headers["content-type"] = "application/json"
        return httpx.post(url + path, content=body, headers=headers, timeout=timeout)
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


# --- stop strings ------------------------------------------------------------------------------

ISSUE_EXAMPLE = {"prompt": "aaaaaaaaaaaaaaaa", "max_tokens": 64, "temperature": 0}


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_never_leaks_its_start_streamed_or_not(client, include):
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    whole = client.completions.create(model=MODEL, **ISSUE_EXAMPLE, extra_body={"ignore_eos": True})
    full = whole.choices[0].text
    assert "gB" in full, f"the greedy completion {full!r} no longer holds the issue's stop string"
    reply = client.completions.create(model=MODEL, **ISSUE_EXAMPLE, stop="gB", extra_body=extra)
    want = full[: full.index("gB") + (2 if include else 0)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == want
    if not include:
        assert want == "B\ufffd"  # issue 26's example: "B\ufffdg" before
    chunks = list(
        client.completions.create(model=MODEL, **ISSUE_EXAMPLE, stop="gB", stream=True, extra_body=extra)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- bounded input -----------------------------------------------------------------------------


def assert_error(reply: httpx.Response, status: int, param: str | None, says: str) -> dict:
    assert reply.status_code == status, (reply.status_code, reply.text)
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"], error
    return error


def test_a_16_mib_prompt_is_refused_at_once_while_health_answers(url):
    body = json.dumps({"model": MODEL, "prompt": "a" * (16 << 20), "max_tokens": 1}).encode()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        refused = pool.submit(post, url, "/v1/completions", body)
        health = [httpx.get(f"{url}/health", timeout=30) for _ in range(3)]
        reply = refused.result()
        took = time.monotonic() - start
    print(f"16 MiB body refused in {took:.3f} s")
    assert_error(reply, 413, None, "this gateway takes at most")
    assert took < 10, took  # the tokenizer on the event loop took 26 s here (issue 26)
    assert all(h.status_code == 200 for h in health)


def _prompt_tokens_served(url: str) -> float:
    """The gateway's count of prompt tokens it has served (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvtier_gateway_prompt_tokens_total")
    )


@pytest.mark.parametrize("mib", [2, 32])
def test_a_chunked_body_over_the_limit_is_a_413_like_one_with_a_length(url, client, mib):
    def chunks():  # no Content-Length: httpx sends a generator's body chunked
        yield b'{"model": "kvtier-tiny", "max_tokens": 1, "prompt": "'
        for _ in range(mib * 16):
            yield b"a" * (64 << 10)
        yield b'"}'

    served = _prompt_tokens_served(url)
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    reply = httpx.post(f"{url}/v1/completions", content=chunks(), headers=headers, timeout=120)
    assert reply.request.headers.get("transfer-encoding") == "chunked"
    error = assert_error(reply, 413, None, "this gateway takes at most 1048576 (--max-body-bytes)")
    assert error["code"] == "request_too_large"
    assert _prompt_tokens_served(url) == served  # nothing reached a replica
    small = client.completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert small.choices[0].text is not None and _prompt_tokens_served(url) > served
    within = httpx.post(  # a chunked body within the limit is served as one with a length
        f"{url}/v1/completions",
        content=iter([b'{"model": "kvtier-tiny", "max_tokens": 1,', b' "prompt": "hi"}']),
        headers=headers,
        timeout=120,
    )
    assert within.status_code == 200 and within.json()["usage"]["prompt_tokens"] == 3, within.text


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"prompt": "x", "seed": 2**70}, 400, "seed", "seed must fit in 64 bits"),
        ({"prompt": "x", "seed": 2**64 - 1, "n": 2}, 400, "seed", "seed + n - 1"),
        ({"prompt": "x", "top_k": 2**40}, 400, "top_k", "top_k must be at most 2147483647"),
        ({"prompt": [5, 2**70]}, 400, "prompt", "outside the vocabulary"),
        ({"prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids", "outside the vocabulary"),
        ({"prompt": "x", "stop": ["s"] * 100_000}, 400, "stop", "at most 16 allowed"),
        ({"prompt": "x", "cache_salt": "s" * (100 << 10)}, 400, "cache_salt", "longer than 256 bytes"),
        ({"prompt": "x" * (16 << 10) + "x"}, 413, "prompt", "takes at most 16384"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream: true"),
    ],
)
def test_out_of_range_or_oversized_fields_are_refused_naming_them(url, body, status, param, says):
    assert_error(post(url, "/v1/completions", {"model": MODEL} | body), status, param, says)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", '"prompt": "x\\ud800"'),
        ("/v1/completions", '"prompt": "x", "guided_choice": ["a\\udc00"]'),
        ("/v1/completions", '"prompt": "x", "guided_regex": "a\\ud800"'),
        ("/v1/completions", '"prompt": "x", "stop": ["\\ud800"]'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "x\\ud800"}]'),
        ("/tokenize", '"prompt": "\\ud800"'),
    ],
)
def test_a_lone_surrogate_escape_is_a_400_not_a_500(url, path, fields):
    body = f'{{"model": "kvtier-tiny", "max_tokens": 2, {fields}}}'.encode()
    error = assert_error(post(url, path, body), 400, None, "lone UTF-16 surrogate")
    assert error["code"] == "invalid_unicode"
    pair = post(url, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')  # one character
    assert pair.status_code == 200 and pair.json()["usage"]["prompt_tokens"] == 1 + 4  # bos, 4 bytes


def test_chat_limits_name_their_fields(url):
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "z" * (16 << 10)}] * 2}
    assert_error(post(url, "/v1/chat/completions", long_chat), 413, "messages", "takes at most")
    top = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "logprobs": True,
        "top_logprobs": 21,
    }
    assert_error(
        post(url, "/v1/chat/completions", top), 400, "top_logprobs", "top_logprobs must be in [0, 20], got 21"
    )
    too_long = {"model": MODEL, "messages": [{"role": "user", "content": "z" * 1100}], "max_tokens": 5}
    assert_error(post(url, "/v1/chat/completions", too_long), 400, "messages", "the prompt alone fills it")


# --- /tokenize and /detokenize ------------------------------------------------------------------


def test_tokenize_counts_what_generation_counts_and_detokenize_inverts_it(url, client):
    reply = post(url, "/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    usage = client.completions.create(model=MODEL, prompt="héllo", max_tokens=1).usage
    assert body["count"] == len(body["tokens"]) == usage.prompt_tokens and body["max_model_len"] == 1024
    assert body["token_strs"] is None
    bare = post(url, "/tokenize", {"prompt": "héllo", "add_special_tokens": False}).json()
    assert bare["tokens"] == body["tokens"][1:]  # without the bos a completion prompt starts with
    assert post(url, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": "héllo"}
    messages = [{"role": "user", "content": "hi"}]
    chat = post(url, "/tokenize", {"messages": messages}).json()
    chat_usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat["count"] == chat_usage.prompt_tokens


def test_tokenize_and_detokenize_errors(url):
    assert_error(post(url, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model", "does not exist")
    assert_error(post(url, "/detokenize", {"tokens": [1, 99999]}), 400, "tokens", "outside the vocabulary")
    assert_error(post(url, "/tokenize", {"prompt": "x" * ((16 << 10) + 1)}), 413, "prompt", "takes at most")
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401


# --- logit_bias and echo ------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens(client):
    base = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    greedy = client.completions.create(**base, extra_body={"return_token_ids": True, "ignore_eos": True})
    tokens = greedy.choices[0].model_extra["token_ids"]
    banned = client.completions.create(
        **base, logit_bias={str(tokens[0]): -100}, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert banned.choices[0].model_extra["token_ids"][0] != tokens[0]
    forced = client.completions.create(
        **base, logit_bias={"65": 100}, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert forced.choices[0].model_extra["token_ids"] == [65] * 6 and forced.choices[0].text == "A" * 6


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(client):
    base = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="Once", **base).choices[0].text
    echoed = client.completions.create(prompt="Once", echo=True, **base)
    assert echoed.choices[0].text == "Once" + plain
    chunks = client.completions.create(prompt=["Once", "Twice"], echo=True, stream=True, **base)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == "Once" + plain and texts[1].startswith("Twice") and len(texts[1]) > len("Twice")
