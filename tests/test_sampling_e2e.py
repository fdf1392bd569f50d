"""Sampling end to end: a model directory with its own generation_config.json, a real stack (cache
service, two compute replicas, the gateway) and real clients (gRPC ComputeClient, the official
`openai` package).

Checked against Hugging Face on the same directory: greedy output under the generation config's
repetition penalty (`generate`), and logprobs (log_softmax of a plain fp32 forward pass's logits).
"""

from __future__ import annotations

import json
import logging
import signal

import grpc
import httpx
import openai
import pytest
import torch
from servers import TOKEN, ModuleLoop, cache_stats, child_env

from kvtier.cli.stack import LocalStack
from kvtier.compute_client import Completion, ComputeClient
from kvtier.computesvc.model import build_tiny_model
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.tokenizer import build_byte_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LOOP = ModuleLoop()
API_KEY = "sk-kvtier-sampling-test"
MODEL = "tiny-genconf"
BOS = TINY_LLAMA_CONFIG["bos_token_id"]
BLOCK_SIZE = 16
# The model's own defaults: greedy (do_sample false) with a repetition penalty; temperature,
# top_p and top_k are what a sampling request would get (HF ignores them when greedy).
GENERATION_CONFIG = {
    "do_sample": False,
    "repetition_penalty": 1.3,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "max_new_tokens": 12,
}
PROMPT = [BOS, *b"the cat sat on the mat and the cat"]
TOLERANCE = 1e-4  # logprobs: fp32 forward here vs paged attention there, then float32 on the wire


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-genconf")
    build_tiny_model(seed=0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())  # bos/eos/pad as save_pretrained wrote them
    config_file.write_text(json.dumps(config | GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sampling")
    model = ["--model", str(model_dir)]
    with LocalStack(
        run_dir,
        cache_args=[*model, "--num-blocks", "1024", "--block-size", str(BLOCK_SIZE), "--lease-ttl", "2"],
        compute_args=[*model, "--metrics-port", "0"],
        num_replicas=2,
        env=child_env(run_dir),
        gateway_args=[*model, "--api-key", API_KEY, "--served-model-name", MODEL],
        gateway_port=0,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway.address}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(model_dir):
    """The same checkpoint in Hugging Face transformers, fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(hf, model_dir, prompt: list[int], max_new_tokens: int, **overrides) -> list[int]:
    """HF `generate` with the directory's generation config, greedy, EOS still stopping."""
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(model_dir)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **overrides,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of the raw logits that predicted each output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].log_softmax(-1)


def grpc_complete(stack, **kw) -> Completion:
    async def run():
        c = ComputeClient(stack.compute_addresses, TOKEN)
        try:
            return await c.complete(ComputeClient.request(**kw))
        finally:
            await c.close()

    return LOOP.run(run(), timeout_s=300)


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


# --- generation_config.json defaults ------------------------------------------------------------


def test_unset_fields_take_the_generation_config_and_match_hf_generate(stack, client, hf, model_dir):
    n = 24
    expected = hf_greedy(hf, model_dir, PROMPT, n)
    plain = hf_greedy(hf, model_dir, PROMPT, n, repetition_penalty=1.0)
    # The prompt repeats itself: the penalty must change what greedy decoding picks here.
    assert expected != plain, "the repetition penalty does not matter on this prompt; pick another"

    via_grpc = grpc_complete(stack, prompt_token_ids=PROMPT, max_tokens=n)
    assert via_grpc.token_ids == expected
    via_http = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=n, extra_body={"return_token_ids": True}
    )
    assert via_http.choices[0].model_extra["token_ids"] == expected

    # Set explicitly, a field overrides the model's default.
    override = grpc_complete(stack, prompt_token_ids=PROMPT, max_tokens=n, repetition_penalty=1.0)
    assert override.token_ids == plain
    via_http = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=n,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.0},
    )
    assert via_http.choices[0].model_extra["token_ids"] == plain


def test_max_new_tokens_is_the_default_max_tokens(stack, client):
    out = grpc_complete(stack, prompt_token_ids=PROMPT, ignore_eos=True)
    assert len(out.token_ids) == out.completion_tokens == 12 and out.finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    # Near the end of the context the default yields to the room left instead of failing.
    room = TINY_LLAMA_CONFIG["max_position_embeddings"] - 5
    long = grpc_complete(stack, prompt_token_ids=[BOS] + [65] * (room - 1), ignore_eos=True)
    assert long.completion_tokens == 5


# --- logprobs ---------------------------------------------------------------------------------


def check_logprobs(hf, prompt, tokens, chosen, ranks, tops, k):
    """chosen[j]: the logprob of tokens[j]; ranks[j] or None; tops[j]: [(id or text, logprob)] of
    the k most likely, most likely first (ids compared as ids, texts as decoded ids)."""
    expected = hf_logprobs(hf, prompt, tokens)
    tokenizer = build_byte_tokenizer()
    assert len(chosen) == len(tops) == len(tokens) > 0
    for j, token in enumerate(tokens):
        row = expected[j]
        assert chosen[j] == pytest.approx(float(row[token]), abs=TOLERANCE), j
        if ranks[j] is not None:
            assert ranks[j] == int((row > row[token]).sum()) + 1, j
        best = row.topk(k)
        assert len(tops[j]) == k
        for (key, value), want_id, want in zip(
            tops[j], best.indices.tolist(), best.values.tolist(), strict=True
        ):
            assert key == (want_id if isinstance(key, int) else tokenizer.decode([want_id])), (
                j,
                key,
                want_id,
            )
            assert value == pytest.approx(want, abs=TOLERANCE), j


def test_grpc_logprobs_are_the_raw_model_distribution(stack, hf):
    # Under the default repetition penalty the sampled token is not always the raw argmax (over
    # 24 tokens it differs from plain greedy, see above: where they part, the pick has rank > 1);
    # the reported logprobs and ranks must still be of the raw logits.
    out = grpc_complete(stack, prompt_token_ids=PROMPT, max_tokens=24, logprobs=5)
    assert len(out.logprobs) == len(out.token_ids) == 24
    check_logprobs(
        hf,
        PROMPT,
        out.token_ids,
        [lp.logprob for lp in out.logprobs],
        [lp.rank for lp in out.logprobs],
        [list(zip(lp.top_token_ids, lp.top_logprobs, strict=True)) for lp in out.logprobs],
        5,
    )
    assert any(lp.rank > 1 for lp in out.logprobs), "the penalty never moved the pick off the raw argmax"
    none = grpc_complete(stack, prompt_token_ids=PROMPT, max_tokens=4)
    assert none.logprobs == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_logprobs_through_the_openai_client(client, hf, stream):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    if stream:
        tokens, lps, text = [], None, ""
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                tokens += c.model_extra["token_ids"]
                text += c.text
                part = c.logprobs
                if lps is None:
                    lps = part
                else:
                    lps.tokens += part.tokens
                    lps.token_logprobs += part.token_logprobs
                    lps.top_logprobs += part.top_logprobs
                    lps.text_offset += part.text_offset
    else:
        reply = client.completions.create(**kwargs)
        tokens, lps, text = (
            reply.choices[0].model_extra["token_ids"],
            reply.choices[0].logprobs,
            reply.choices[0].text,
        )
    tokenizer = build_byte_tokenizer()
    assert lps.tokens == [tokenizer.decode([t]) for t in tokens]
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:j]) for j in range(len(tokens))]
    expected = hf_logprobs(hf, PROMPT, tokens)
    for j, token in enumerate(tokens):
        top = lps.top_logprobs[j]
        # The 3 most likely plus the sampled token (here the argmax: one of them). Several byte
        # tokens can decode to the same text (U+FFFD), so compare by text against any such id.
        want_ids = expected[j].topk(3).indices.tolist()
        assert set(top) == {tokenizer.decode([i]) for i in want_ids}
        for key, value in top.items():
            candidates = [float(expected[j, i]) for i in want_ids if tokenizer.decode([i]) == key]
            assert any(abs(value - c) <= TOLERANCE for c in candidates), (j, key, value, candidates)
        assert lps.token_logprobs[j] == pytest.approx(float(expected[j, token]), abs=TOLERANCE)
    assert len(text) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_through_the_openai_client(client, hf, stream):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "the cat sat on the mat"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    if stream:
        tokens, content, prompt = [], [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                if c.logprobs is not None:
                    content += c.logprobs.content
                    tokens += c.model_extra["token_ids"]
        # The prompt's ids, from a non-streamed call (the stream does not carry them).
        prompt = client.chat.completions.create(**{**kwargs, "max_tokens": 1}).model_extra["prompt_token_ids"]
    else:
        reply = client.chat.completions.create(**kwargs)
        prompt = reply.model_extra["prompt_token_ids"]
        tokens, content = reply.choices[0].model_extra["token_ids"], reply.choices[0].logprobs.content
    tokenizer = build_byte_tokenizer()
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in tokens]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    check_logprobs(
        hf,
        prompt,
        tokens,
        [e.logprob for e in content],
        [None] * len(content),
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in content],
        4,
    )


# --- penalties ----------------------------------------------------------------------------------


def test_frequency_and_presence_penalties_make_greedy_output_repeat_less(stack, client):
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    body = {"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.0}
    base = client.completions.create(**common, extra_body=body).choices[0].model_extra["token_ids"]
    assert repeats(base) >= 10, f"the greedy output barely repeats ({base}); pick another prompt"
    freq = client.completions.create(**common, frequency_penalty=2.0, extra_body=body)
    freq_tokens = freq.choices[0].model_extra["token_ids"]
    print(f"repeats in 40 tokens: plain {repeats(base)}, frequency_penalty 2: {repeats(freq_tokens)}")
    assert repeats(freq_tokens) < repeats(base)
    pres = grpc_complete(
        stack,
        prompt_token_ids=PROMPT,
        max_tokens=40,
        temperature=0,
        repetition_penalty=1.0,
        presence_penalty=2.0,
        ignore_eos=True,
    )
    print(f"presence_penalty 2: {repeats(pres.token_ids)}")
    assert repeats(pres.token_ids) < repeats(base)
    # A negative frequency penalty rewards repeats: never fewer than plain greedy.
    more = client.completions.create(**common, frequency_penalty=-2.0, extra_body=body)
    assert repeats(more.choices[0].model_extra["token_ids"]) >= repeats(base)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2], got -3.0"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
        ("logprobs", 21, "logprobs must be in [0, 20], got 21"),
    ],
)
def test_out_of_range_sampling_fields_are_refused_naming_the_field(stack, field, value, says):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        grpc_complete(stack, prompt_token_ids=PROMPT, max_tokens=2, **{field: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
    reply = httpx.post(
        f"{stack.gateway.address}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, field: value},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]


def test_chat_top_logprobs_without_logprobs_is_a_400(stack):
    reply = httpx.post(
        f"{stack.gateway.address}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs", reply.text


# --- n samples share the prompt's blocks ----------------------------------------------------------


def test_n_samples_share_the_prompt_blocks_and_are_reproducible(stack, client):
    # 41 tokens: 2 full blocks, and the last token is not block-aligned (it is never a hit).
    prompt = [BOS, *b"n samples of one prompt share its blocks!"][:41]
    assert len(prompt) == 41
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=99, n=3)
    before = cache_stats(stack).prefix_hit_tokens
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "cache_salt": "n-share"})
    hits = cache_stats(stack).prefix_hit_tokens - before
    print(f"prefix hit tokens of n=3 over a {len(prompt)}-token prompt: {hits}")
    assert hits >= (3 - 1) * full_blocks * BLOCK_SIZE
    second = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "cache_salt": "n-share"})
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1, texts  # three samples, not one repeated


# --- failover (last: it kills a replica) ------------------------------------------------------


def test_failover_drops_the_delivered_logprobs_with_their_tokens(stack, caplog):
    # Long enough that the replica is still generating when it is killed (not all buffered).
    kw = dict(prompt_token_ids=PROMPT, max_tokens=400, logprobs=2, ignore_eos=True)
    expected = grpc_complete(stack, **kw)
    victim = stack.replicas[0]

    async def stream_and_kill() -> tuple[list[int], list]:
        # Attempt 1 goes to compute-0 (the first address); the retry to compute-1, which
        # regenerates the same tokens: the client skips those it delivered, logprobs included.
        client = ComputeClient(stack.compute_addresses, TOKEN)
        tokens, logprobs = [], []
        try:
            async for reply in client.stream(ComputeClient.request(**kw)):
                assert len(reply.logprobs) == len(reply.token_ids)
                tokens += reply.token_ids
                logprobs += reply.logprobs
                if len(tokens) >= 5 and victim.alive():
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
        finally:
            await client.close()
        return tokens, logprobs

    with caplog.at_level(logging.WARNING, logger="kvtier.client"):
        tokens, logprobs = LOOP.run(stream_and_kill(), timeout_s=300)
    stack.replicas[0] = stack.start_replica(0)  # the stack stops what it started
    assert any("retrying on another" in r.getMessage() for r in caplog.records), "no failover happened"
    assert tokens == expected.token_ids
    assert len(logprobs) == len(tokens)
    for got, want in zip(logprobs, expected.logprobs, strict=True):
        assert got.rank == want.rank and list(got.top_token_ids) == list(want.top_token_ids)
        assert got.logprob == pytest.approx(want.logprob, abs=TOLERANCE)
