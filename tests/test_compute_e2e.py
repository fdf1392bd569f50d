"""The whole stack end to end: a cache service and two compute replicas as real processes on
Unix sockets, driven over real gRPC by `ComputeClient`, with the built-in tiny Llama on CPU.

The reference for every completion is Hugging Face `generate` (greedy, eager attention) of the
same seeded model, built in this process. Requests send `prompt_token_ids` (bos included) so
both sides see exactly the same tokens, and `ignore_eos` on our side matches `eos_token_id=None`
on theirs: both produce exactly max_tokens tokens.

Most tests share one module-scoped stack. Tests that need another pool (a tiny one, to force
preemption) restart only the cache service at the same socket; the replicas re-attach by
themselves, which is itself behaviour under test. Logits parity is pinned in-process by
tests/test_model.py and not repeated here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from servers import (
    REPO,
    TOKEN,
    ModuleLoop,
    cache_service,
    cache_stats,
    child_env,
    greedy_request,
    local_stack,
    wait_until,
)

from kvtier.cli.stack import LocalStack, wait_serving
from kvtier.compute_client import Completion, ComputeClient
from kvtier.computesvc.config import build_parser
from kvtier.computesvc.model import build_tiny_model
from kvtier.model_spec import TINY_LLAMA_CONFIG

SEED = 0
BLOCK = 16
BOS = TINY_LLAMA_CONFIG["bos_token_id"]
MAX_MODEL_LEN = TINY_LLAMA_CONFIG["max_position_embeddings"]
LEASE_TTL = "2"
# Room for every test that shares the stack (32 concurrent sequences with lookahead included).
DEFAULT_POOL = ["--num-blocks", "512", "--swap-space", "0.01"]


# ---------------------------------------------------------------- reference and inputs


def prompt(length: int, salt: int) -> list[int]:
    """bos + `length - 1` deterministic byte tokens; a different `salt` gives a different prompt."""
    g = torch.Generator().manual_seed(7919 * salt + length)
    return [BOS, *torch.randint(0, 256, (length - 1,), generator=g).tolist()]


def full_blocks_below_last_token(num_tokens: int) -> int:
    """Tokens a prefix hit can cover: whole blocks, never the last token (its logits are needed)."""
    return (num_tokens - 1) // BLOCK * BLOCK


class Reference:
    """Hugging Face greedy generation of the tiny model, eager attention, in this process."""

    def __init__(self, seed: int):
        self.model = build_tiny_model(seed)  # eager attention: transformers' own code path
        # NOTE: generate() fills unset options from the model's own generation config, so eos
        # is cleared there: generate then runs exactly max_new_tokens, as ignore_eos does.
        self.model.generation_config.eos_token_id = None

    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([token_ids])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
            )
        assert out.shape[1] == len(token_ids) + max_new_tokens, "generate stopped early"
        return out[0, len(token_ids) :].tolist()


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replicas need the other core
    yield Reference(SEED)
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- talking to the stack

LOOP = ModuleLoop()
run = LOOP.run


def complete(addresses: list[str], requests, max_attempts: int | None = None) -> list[Completion]:
    """Send `requests` one after the other through one client (round robin over `addresses`)."""

    async def complete_all() -> list[Completion]:
        client = ComputeClient(addresses, TOKEN)
        try:
            return [await client.complete(r, max_attempts) for r in requests]
        finally:
            await client.close()

    return run(complete_all())


def serves(address: str) -> bool:
    """True when the replica at `address` completes a one-token request now."""
    try:
        complete([address], [greedy_request([BOS, 1], 1)], max_attempts=1)
        return True
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False


def wait_replicas_serve(stack: LocalStack, timeout_s: float = 60.0) -> None:
    for i, replica in enumerate(stack.replicas):
        wait_until(lambda a=replica.address: serves(a), timeout_s, f"compute-{i} serving again")


def restart_cache(stack: LocalStack, pool_args: list[str]) -> None:
    """Kill the cache service, start it again at the same socket with `pool_args`, and wait
    until every replica has re-attached and serves."""
    stack.cache.stop(signal.SIGKILL)  # a clean stop is not under test here, and takes seconds
    stack.cache_args = [*pool_args, "--lease-ttl", LEASE_TTL]
    stack.start_cache()
    wait_replicas_serve(stack)


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e")
    with local_stack(run_dir, DEFAULT_POOL, replicas=2) as s:
        yield s
        # Signal every process first: each takes seconds to exit, and the stack waits in turn.
        for p in [*s.replicas, s.cache]:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)


@pytest.fixture
def stack(module_stack: LocalStack) -> LocalStack:
    """The shared stack with its default pool and both replicas alive (restored if a test changed them)."""
    if module_stack.cache_args != [*DEFAULT_POOL, "--lease-ttl", LEASE_TTL] or not module_stack.cache.alive():
        restart_cache(module_stack, DEFAULT_POOL)
    for i, replica in enumerate(module_stack.replicas):
        if replica.proc.poll() is not None:
            module_stack.replicas[i] = module_stack.start_replica(i)
        wait_serving(module_stack.replicas[i])
    return module_stack


def both_replicas(stack: LocalStack) -> list[str]:
    return [stack.replicas[0].address, stack.replicas[1].address]


# ---------------------------------------------------------------- greedy parity and prefix caching


@pytest.mark.parametrize(
    "length", [7, 16, 33, 48, 100], ids=lambda n: f"{n}-tokens" + ("" if n % BLOCK == 0 else "-partial-block")
)
def test_greedy_matches_hf_generate_without_and_with_a_prefix_hit(stack, reference, length):
    ids = prompt(length, salt=1)
    expected = reference.greedy(ids, 24)
    # Round robin: the first request runs on compute-0, the repeat on compute-1, which finds
    # the prompt's blocks compute-0 committed.
    first, repeat = complete(both_replicas(stack), [greedy_request(ids, 24)] * 2)
    assert first.token_ids == expected
    assert first.cached_prompt_tokens == 0
    assert repeat.token_ids == expected
    assert repeat.cached_prompt_tokens == full_blocks_below_last_token(length)
    assert (first.prompt_tokens, first.completion_tokens, first.finish_reason) == (length, 24, "length")


def test_shared_system_prompt_is_served_from_the_cache_and_only_the_rest_is_prefilled(stack, reference):
    system = prompt(200, salt=2)
    first_ids = system + prompt(30, salt=3)[1:]
    second_ids = system + prompt(25, salt=4)[1:]
    # The first request runs on compute-0, the second on compute-1.
    complete(both_replicas(stack), [greedy_request(first_ids, 8)])
    before = cache_stats(stack)
    (second,) = complete(both_replicas(stack)[::-1], [greedy_request(second_ids, 8)])
    after = cache_stats(stack)

    # 200 tokens hold 12 full blocks (192 tokens); the 13th block differs between the prompts.
    assert second.cached_prompt_tokens == 192
    # One lookup of the whole prompt, of which 192 tokens were found: only the rest is computed.
    assert after.prefix_query_tokens - before.prefix_query_tokens == len(second_ids)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 192
    assert second.prompt_tokens - second.cached_prompt_tokens == len(second_ids) - 192
    assert second.token_ids == reference.greedy(second_ids, 8)


def test_repeated_block_aligned_prompt_hit_is_capped_below_its_last_token(stack, reference):
    ids = prompt(13 * BLOCK, salt=5)
    first, repeat = complete(both_replicas(stack), [greedy_request(ids, 8)] * 2)
    # All 13 blocks are cached, but the last token must be recomputed for its logits.
    assert repeat.cached_prompt_tokens == 12 * BLOCK
    assert first.token_ids == repeat.token_ids == reference.greedy(ids, 8)


def test_32_concurrent_streams_across_two_replicas_each_match_running_alone(stack, reference, caplog):
    prompts = [prompt(10 + 3 * k, salt=100 + k) for k in range(32)]
    addresses = both_replicas(stack)

    async def one(k: int) -> tuple[list[int], int]:
        # Client k starts on replica k % 2: half the streams go to each replica.
        client = ComputeClient(addresses[k % 2 :] + addresses[: k % 2], TOKEN)
        tokens, messages = [], 0
        try:
            async for reply in client.stream(greedy_request(prompts[k], 24)):
                tokens += reply.token_ids
                messages += 1
        finally:
            await client.close()
        return tokens, messages

    async def all_at_once():
        return await asyncio.gather(*(one(k) for k in range(32)))

    with caplog.at_level(logging.WARNING, logger="kvtier.client"):
        results = run(all_at_once())
    assert not caplog.records, "no stream should have needed a retry"
    for k, (tokens, messages) in enumerate(results):
        assert tokens == reference.greedy(prompts[k], 24), f"stream {k}"
        assert messages > 1, f"stream {k} arrived in one message: not streamed"


def test_a_final_only_request_gets_its_whole_streamed_completion_in_one_reply(stack, reference):
    ids = prompt(40, salt=7)
    # Different salts: the second request computes its prompt too instead of hitting the first's.
    requests = [
        greedy_request(ids, 20, logprobs=2, cache_salt=str(final_only), final_only=final_only)
        for final_only in (False, True)
    ]

    async def replies(request) -> list:
        client = ComputeClient(stack.compute_addresses[:1], TOKEN)
        try:
            return [reply async for reply in client.stream(request)]
        finally:
            await client.close()

    streamed, whole = (run(replies(r)) for r in requests)
    assert len(streamed) > 1 and len(whole) == 1
    (one,) = whole
    assert list(one.token_ids) == [t for r in streamed for t in r.token_ids] == reference.greedy(ids, 20)
    assert one.text == "".join(r.text for r in streamed)
    assert list(one.logprobs) == [lp for r in streamed for lp in r.logprobs]
    assert one.finish_reason == streamed[-1].finish_reason == "length"
    assert one.usage == streamed[-1].usage
    assert one.usage.completion_tokens == 20 and one.time_to_first_token_s > 0


def test_a_final_only_request_may_take_longer_than_the_first_token_deadline(stack, reference, caplog):
    # Its one reply comes when it finishes: the client waits for the streamed deadlines added up
    # over max_tokens, not for the first token's alone (which 200 tokens take longer than).
    ids = prompt(12, salt=8)
    request = greedy_request(ids, 200, final_only=True)

    async def whole() -> tuple[Completion, float]:
        client = ComputeClient(stack.compute_addresses, TOKEN, first_token_timeout_s=0.2)
        t0 = time.monotonic()
        try:
            return await client.complete(request), time.monotonic() - t0
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="kvtier.client"):
        out, took = run(whole())
    assert out.token_ids == reference.greedy(ids, 200)
    assert took > 0.2, "finished within the first-token deadline: the test shows nothing"
    assert not caplog.records, "the request was failed over"


def test_client_leaving_mid_stream_frees_its_sequence(stack):
    async def read_three_then_leave() -> int:
        client = ComputeClient([stack.replicas[0].address], TOKEN)
        received = 0
        try:
            async for reply in client.stream(greedy_request(prompt(50, salt=9), 500)):
                received += len(reply.token_ids)
                if received >= 3:
                    break
        finally:
            await client.close()  # cancels the stream
        return received

    assert run(read_three_then_leave()) == 3
    # Both replicas' leases stay alive: only the replica freeing the sequence brings this to 0.
    wait_until(lambda: cache_stats(stack).num_sequences == 0, 5.0, "the abandoned sequence freed")
    assert cache_stats(stack).num_blocks_used == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": prompt(MAX_MODEL_LEN + 1, salt=6)}, "context"),
        ({"prompt_token_ids": [BOS, 300]}, "prompt_token_ids"),
    ],
    ids=["negative-temperature", "top-p-zero", "max-tokens-zero", "empty-prompt", "too-long", "out-of-vocab"],
)
def test_bad_request_is_invalid_argument_naming_the_field(stack, request_kw, field):
    kw = {"prompt_token_ids": [BOS, 1, 2], "max_tokens": 4} | request_kw
    if "prompt" in kw:
        kw.pop("prompt_token_ids")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        complete(both_replicas(stack), [ComputeClient.request(**kw)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


# ---------------------------------------------------------------- failures


def test_replica_killed_mid_stream_fails_over_with_identical_output_and_leaks_nothing(
    stack, reference, caplog
):
    ids = prompt(100, salt=7)
    expected = reference.greedy(ids, 400)
    expired_before = cache_stats(stack).num_expired_leases
    victim = stack.replicas[0]

    async def stream_and_kill() -> tuple[list[int], int, str]:
        # Attempt 1 goes to compute-0 (the first address); the retry to compute-1.
        client = ComputeClient(both_replicas(stack), TOKEN)
        tokens, cached, reason = [], -1, ""
        try:
            async for reply in client.stream(greedy_request(ids, 400)):
                tokens += reply.token_ids
                if len(tokens) >= 5 and victim.alive():
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
                if reply.finish_reason:
                    cached, reason = reply.usage.cached_prompt_tokens, reply.finish_reason
        finally:
            await client.close()
        return tokens, cached, reason

    with caplog.at_level(logging.WARNING, logger="kvtier.client"):
        tokens, cached, reason = run(stream_and_kill())
    assert not victim.alive()
    assert any("retrying on another" in r.getMessage() for r in caplog.records), "no failover happened"
    assert tokens == expected
    assert reason == "length"
    # compute-0 committed the prompt before dying: the retry found it in the cache.
    assert cached == full_blocks_below_last_token(len(ids))

    # A replacement starts now (its imports overlap the wait below); it holds no sequences.
    stack.replicas[0] = stack.start_replica(0)

    # The dead replica's lease expires and its sequence is released: nothing stays referenced.
    def released():
        s = cache_stats(stack)
        return s.num_sequences == 0 and s.num_blocks_used == 0 and s

    stats = wait_until(released, 15.0, "the dead replica's blocks released")
    assert stats.num_expired_leases == expired_before + 1


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_failover_resumes_after_the_delivered_tokens_and_the_stream_is_unchanged(stack, sampling):
    """Issue 13: the replica serving a stream dies after 40 of its 64 tokens; the retry carries
    the 40 as resume_token_ids and the next replica decodes only the other 24. What the client
    sees (tokens, text, usage) is what an uninterrupted run gives, seeded sampling included."""
    ids = prompt(70, salt=21 if sampling == "greedy" else 22)
    kw = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.9, "seed": 1234, "top_p": 0.95}

    def request():
        return ComputeClient.request(prompt_token_ids=ids, max_tokens=64, ignore_eos=True, **kw)

    async def uninterrupted() -> tuple[list[int], str]:
        client = ComputeClient([stack.replicas[1].address], TOKEN)
        try:
            done = await client.complete(request())
        finally:
            await client.close()
        return done.token_ids, done.text

    victim = stack.replicas[0]

    async def killed_after_40() -> tuple[list[int], str, list[int], int]:
        client = ComputeClient(both_replicas(stack), TOKEN)  # attempt 1: compute-0
        tokens, text, per_reply, completion = [], "", [], 0
        try:
            async for reply in client.stream(request()):
                tokens += reply.token_ids
                text += reply.text
                per_reply.append(len(reply.token_ids))
                if len(tokens) >= 40 and victim.alive():
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
                if reply.finish_reason:
                    completion = reply.usage.completion_tokens
        finally:
            await client.close()
        return tokens, text, per_reply, completion

    want_tokens, want_text = run(uninterrupted())
    queried_before = cache_stats(stack).prefix_query_tokens
    tokens, text, per_reply, completion = run(killed_after_40())
    queried = cache_stats(stack).prefix_query_tokens - queried_before
    assert not victim.alive(), "the replica was not killed mid-stream"
    stack.replicas[0] = stack.start_replica(0)  # for the next tests (its imports overlap ours)
    assert tokens == want_tokens and len(tokens) == 64
    assert text == want_text
    assert completion == 64
    # Every token arrived once, and the retry's Allocate held the prompt and the delivered
    # tokens (70 + at least 40): the second replica prefilled those, it did not decode them again.
    assert sum(per_reply) == 64
    delivered = queried - len(ids) - len(ids)
    assert 40 <= delivered < 64, f"the retry allocated {delivered} tokens beyond the prompt"


def test_cache_killed_mid_request_fails_it_fast_and_the_replica_reattaches(stack, reference):
    ids = prompt(40, salt=8)

    async def stream_until_cache_dies() -> tuple[grpc.aio.AioRpcError, float, int]:
        # One replica, one attempt: the error itself is under test, not the failover.
        client = ComputeClient([stack.replicas[1].address], TOKEN)
        received, killed_at = 0, 0.0
        try:
            async for reply in client.stream(greedy_request(ids, 900), max_attempts=1):
                received += len(reply.token_ids)
                if received >= 5 and not killed_at:
                    stack.cache.proc.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        except grpc.aio.AioRpcError as e:
            return e, time.monotonic() - killed_at, received
        finally:
            await client.close()
        raise AssertionError(f"the stream finished ({received} tokens) although the cache service died")

    error, seconds, received = run(stream_until_cache_dies(), 30.0)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert "cache service" in error.details()
    assert seconds < 5.0, f"the request hung {seconds:.1f}s after the cache service died"
    assert received < 900

    stack.cache.proc.wait()
    stack.start_cache()  # same socket, same flags: a fresh (empty) pool
    wait_replicas_serve(stack)
    first, repeat = complete(both_replicas(stack), [greedy_request(ids, 16)] * 2)
    assert first.token_ids == repeat.token_ids == reference.greedy(ids, 16)
    assert repeat.cached_prompt_tokens == full_blocks_below_last_token(len(ids))


def test_unexpected_cache_error_fails_the_requests_in_flight_and_the_replica_keeps_serving(
    module_stack, reference
):
    # A cache service taking at most 2 sequences per call refuses the replica's batched calls
    # with INVALID_ARGUMENT, which the scheduler has no answer for: its step fails.
    restart_cache(module_stack, [*DEFAULT_POOL, "--max-batch", "2"])
    address = module_stack.replicas[0].address
    prompts = [prompt(20, salt=300 + k) for k in range(12)]

    async def one(k: int) -> Completion | grpc.aio.AioRpcError:
        client = ComputeClient([address], TOKEN)
        try:
            return await client.complete(greedy_request(prompts[k], 8), max_attempts=1)
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            await client.close()

    results = run(asyncio.gather(*(one(k) for k in range(12))), 30.0)
    failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert failed, "12 concurrent requests never made a call of more than 2 sequences"
    for error in failed:
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "exceeds max_batch 2" in error.details()
    for k, result in enumerate(results):
        if isinstance(result, Completion):
            assert result.token_ids == reference.greedy(prompts[k], 8)

    # The scheduler carries on, and released every sequence the failed step held.
    (alone,) = complete([address], [greedy_request(prompts[0], 8)], max_attempts=1)
    assert alone.token_ids == reference.greedy(prompts[0], 8)
    wait_until(lambda: cache_stats(module_stack).num_sequences == 0, 5.0, "the failed sequences freed")


# ---------------------------------------------------------------- preemption (a pool too small for the load)

# 24 blocks of 16 tokens: one 150-token sequence fits with its lookahead, six at once do not.
SMALL_POOL = ["--num-blocks", "24"]


def run_preempting_load(stack: LocalStack, reference: Reference) -> None:
    prompts = [prompt(20 + 4 * k, salt=200 + k) for k in range(6)]
    addresses = both_replicas(stack)

    async def one(k: int) -> Completion:
        client = ComputeClient(addresses[k % 2 :] + addresses[: k % 2], TOKEN)
        try:
            return await client.complete(greedy_request(prompts[k], 110), max_attempts=1)
        finally:
            await client.close()

    async def all_at_once():
        return await asyncio.gather(*(one(k) for k in range(6)))

    results = run(all_at_once())
    for k, result in enumerate(results):
        assert result.token_ids == reference.greedy(prompts[k], 110), f"request {k}"


def test_swap_preemption_keeps_greedy_output_equal_to_generate(module_stack, reference):
    restart_cache(module_stack, [*SMALL_POOL, "--swap-space", "0.01"])
    run_preempting_load(module_stack, reference)
    stats = cache_stats(module_stack)
    assert stats.num_swap_out_blocks > 0, "the load never preempted: make the pool smaller"
    assert stats.num_swap_in_blocks == stats.num_swap_out_blocks
    assert stats.num_sequences == 0 and stats.num_host_blocks_used == 0


def test_recompute_preemption_without_swap_space_or_host_cache_keeps_output_equal_to_generate(
    module_stack, reference
):
    # No host area at all (swap is a share of the host cache's by default): only recompute is left.
    restart_cache(module_stack, [*SMALL_POOL, "--swap-space", "0", "--host-cache-gib", "0"])
    logs_before = [len(r.log()) for r in module_stack.replicas]
    run_preempting_load(module_stack, reference)
    stats = cache_stats(module_stack)
    assert stats.num_swap_out_blocks == 0
    new_logs = "".join(r.log()[n:] for r, n in zip(module_stack.replicas, logs_before, strict=True))
    assert "will recompute" in new_logs, "the load never preempted: make the pool smaller"


# ---------------------------------------------------------------- refusing to start


class ComputeStarts:
    """`python -m kvtier.computesvc` runs that must end on their own, started all at once: each pays
    several seconds of imports, so they overlap rather than queue."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> None:
        listen = ["--listen", f"unix://{self.run_dir / f'{name}.sock'}"] if args else []
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kvtier.computesvc", *listen, *args],
            env=child_env(self.run_dir),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self, name: str, timeout_s: float = 120.0) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of the run `name`, waiting for it to end."""
        stdout, stderr = self.procs[name].communicate(timeout=timeout_s)
        return self.procs[name].returncode, stdout, stderr

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def compute_starts(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("starts")
    starts = ComputeStarts(run_dir)
    mismatched_cache = f"unix://{run_dir / 'cache.sock'}"
    try:
        starts.start("help", "--help")
        starts.start("no-cache", "--cache", f"unix://{run_dir / 'none.sock'}", "--connect-timeout", "2")
        # Started before its cache service: it retries until the service is up.
        starts.start("mismatch", "--cache", mismatched_cache, "--connect-timeout", "60")
        with cache_service(run_dir, "--num-blocks", "8", "--num-layers", "3"):
            starts.result("mismatch")  # the cache service must outlive the attach
            yield starts
    finally:
        starts.kill_all()


def test_compute_refuses_a_pool_made_for_another_model_shape(compute_starts):
    code, _, stderr = compute_starts.result("mismatch")
    assert code == 2, stderr[-2000:]
    assert "cannot start" in stderr
    assert "this model needs [*, 2, 2, 16, 2, 16]" in stderr, stderr[-2000:]


def test_compute_without_a_cache_service_exits_2_naming_it(compute_starts):
    code, _, stderr = compute_starts.result("no-cache")
    assert code == 2, stderr[-2000:]
    assert "cannot reach the cache service" in stderr


def test_compute_help_explains_every_flag(compute_starts):
    parser = build_parser()
    assert not [a.dest for a in parser._actions if not a.help], "every flag needs a help text"
    code, stdout, stderr = compute_starts.result("help")
    assert code == 0, stderr
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in stdout
