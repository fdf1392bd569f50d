"""One bad request never hurts another (issue 16, item 4; the compute side of item 5).

The sampler fails only a non-finite row (in process, on tensors); then one real stack (a cache
service and one compute replica with the built-in tiny Llama) serves seven greedy neighbours
while bad requests arrive on the same replica: each bad one fails alone with INVALID_ARGUMENT (or,
for a tiny positive temperature, is served at the minimum temperature), and every neighbour
finishes with exactly Hugging Face's greedy tokens, its stream untouched by the other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import grpc
import pytest
import torch
from servers import TOKEN, ModuleLoop, cache_service, greedy_request, local_stack

from kvtier.cache_client import CacheClient
from kvtier.compute_client import Completion, ComputeClient
from kvtier.computesvc.__main__ import GENERATE_FIELDS_BYTES, TOKEN_ID_BYTES
from kvtier.computesvc.admission import RequestRefused
from kvtier.computesvc.model import ModelRunner, build_tiny_model, load_model
from kvtier.computesvc.remote_cache import RemoteCache
from kvtier.computesvc.request import Request
from kvtier.computesvc.sampling import NonFiniteLogits, Sampler, SamplingParams
from kvtier.computesvc.scheduler import Scheduler
from kvtier.computesvc.servicer import MAX_CACHE_SALT_BYTES, PROMPT_BYTES_PER_TOKEN
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.pool import attach_pool

BOS = TINY_LLAMA_CONFIG["bos_token_id"]
MAX_MODEL_LEN = TINY_LLAMA_CONFIG["max_position_embeddings"]
NUM_NEIGHBOURS = 7
# A neighbour may run to the end of the context: it is stopped (its call cancelled) once the bad
# requests have all ended and it has streamed AFTER_BAD_TOKENS more, so it is in flight throughout
# however slowly a loaded machine gets through the bad requests.
NEIGHBOUR_TOKENS = MAX_MODEL_LEN - 24
AFTER_BAD_TOKENS = 8
LOOP = ModuleLoop()
run = LOOP.run


# ---------------------------------------------------------------- the sampler, in process


def test_a_batch_with_one_non_finite_row_fails_only_that_row():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3)) * 3
    logits[2, 7] = math.nan
    logits[4, 0] = math.inf
    logits[1, :5] = -math.inf  # masked tokens alone are fine
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=0.8, seed=12),
        SamplingParams(temperature=0.5, top_k=5, seed=13),
        SamplingParams(temperature=0),
    ]
    sampler = Sampler()
    with pytest.raises(NonFiniteLogits) as e:
        sampler.sample(logits, params, [p.make_generator() for p in params])
    assert e.value.rows == [2, 4]

    tokens, failed = sampler.sample_isolated(logits, params, [p.make_generator() for p in params])
    assert sorted(failed) == [2, 4]
    assert all("not finite" in why for why in failed.values())
    assert tokens[2] == tokens[4] == -1
    # Every other row gets the token it gets alone (seeded rows drew exactly once).
    for i in (0, 1, 3):
        alone = sampler.sample(logits[i : i + 1], [params[i]], [params[i].make_generator()])
        assert tokens[i] == alone[0], f"row {i}"
    assert tokens[0] == int(logits[0].argmax())


def test_a_temperature_below_the_minimum_samples_finitely_at_the_minimum():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4)) * 30
    tiny = SamplingParams(temperature=1e-40, seed=5)
    tiny.validate(vocab_size=40, max_model_len=64)  # valid: sampled as MIN_TEMPERATURE
    at_min = SamplingParams(temperature=1e-2, seed=5)
    tokens, failed = Sampler().sample_isolated(logits, [tiny, at_min], [tiny.make_generator(), None])
    assert failed == {}
    again = Sampler().sample(logits[:1], [at_min], [at_min.make_generator()])
    assert tokens[0] == again[0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", math.inf, "temperature must be >= 0"),
        ("temperature", 1e6, "temperature must be at most 100"),
        ("repetition_penalty", 1e-39, r"repetition_penalty must be in \[0.01, 100\]"),
        ("stop", ["x" * 257], "a stop string has 257 characters, at most 256"),
        ("stop_token_ids", [1] * 257, "stop_token_ids has 257 entries, at most 256"),
    ],
)
def test_validate_refuses_values_that_would_overflow_or_cost_without_bound(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate(vocab_size=40, max_model_len=64)


def test_a_failed_step_tells_its_requests_nothing_of_one_requests_item():
    from kvtier.computesvc.scheduler import _public

    item = ValueError(
        "cache service refused the call: INVALID_ARGUMENT: items[3]: cache_salt 'tenant-b-secret\0'"
    )
    told = _public(item)
    assert "tenant-b-secret" not in told and "items[3]" not in told
    assert told.startswith("ValueError: ") and "replica's log" in told
    batch = RuntimeError("cache service refused the call: INVALID_ARGUMENT: 3 items exceed max_batch 2")
    assert _public(batch) == f"RuntimeError: {batch}"  # about the call, not a request: kept


# ---------------------------------------------------------------- the stack


def neighbour_prompt(k: int) -> list[int]:
    g = torch.Generator().manual_seed(4241 + k)
    return [BOS, *torch.randint(0, 256, (23,), generator=g).tolist()]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """Hugging Face greedy generation of each neighbour's prompt, in this process (one batch:
    the prompts have the same length, so no padding)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replica needs the other core
    model = build_tiny_model(0)
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as ignore_eos
    ids = torch.tensor([neighbour_prompt(k) for k in range(NUM_NEIGHBOURS)])
    with torch.inference_mode():
        full = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEIGHBOUR_TOKENS
        )
    torch.set_num_threads(threads)
    return full[:, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def address(tmp_path_factory) -> str:
    run_dir = tmp_path_factory.mktemp("isolation")
    with local_stack(run_dir, ["--num-blocks", "512"], replicas=1) as stack:
        yield stack.replicas[0].address


def salt_of(k: int) -> str:
    return f"neighbour-{k}-secret-salt"


def with_neighbours(address: str, bad: list) -> tuple[list[list[int]], list, int]:
    """Stream seven greedy neighbours on the replica; once each has its first token, send the
    `bad` requests (one attempt each). Once those have all ended, each neighbour streams
    AFTER_BAD_TOKENS more and is then stopped. Returns each neighbour's tokens, each bad request's
    Completion or error, and how many neighbours were still streaming when the last bad one ended."""

    async def scenario():
        client = ComputeClient([address], TOKEN)
        started = [asyncio.Event() for _ in range(NUM_NEIGHBOURS)]
        done = [False] * NUM_NEIGHBOURS
        stop_at = [NEIGHBOUR_TOKENS] * NUM_NEIGHBOURS
        streamed: list[list[int]] = [[] for _ in range(NUM_NEIGHBOURS)]

        async def neighbour(k: int) -> list[int]:
            tokens = streamed[k]
            request = greedy_request(neighbour_prompt(k), NEIGHBOUR_TOKENS, cache_salt=salt_of(k))
            async with contextlib.aclosing(client.stream(request, max_attempts=1)) as replies:
                async for reply in replies:
                    tokens += reply.token_ids
                    started[k].set()
                    if len(tokens) >= stop_at[k]:
                        break  # closing the stream cancels the call
            done[k] = True
            return tokens[: stop_at[k]]

        async def one_bad(request):
            try:
                return await client.complete(request, max_attempts=1)
            except grpc.aio.AioRpcError as e:
                return e

        try:
            streams = [asyncio.create_task(neighbour(k)) for k in range(NUM_NEIGHBOURS)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            results = await asyncio.gather(*(one_bad(r) for r in bad))
            in_flight = done.count(False)
            for k in range(NUM_NEIGHBOURS):
                stop_at[k] = min(NEIGHBOUR_TOKENS, len(streamed[k]) + AFTER_BAD_TOKENS)
            return await asyncio.gather(*streams), results, in_flight
        finally:
            await client.close()

    return run(scenario(), 120)


def assert_neighbours_served(neighbours: list[list[int]], expected: list[list[int]], in_flight: int) -> None:
    """Every neighbour was streaming while the bad requests came and went (`with_neighbours`' count)
    and streamed past them, every token Hugging Face's greedy one."""
    assert in_flight == NUM_NEIGHBOURS, "the neighbours finished before the bad requests: nothing was tested"
    for k, tokens in enumerate(neighbours):
        assert len(tokens) > AFTER_BAD_TOKENS, f"neighbour {k} streamed {len(tokens)} tokens"
        assert tokens == expected[k][: len(tokens)], f"neighbour {k}"


def assert_invalid(result, *words: str) -> str:
    assert isinstance(result, grpc.aio.AioRpcError), f"expected INVALID_ARGUMENT, got {result!r}"
    assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, result.details()
    for word in words:
        assert word in result.details()
    return result.details()


def test_a_nan_making_temperature_and_non_finite_fields_fail_or_serve_alone(address, expected):
    request = ComputeClient.request
    ids = [BOS, 5, 6, 7]
    bad = [
        # 1e-40 used to turn the batch's logits into NaN and fail every request in flight:
        # now it is sampled at the minimum temperature, as vLLM does.
        request(prompt_token_ids=ids, max_tokens=8, temperature=1e-40, ignore_eos=True),
        request(prompt_token_ids=ids, max_tokens=8, temperature=math.inf),
        request(prompt_token_ids=ids, max_tokens=8, temperature=1.0, top_p=math.nan),
        request(prompt_token_ids=ids, max_tokens=8, temperature=0.0, min_p=math.nan),
        request(prompt_token_ids=ids, max_tokens=8, presence_penalty=-math.inf),
        request(prompt_token_ids=ids, max_tokens=8, repetition_penalty=1e-39),
    ]
    neighbours, results, in_flight = with_neighbours(address, bad)
    served = results[0]
    assert isinstance(served, Completion), f"temperature 1e-40 failed: {served!r}"
    assert (len(served.token_ids), served.finish_reason) == (8, "length")
    fields = ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"]
    for result, field in zip(results[1:], fields, strict=True):
        assert_invalid(result, field)
    assert_neighbours_served(neighbours, expected, in_flight)


def test_a_salt_with_a_nul_fails_alone_and_no_error_carries_another_requests_data(address, expected):
    bad_salt = "tenant-b\0secret"
    bad = [
        greedy_request([BOS, 9, 9, 9], 8, cache_salt=bad_salt),
        greedy_request([BOS, 9, 9, 9], 8, cache_salt="s" * (MAX_CACHE_SALT_BYTES + 1)),
        greedy_request([BOS, 9, 9, 9], 8, request_id="r" * 300),
    ]
    neighbours, results, in_flight = with_neighbours(address, bad)
    details = assert_invalid(results[0], "cache_salt", "NUL")
    assert_invalid(results[1], "cache_salt", str(MAX_CACHE_SALT_BYTES))
    assert_invalid(results[2], "request_id")
    for k in range(NUM_NEIGHBOURS):
        assert salt_of(k) not in details
    assert "secret" not in details  # not even its own salt is echoed
    assert_neighbours_served(neighbours, expected, in_flight)


def test_an_oversized_text_prompt_is_refused_before_tokenizing_and_neighbours_carry_on(address, expected):
    limit = PROMPT_BYTES_PER_TOKEN * MAX_MODEL_LEN
    huge = "x" * (limit + 1000)  # (16 MiB, the size that stalled the loop, is over the message limit: below)
    just_over = "é" * (limit // 2 + 1)  # fewer characters than the limit, more bytes
    bad = [
        ComputeClient.request(prompt=huge, max_tokens=4),
        ComputeClient.request(prompt=just_over, max_tokens=4),
    ]
    started = time.monotonic()
    neighbours, results, in_flight = with_neighbours(address, bad)
    assert_invalid(results[0], f"{len(huge)} bytes", f"at most {limit}", "--max-prompt-bytes")
    assert_invalid(results[1], f"{2 * len(just_over)} bytes", f"at most {limit}")
    assert time.monotonic() - started < 60, "a deadline for progress, not a performance target"
    assert_neighbours_served(neighbours, expected, in_flight)


def test_a_text_prompt_within_the_limit_is_tokenized_and_served(address):
    async def one():
        client = ComputeClient([address], TOKEN)
        try:
            return await client.complete(
                ComputeClient.request(prompt="hello " * 20, max_tokens=4, temperature=0.0, ignore_eos=True), 1
            )
        finally:
            await client.close()

    done = run(one())
    assert done.prompt_tokens == 1 + len("hello " * 20)  # bos + one token per byte
    assert len(done.token_ids) == 4


def test_prompt_token_ids_longer_than_the_context_are_refused_by_their_count(address):
    async def one():
        client = ComputeClient([address], TOKEN)
        try:
            return await client.complete(greedy_request([1] * 20_000, 4), 1)  # within the byte limit
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            await client.close()

    assert_invalid(run(one()), f"context is {MAX_MODEL_LEN} tokens", "20000")


# ---------------------------------------------------------------- a refused item of a batched call


def test_a_batched_allocate_refused_for_one_item_fails_only_that_request(tmp_path, expected):
    """The servicer refuses a NUL salt at the edge; behind it, the scheduler must still fail only
    the request whose item the cache service refuses, not the batch. Here the requests go to the
    scheduler directly (as a replica without that check would send them), over real gRPC to a
    real cache service."""
    loaded = load_model(None)
    steps = 8

    async def scenario(address: str):
        client = CacheClient.connect(address, TOKEN, aio=True)
        await client.attach("isolation-test", loaded.shape.fingerprint)
        pool = attach_pool(client.pool)
        runner = ModelRunner(loaded.model, pool.tensor, client.pool.block_size)
        scheduler = Scheduler(runner, RemoteCache(client), loaded.tokenizer, loaded.eos_token_ids)
        requests = [
            Request(
                f"r{k}",
                neighbour_prompt(k),
                SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True),
                tenant_salt="bad\0salt" if k == 2 else salt_of(k),
            )
            for k in range(4)
        ]
        for r in requests:
            scheduler.add(r)  # all four go out in one Allocate
        while scheduler.has_work:
            await scheduler.step()
        outputs = []
        for r in requests:
            items = []
            while not r.outputs.empty():
                items.append(r.outputs.get_nowait())
            outputs.append(items)
        await client.close()
        del scheduler, runner
        pool.close()  # unmapped once the last view is gone
        return requests, outputs

    with cache_service(tmp_path, "--num-blocks", "64", "--lease-ttl", "30") as service:
        requests, outputs = run(scenario(service.address), 120)
        stats = CacheClient.connect(service.address, TOKEN, timeout_s=5.0).get_stats()
    assert stats.num_sequences == 0, "a sequence of the refused batch was left allocated"
    (refused,) = outputs[2]
    assert isinstance(refused.error, RequestRefused), refused.error
    assert "NUL" in str(refused.error)
    for k in (0, 1, 3):
        assert salt_of(k) not in str(refused.error)
        assert all(out.error is None for out in outputs[k]), [out.error for out in outputs[k]]
        assert requests[k].output_token_ids == expected[k][:steps], f"request {k}"
        assert outputs[k][-1].finish_reason == "length"


# ---------------------------------------------------------------- the size of a Generate request


def test_an_oversized_generate_is_refused_before_parsing_and_the_replica_keeps_serving(address, expected):
    # The default limit: the largest legitimate request (a text prompt at --max-prompt-bytes,
    # token ids filling the context, the other fields at their limits), not grpc's 128 MiB.
    prompt_limit = PROMPT_BYTES_PER_TOKEN * MAX_MODEL_LEN
    limit = prompt_limit + TOKEN_ID_BYTES * MAX_MODEL_LEN + GENERATE_FIELDS_BYTES
    bad = [
        greedy_request([1] * 200_000, 4),  # 200 KB of packed ids: parsing them built 200,000 ints
        ComputeClient.request(prompt="x" * (16 << 20), max_tokens=4),  # the 16 MiB of the finding
        greedy_request([BOS, 5], 4, stop=["s" * 256] * 400),  # fields over any legitimate size
        # The largest legitimate fields pass the byte limit and meet the field checks after it.
        ComputeClient.request(
            prompt="é" * (prompt_limit // 2),
            max_tokens=4,
            stop=["\U0001f600" * 256] * 16,
            stop_token_ids=[5] * 256,
            cache_salt="s" * MAX_CACHE_SALT_BYTES,
            request_id="r" * 256,
        ),
    ]
    neighbours, results, in_flight = with_neighbours(address, bad)
    for result in results[:3]:
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, result.details()
        assert str(limit) in result.details(), result.details()
    assert_invalid(results[3], f"context is {MAX_MODEL_LEN} tokens")  # a byte per token: too long
    assert_neighbours_served(neighbours, expected, in_flight)


# ---------------------------------------------------------------- one tenant's request that cannot fit


def test_a_request_that_cannot_fit_does_not_hold_up_another_tenants_behind_it(tmp_path):
    """Waiting is first come, first served within a tenant only: tenant a's second big request
    finds no room while a's first one runs, and tenant b's small request behind it is admitted
    and finishes meanwhile instead of waiting for a's first request to end."""
    loaded = load_model(None)

    async def scenario(address: str) -> list[str]:
        client = CacheClient.connect(address, TOKEN, aio=True)
        await client.attach("hol-test", loaded.shape.fingerprint)
        pool = attach_pool(client.pool)
        runner = ModelRunner(loaded.model, pool.tensor, client.pool.block_size)
        scheduler = Scheduler(runner, RemoteCache(client), loaded.tokenizer, loaded.eos_token_ids)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        a1 = Request("a1", [BOS, *[5] * 299], params, tenant="a")  # 19 blocks + lookahead
        a2 = Request("a2", [BOS, *[6] * 299], params, tenant="a")  # cannot fit while a1 runs
        b1 = Request("b1", [BOS, *[7] * 49], SamplingParams(max_tokens=4, temperature=0), tenant="b")
        finished: list[str] = []
        for r in (a1, a2, b1):
            scheduler.add(r)
        while scheduler.has_work:
            await scheduler.step()
            for r in (a1, a2, b1):
                if r.status.value == "finished" and r.request_id not in finished:
                    finished.append(r.request_id)
        await client.close()
        del scheduler, runner
        pool.close()
        return finished

    with cache_service(tmp_path, "--num-blocks", "32", "--lease-ttl", "30") as service:
        finished = run(scenario(service.address), 180)
    # b1 got in while a1 ran (it did not wait for a2, nor for a1 to end); a2 ran after a1.
    assert finished.index("b1") < finished.index("a1") < finished.index("a2"), finished
