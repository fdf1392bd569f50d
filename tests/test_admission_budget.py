"""Admission charges a request the tokens it will compute (issue 35): a prompt whose system prefix
a running sequence has committed is charged only its uncached part, so a shared-prefix burst is
admitted in a few steps; a prompt that shares nothing is charged whole, as before.

The real scheduler and tiny model run in this process against a real cache service (its shared
memory pool, over gRPC), exactly as a compute replica does."""

from __future__ import annotations

import asyncio
import random

import pytest
from servers import TOKEN, cache_service

from kvtier.cache_client import CacheClient
from kvtier.computesvc.model import ModelRunner, load_model
from kvtier.computesvc.remote_cache import RemoteCache
from kvtier.computesvc.request import Request
from kvtier.computesvc.sampling import SamplingParams
from kvtier.computesvc.scheduler import Scheduler, SchedulerConfig
from kvtier.pool import attach_pool

BUDGET = SchedulerConfig.max_num_batched_tokens  # the default, 2048


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with cache_service(tmp_path_factory.mktemp("admission")) as service:
        yield service


def requests(prompts: list[list[int]], tag: str) -> list[Request]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [Request(f"{tag}{i}", p, params, tenant_salt=tag) for i, p in enumerate(prompts)]


async def admitted_per_step(address: str, reqs: list[Request]) -> list[int]:
    """Run `reqs` (all added at once) to completion through a real Scheduler; the number of
    requests admitted in each step until none waits."""
    loaded = load_model(None, dtype="float32")
    client = CacheClient.connect(address, TOKEN, aio=True)
    await client.attach("admission-test", loaded.shape.fingerprint)
    pool = attach_pool(client.pool)
    beat = asyncio.ensure_future(client.heartbeat_forever())
    try:
        runner = ModelRunner(loaded.model, pool.tensor, client.pool.block_size)
        scheduler = Scheduler(runner, RemoteCache(client), loaded.tokenizer, loaded.eos_token_ids)
        for r in reqs:
            scheduler.add(r)
        counts = []
        while scheduler.waiting:
            before = len(scheduler.waiting)
            await asyncio.wait_for(scheduler.step(), 120)
            counts.append(before - len(scheduler.waiting))
        while scheduler.has_work:
            await asyncio.wait_for(scheduler.step(), 120)
        assert all(len(r.output_token_ids) == 8 for r in reqs)
        del scheduler, runner  # the runner holds the last view of the pool: close the mapping after it
        return counts
    finally:
        beat.cancel()
        await client.close()
        pool.close()


def shared_prompts(seed: int, num_systems: int, count: int) -> list[list[int]]:
    """`count` prompts: one of `num_systems` 512-token system prompts in turn + a 32-token question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(512)] for _ in range(num_systems)]
    return [systems[i % num_systems] + [rng.randrange(256) for _ in range(32)] for i in range(count)]


def test_a_shared_prefix_burst_is_charged_its_uncached_tokens_and_admitted_in_few_steps(service):
    reqs = requests(shared_prompts(0, 8, 48), "shared")
    counts = asyncio.run(admitted_per_step(service.address, reqs))
    # Charged whole (544 tokens), 3 requests fit a step: 16 steps. The first 8 (one per system
    # prompt) are charged whole, then each of the others 32 tokens + its last partial block.
    assert len(counts) <= 5, counts
    print("admitted per step", counts)
    assert counts[:2] == [3, 3], counts  # nothing committed yet: whole prompts, as before
    hits = [r.num_cached_prompt_tokens for r in reqs]
    assert sum(h >= 512 for h in hits) >= 36, (counts, hits)
    # No step admitted more tokens to compute than its budget.
    computed = [len(r.prompt_token_ids) - h for r, h in zip(reqs, hits, strict=True)]
    start = 0
    for n in counts:
        assert sum(computed[start : start + n]) <= BUDGET, (counts, computed)
        start += n


def test_prompts_that_share_nothing_are_charged_whole_as_before(service):
    rng = random.Random(1)
    reqs = requests([[rng.randrange(256) for _ in range(500)] for _ in range(12)], "unique")
    counts = asyncio.run(admitted_per_step(service.address, reqs))
    assert counts == [4, 4, 4], counts  # 4 x 500 tokens fit 2048, a fifth does not
    assert all(r.num_cached_prompt_tokens == 0 for r in reqs)


def test_requests_sharing_a_prompt_still_being_computed_wait_for_it_and_hit_it(service):
    # Two system prompts, six requests each, all at once. Admitted at once, the third request
    # (system 0 again) computed system 0's 512 tokens a second time in the same step, and more
    # copies followed; now it waits one step for the first request's commit and hits it.
    reqs = requests(shared_prompts(2, 2, 12), "dedup")
    counts = asyncio.run(admitted_per_step(service.address, reqs))
    hits = [r.num_cached_prompt_tokens for r in reqs]
    assert counts == [2, 10], (counts, hits)
    assert hits[:2] == [0, 0] and all(h >= 512 for h in hits[2:]), (counts, hits)
