"""A request whose client goes away frees its sequence, however the aborts interleave.

The servicer aborts a request when its Generate ends early (the client cancelled); the scheduler
frees aborted requests' sequences at the start of its next step, in one Free call. A request
aborted while that call is awaited must not be dropped with the ones it freed: before the fix it
left the scheduler's lists still holding its sequence, which stayed held for the life of the
replica's lease (the gateway test of an abandoned n > 1 completion saw it under load). Real
cache service, real replica-side scheduler and model; the second abort is injected around the
real Free call so the interleaving is the same on every run.
"""

from __future__ import annotations

import asyncio

from servers import TOKEN, ModuleLoop, cache_service

from kvtier.cache_client import CacheClient
from kvtier.computesvc.model import ModelRunner, load_model
from kvtier.computesvc.remote_cache import RemoteCache
from kvtier.computesvc.request import Request
from kvtier.computesvc.sampling import SamplingParams
from kvtier.computesvc.scheduler import Scheduler
from kvtier.model_spec import TINY_LLAMA_CONFIG
from kvtier.pool import attach_pool

BOS = TINY_LLAMA_CONFIG["bos_token_id"]
LOOP = ModuleLoop()


def test_a_request_aborted_while_another_aborted_one_is_freed_is_freed_too(tmp_path):
    loaded = load_model(None)

    async def scenario(address: str):
        client = CacheClient.connect(address, TOKEN, aio=True)
        await client.attach("abort-race", loaded.shape.fingerprint)
        pool = attach_pool(client.pool)
        runner = ModelRunner(loaded.model, pool.tensor, client.pool.block_size)
        cache = RemoteCache(client)
        scheduler = Scheduler(runner, cache, loaded.tokenizer, loaded.eos_token_ids)
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        a = Request("a", [BOS, *[5] * 40], params)
        b = Request("b", [BOS, *[6] * 40], params)
        scheduler.add(a)
        scheduler.add(b)
        await scheduler.step()
        await scheduler.step()
        assert a.sequence_id >= 0 and b.sequence_id >= 0
        free = cache.free

        async def free_while_b_is_aborted(ids, commits=()):
            scheduler.abort(b)  # b's client goes away while a's sequence is being freed
            await asyncio.sleep(0)
            return await free(ids, commits)

        cache.free = free_while_b_is_aborted
        scheduler.abort(a)
        await scheduler._drop_aborted()
        cache.free = free
        held_after_first = [r.request_id for r in scheduler.running]
        await scheduler.step()
        sync = CacheClient.connect(address, TOKEN, timeout_s=5.0)
        try:
            stats = sync.get_stats().num_sequences
        finally:
            sync.close()
        await client.close()
        scheduler = runner = None  # drop their views of the pool before it closes
        pool.close()
        return held_after_first, stats

    with cache_service(tmp_path, "--num-blocks", "64", "--lease-ttl", "30") as service:
        held, left = LOOP.run(scenario(service.address), 180)
    assert held == ["b"], held  # b still holds its sequence: it stays until a step frees it
    assert left == 0, left
