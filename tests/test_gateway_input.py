"""The gateway's edge (issue 26): stop strings that never leak, bounded input, exact errors,
/tokenize and /detokenize. A real stack (cache service + 1 compute replica), the gateway as a real
process, the official `openai` client (or httpx for raw bodies)."""

from __future__ import annotations

import httpx
import openai
import pytest
from servers import child_env

from kvtier_cli.stack import LocalStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "sk-kvtier-gateway-input-test"
MODEL = "kvtier-tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateway-input")
    with LocalStack(
        run_dir,
        cache_args=["--num-blocks", "512"],
        num_replicas=1,
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
    chunks = list(client.completions.create(model=MODEL, **ISSUE_EXAMPLE, stop="gB", stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
